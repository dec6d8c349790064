"""Writing weights safely: atomic directories that never leave a half-written one, modes that follow the
umask, Hugging Face directories (LoRA merged, adapter kept), restoring weights, refusing non-finite ones."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_core.storage.ownership import ATOMIC_CREATOR, MARKER, OwnershipError, is_owned, write_marker


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask both sets and gets)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Give `root` and everything under it the modes a plain mkdir/open would: 0o777 / 0o666 less the umask.

    tempfile.mkdtemp makes 0700 directories and some writers make 0600 files; the weights a run
    publishes must be readable as the user's umask says (0755 / 0644 under the usual 022).
    Execute bits of files are kept (less the umask).
    """
    mask = current_umask()
    root = Path(root)
    root.chmod(0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                path.chmod(0o777 & ~mask)
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                path.chmod((0o666 | (path.stat().st_mode & 0o111)) & ~mask)


def _refuse_unowned(output_dir: Path) -> None:
    if output_dir.is_symlink() or (output_dir.exists() and not output_dir.is_dir()):
        raise OwnershipError(
            f"refusing to replace {output_dir}: it is not a directory the pipeline created; "
            "move it away or choose another output path"
        )
    if output_dir.is_dir() and not is_owned(output_dir) and any(output_dir.iterdir()):
        raise OwnershipError(
            f"refusing to replace {output_dir}: it is a non-empty directory the pipeline did not "
            f"create (no {MARKER} marker); move it away or choose another output path"
        )


@contextmanager
def atomic_dir(output_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `output_dir` to fill; on success it replaces `output_dir` by renames.

    A crash while filling it leaves the previous directory (or none), never a half-written one. The
    temporary directory carries the ownership marker from its creation (so a killed run's leftover
    is recognisably ours, see `ownership.remove_orphan_temps`) and keeps it once renamed. An
    existing `output_dir` is replaced only when it carries the marker (or is empty): anything else
    raises OwnershipError before any work. Modes follow the umask (see `apply_umask`).
    """
    output_dir = Path(output_dir)
    _refuse_unowned(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}-", dir=output_dir.parent))
    try:
        write_marker(tmp, ATOMIC_CREATOR)
        yield tmp
        if not is_owned(tmp):
            write_marker(tmp, ATOMIC_CREATOR)
        apply_umask(tmp)
        _refuse_unowned(output_dir)  # it may have appeared while we filled tmp
        old = None
        if output_dir.exists():
            # the previous one goes aside first, so that no moment leaves neither; a run killed between
            # the two renames leaves it in a marked holder that `remove_orphan_temps` puts back
            old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}-old-", dir=output_dir.parent))
            write_marker(old, ATOMIC_CREATOR, aside_of=output_dir.name)
            output_dir.rename(old / output_dir.name)
        try:
            tmp.rename(output_dir)
        except BaseException:
            if old is not None:
                (old / output_dir.name).rename(output_dir)
                shutil.rmtree(old, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_pretrained_atomic(
    model, tokenizer, output_dir: str | Path, extra: Callable[[Path], None] | None = None
) -> Path:
    """Save model (safetensors) and tokenizer atomically (see `atomic_dir`); `extra(tmp)` may add files."""
    with atomic_dir(output_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
    return Path(output_dir)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def save_hf_dir(model, tokenizer, directory: str | Path, state_dict: dict | None = None) -> None:
    """A directory `from_pretrained` loads: full weights (LoRA merged into a copy) and the tokenizer.

    With LoRA the adapter is saved too, in `adapter/`, so training can resume from it. `state_dict`:
    the model's full weights gathered from sharded processes (ZeRO-3, FSDP), saved instead of its own.
    """
    import copy

    directory = Path(directory)
    if state_dict is not None:
        if is_peft(model):
            raise ValueError("LoRA models are not trained with sharded parameters (ZeRO-3, FSDP); use DDP or ZeRO-2")
        model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    elif is_peft(model):
        model.save_pretrained(directory / "adapter")
        copy.deepcopy(model).merge_and_unload().save_pretrained(directory, safe_serialization=True)
    else:
        model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def restore_weights(model, directory: str | Path) -> None:
    """Load the trainable weights saved by `save_hf_dir` into `model` (the adapter with LoRA)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if is_peft(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(directory / "adapter" / "adapter_model.safetensors")))
        return
    missing, unexpected = model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if unexpected or any(not (tied and key.endswith("lm_head.weight")) for key in missing):
        raise RuntimeError(f"{directory} does not match the model (missing {missing}, unexpected {unexpected})")


def assert_finite(model, what: str, state_dict: dict | None = None) -> None:
    """Refuse to save weights with NaN or inf in them: a checkpoint must never be corrupt.

    `state_dict`: the gathered weights to check instead of the (sharded) model's own.
    """
    named = state_dict.items() if state_dict is not None else model.named_parameters()
    for name, param in named:
        if param.is_floating_point() and not param.detach().isfinite().all():
            raise FloatingPointError(f"{what} has non-finite values in {name}; not saving a corrupt checkpoint")
