"""Loading tokenizers and models from a local directory or a hub name, with clear errors.

`models:/` registry URIs are resolved to a local directory by the tasks (tasks/stages/data.py `resolve_model_source`,
through tasks/registry/) before they get here; the core only sees directories and hub names. `lora_config`
is the one place PEFT's LoRA settings are built, for the policy and the reward model alike.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from safetensors import SafetensorError, safe_open

from rlhf_core.config.errors import UserError

if TYPE_CHECKING:
    from rlhf_core.config import LoraSettings, ModelConfig, RLConfig

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "auto": "auto"}


class ModelSourceError(UserError):
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
    for weights in sorted(path.glob("*.safetensors")):  # reads each header only: a truncated copy fails here
        try:
            with safe_open(str(weights), "pt"):
                pass
        except (SafetensorError, OSError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ModelSourceError(
                f"{field}: {weights} is not a complete safetensors file ({first}); copy or download it again"
            ) from None


# transformers' from_pretrained changes process-wide state while it builds a model (torch's default dtype,
# torch.nn.init patched to do nothing, weight tying switched off until the weights are in): a model built on
# another thread meanwhile (the registration thread loads each checkpoint it logs) can come out with its tied
# weights left on the meta device, or a new layer left uninitialized. Every model the pipeline builds, on any
# thread, is built under this lock.
MODEL_BUILDING = threading.RLock()


def load_pretrained(loader, source, **kwargs):
    """`loader.from_pretrained(source, **kwargs)` under MODEL_BUILDING."""
    with MODEL_BUILDING:
        return loader.from_pretrained(source, **kwargs)


def from_pretrained_checked(loader, source: str, field: str, **kwargs):
    """`loader.from_pretrained(source)` with the source checked first and any failure as one sentence naming `field`."""
    check_source(source, field)
    try:
        return load_pretrained(loader, str(Path(source).expanduser()) if looks_like_path(source) else source, **kwargs)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelSourceError(f"{field}: could not load '{source}' ({first})") from None


def ensure_pad_token(tokenizer, source: str) -> None:
    """Give the tokenizer a pad token, borrowing eos when it has none (as TRL does)."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token is None:
        raise ModelSourceError(
            f"tokenizer from {source} has no pad token and no eos token to borrow; add a pad token to it"
        )
    tokenizer.pad_token = tokenizer.eos_token


def generation_config_of(source: str, *, trust_remote_code: bool = False):
    """The GenerationConfig a model directory or hub name ships, else the one its config.json implies."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except (OSError, ValueError):
        return GenerationConfig.from_model_config(
            AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        )


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_token_ids(
    tokenizer, generation_config=None, *, stop_token: str = "eos", stop_tokens=(), field: str = "rl.stop_token"
) -> tuple[int, ...]:
    """The token ids that end a response, in a stable order and without repeats.

    stop_token 'eos': every id of `generation_config.eos_token_id` (an int or a list: instruct models
    stop on two) and the tokenizer's eos; 'none': nothing; any other string: that token. `stop_tokens`
    adds more tokens. The pad id plays no part: it may equal a stop id (Qwen2.5 base, GPT-2 once eos
    is borrowed as pad) or be missing. Raises ModelSourceError naming the field for a token the
    tokenizer does not know, and for 'eos' when the model has no eos at all.
    """
    ids: list[int] = []
    if stop_token == "eos":
        ids += _as_ids(getattr(generation_config, "eos_token_id", None)) + _as_ids(tokenizer.eos_token_id)
        if not ids:
            raise ModelSourceError(
                f"{field} is 'eos' but neither the policy's generation_config nor its tokenizer has an "
                "eos token; name the token that ends a response in rl.stop_tokens, or set rl.stop_token: none"
            )
    vocab = tokenizer.get_vocab()
    named = [(field, stop_token)] if stop_token not in ("eos", "none") else []
    named += [(f"rl.stop_tokens[{i}]", token) for i, token in enumerate(stop_tokens)]
    for where, token in named:
        if token in vocab:
            ids.append(int(vocab[token]))
            continue
        # text that is one token although the vocabulary spells it otherwise ("\n" is 'Ċ' in a byte-level BPE)
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1 or (encoded[0] == tokenizer.unk_token_id and token != tokenizer.unk_token):
            example = tokenizer.convert_ids_to_tokens(ids[0]) if ids else "<|im_end|>"
            raise ModelSourceError(
                f"{where}: {token!r} is not a token of the policy's tokenizer ({len(vocab)} tokens, "
                f"and it encodes to {len(encoded)}); give one token's exact text, e.g. {example!r}"
            )
        ids.append(int(encoded[0]))
    return tuple(dict.fromkeys(ids))


def run_stop_ids(tokenizer, generation_config, rl: RLConfig) -> tuple[int, ...]:
    """`stop_token_ids` with the run's rl.stop_token and rl.stop_tokens: what every stage stops on."""
    return stop_token_ids(tokenizer, generation_config, stop_token=rl.stop_token, stop_tokens=rl.stop_tokens)


def load_tokenizer(
    source: str,
    *,
    field: str = "model.tokenizer",
    revision: str | None = None,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
):
    """The tokenizer of `source`, with a pad token; `chat_template` (model.chat_template: a file or the
    template itself) when it has none, so that every checkpoint and the export save it."""
    from transformers import AutoTokenizer

    from rlhf_core.data.chat import supply_chat_template

    tokenizer = from_pretrained_checked(
        AutoTokenizer, source, field, revision=revision, trust_remote_code=trust_remote_code
    )
    ensure_pad_token(tokenizer, source)
    supply_chat_template(tokenizer, chat_template)
    return tokenizer


def model_tokenizer(model: ModelConfig, source: str):
    """A stage's tokenizer from `source` with the model.* loading options and model.chat_template (saved with
    every checkpoint, so the export carries it)."""
    return load_tokenizer(
        source, revision=model.revision, trust_remote_code=model.trust_remote_code, chat_template=model.chat_template
    )


def load_causal_lm(
    source: str,
    *,
    field: str = "model.base",
    revision: str | None = None,
    trust_remote_code: bool = False,
    torch_dtype: str = "float32",
):
    from transformers import AutoModelForCausalLM

    return from_pretrained_checked(
        AutoModelForCausalLM,
        source,
        field,
        revision=revision,
        trust_remote_code=trust_remote_code,
        dtype=DTYPES[torch_dtype],
    )


def prepare_for_training(model, *, gradient_checkpointing: bool) -> None:
    """Memory options before training: activation recomputation (and no KV cache, which it conflicts with)."""
    if gradient_checkpointing:
        # non-reentrant (TRL's default): gradients reach LoRA adapters behind frozen embeddings
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False


def lora_config(lora: LoraSettings, task: Literal["CAUSAL_LM", "SEQ_CLS"]):
    """PEFT's LoraConfig from the `model.lora` settings: task CAUSAL_LM for the policy, SEQ_CLS for the reward
    model, whose new score head is trained whole beside the adapters (modules_to_save=["score"])."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType[task],
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        **({"modules_to_save": ["score"]} if task == "SEQ_CLS" else {}),
    )
