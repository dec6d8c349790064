"""Pieces every training loop shares: seeding, the Accelerator, optimizer and schedule, atomic saves."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Protocol

from rlhf_core.config import OptimSettings, RunConfig
from rlhf_core.ownership import ATOMIC_CREATOR, MARKER, OwnershipError, is_owned, write_marker


class OnLog(Protocol):
    def __call__(self, metrics: dict[str, float], step: int) -> None: ...


class OnStep(Protocol):
    """Called on every process after each optimizer step (the others are called on the main one only)."""

    def __call__(self, step: int) -> None: ...


class OnCheckpoint(Protocol):
    def __call__(self, path: Path, step: int) -> None: ...


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_accelerator(run: RunConfig, gradient_accumulation_steps: int = 1, *, micro_batch_size: int | None = None,
                     max_grad_norm: float | None = None):
    """An Accelerator honouring run.device and run.mixed_precision (launch-time settings win).

    Under DeepSpeed, `micro_batch_size` and `max_grad_norm` fill the engine's "auto" batch size and
    clipping: the loops prepare no DataLoader from which accelerate could read them.
    """
    from accelerate import Accelerator

    accelerator = Accelerator(
        cpu=run.device == "cpu",
        mixed_precision=run.mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        ds = plugin.deepspeed_config
        if micro_batch_size is not None and ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds["train_micro_batch_size_per_gpu"] = micro_batch_size
        if max_grad_norm is not None and ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = max_grad_norm
    return accelerator


def disable_dropout(*models) -> None:
    """Dropout off in every given model (LoRA's branch dropout and attention dropout included), as TRL's
    `disable_dropout`: in RL the log-probabilities of one update must match the rollout's, so that the
    importance ratio is exactly 1 on-policy. The modules' `training` flags are left as they are."""
    import torch

    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            for attr in ("attention_dropout", "dropout", "attn_dropout", "resid_dropout"):
                if isinstance(getattr(module, attr, None), float):
                    setattr(module, attr, 0.0)


def build_optimizer(model, settings: OptimSettings, max_steps: int):
    """AdamW over the trainable parameters and the configured warm-up + schedule."""
    import torch
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=settings.weight_decay)
    scheduler = get_scheduler(
        settings.lr_scheduler, optimizer, num_warmup_steps=settings.warmup_steps, num_training_steps=max_steps
    )
    return optimizer, scheduler


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
        raise OwnershipError(f"refusing to replace {output_dir}: it is not a directory the pipeline created; "
                             "move it away or choose another output path")
    if output_dir.is_dir() and not is_owned(output_dir) and any(output_dir.iterdir()):
        raise OwnershipError(f"refusing to replace {output_dir}: it is a non-empty directory the pipeline did not "
                             f"create (no {MARKER} marker); move it away or choose another output path")


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


def save_pretrained_atomic(model, tokenizer, output_dir: str | Path, extra: Callable[[Path], None] | None = None) -> Path:
    """Save model (safetensors) and tokenizer atomically (see `atomic_dir`); `extra(tmp)` may add files."""
    with atomic_dir(output_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
    return Path(output_dir)


def epoch_batches(n_rows: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a permutation fixed by (seed, epoch), incomplete tail dropped.

    With the epoch and the position inside it saved, a resumed run sees exactly the same data order.
    """
    import torch

    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    size = min(batch_size, n_rows)
    return [order[i : i + size] for i in range(0, n_rows - size + 1, size)]


class ShardedBatches:
    """Data-parallel batch order: each optimizer step consumes `world` consecutive batches of the
    epoch's permutation and process `rank` takes the `rank`-th one (different data on every
    process, the same order on one process). With world 1 this is `epoch_batches` in order.

    `epoch` and `position` are what a checkpoint saves to resume the exact order.
    """

    def __init__(self, n_rows: int, batch_size: int, seed: int, *, rank: int, world: int, epoch: int = 0, position: int = 0):
        self.n_rows, self.batch_size, self.seed, self.rank, self.world = n_rows, batch_size, seed, rank, world
        self.epoch, self.position = epoch, position
        self.batches = epoch_batches(n_rows, batch_size, seed, epoch)
        if len(self.batches) < world:
            raise ValueError(f"{n_rows} rows make {len(self.batches)} batches of {batch_size}, fewer than the "
                             f"{world} processes that each need one per step; lower the batch size or add data")

    def next(self) -> list[int]:
        """This process's batch for the next step."""
        indices = self.batches[self.position + self.rank]
        self.position += self.world
        if self.position + self.world > len(self.batches):
            self.epoch, self.position = self.epoch + 1, 0
            self.batches = epoch_batches(self.n_rows, self.batch_size, self.seed, self.epoch)
        return indices

    @property
    def fraction(self) -> float:
        return self.epoch + self.position / max(len(self.batches), 1)


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
