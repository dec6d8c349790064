"""Loading tokenizers and models from a local directory or a hub name, with clear errors.

`models:/` registry URIs are resolved to a local directory by tasks/tracking.py before they get here;
the core only sees directories and hub names.
"""

from __future__ import annotations

from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "auto": "auto"}


class ModelSourceError(ValueError):
    """A model or tokenizer source that cannot be loaded; the message is one sentence."""


def looks_like_path(source: str) -> bool:
    return Path(source).exists() or source.startswith(("/", "./", "../", "~")) or source.count("/") > 1


def check_source(source: str, field: str) -> None:
    """Fail early when `source` is meant as a directory but is not a model directory."""
    if not looks_like_path(source):
        return
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ModelSourceError(f"{field}: directory {source} does not exist")
    if not (path / "config.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelSourceError(f"{field}: {path} is not a Hugging Face model directory (no config.json)")


def from_pretrained_checked(loader, source: str, field: str, **kwargs):
    """`loader.from_pretrained(source)` with the source checked first and any failure as one sentence naming `field`."""
    check_source(source, field)
    try:
        return loader.from_pretrained(str(Path(source).expanduser()) if looks_like_path(source) else source, **kwargs)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelSourceError(f"{field}: could not load '{source}' ({first})") from None


def ensure_pad_token(tokenizer, source: str) -> None:
    """Give the tokenizer a pad token, borrowing eos when it has none (as TRL does)."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token is None:
        raise ModelSourceError(f"tokenizer from {source} has no pad token and no eos token to borrow; add a pad token to it")
    tokenizer.pad_token = tokenizer.eos_token


def load_tokenizer(source: str, *, field: str = "model.tokenizer", revision: str | None = None,
                   trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = from_pretrained_checked(AutoTokenizer, source, field, revision=revision, trust_remote_code=trust_remote_code)
    ensure_pad_token(tokenizer, source)
    return tokenizer


def load_causal_lm(source: str, *, field: str = "model.base", revision: str | None = None,
                   trust_remote_code: bool = False, torch_dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    return from_pretrained_checked(
        AutoModelForCausalLM, source, field, revision=revision, trust_remote_code=trust_remote_code,
        dtype=DTYPES[torch_dtype],
    )


def prepare_for_training(model, *, gradient_checkpointing: bool) -> None:
    """Memory options before training: activation recomputation (and no KV cache, which it conflicts with)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
