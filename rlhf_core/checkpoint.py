"""Training state on disk without pickle: tensors in safetensors, everything else in JSON.

`save_training_state` writes optimizer, scheduler, RNG and loop position beside a checkpoint;
`load_training_state` restores them so a resumed run continues exactly where it stopped. Nested
containers are encoded so that int dict keys and tuples survive the JSON round trip.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlhf_core.ownership import remove_orphan_temps  # noqa: F401  (resume cleans up with it)
from rlhf_core.training import atomic_dir

logger = logging.getLogger(__name__)

STATE_DIR = "training_state"
TENSORS = "tensors.safetensors"
STATE_JSON = "state.json"


def encode(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "t") -> Any:
    """Replace tensors by references into `tensors`; keep key and container types explicit."""
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}.{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {"__dict__": [[encode(k, tensors, prefix), encode(v, tensors, prefix)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, prefix) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, tensors, prefix) for v in obj]
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in training state without pickle")


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
        if "__dict__" in obj:
            return {decode(k, tensors): decode(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(decode(v, tensors) for v in obj["__tuple__"])
    return obj


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(directory: str | Path, *, optimizer, scheduler, progress: dict[str, Any]) -> Path:
    """Write <directory>/training_state/ atomically: tensors.safetensors + state.json.

    optimizer None: its state is not saved (DeepSpeed and FSDP split it across processes); a resume
    then restarts the optimizer's moments and keeps everything else.
    """
    target = Path(directory) / STATE_DIR
    tensors: dict[str, torch.Tensor] = {}
    payload = {
        "optimizer": None if optimizer is None else encode(optimizer.state_dict(), tensors, "optimizer"),
        "scheduler": encode(scheduler.state_dict(), tensors, "scheduler"),
        "rng": encode(rng_state(), tensors, "rng"),
        "progress": encode(progress, tensors, "progress"),
    }
    with atomic_dir(target) as tmp:
        save_file(tensors, str(tmp / TENSORS))
        (tmp / STATE_JSON).write_text(json.dumps(payload))
    return target


def load_training_state(directory: str | Path, *, optimizer, scheduler) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG from <directory>/training_state/; return the progress dict."""
    source = Path(directory) / STATE_DIR
    tensors = load_file(str(source / TENSORS))
    payload = json.loads((source / STATE_JSON).read_text())
    if payload["optimizer"] is not None:
        optimizer.load_state_dict(decode(payload["optimizer"], tensors))
    scheduler.load_state_dict(decode(payload["scheduler"], tensors))
    set_rng_state(decode(payload["rng"], tensors))
    return decode(payload["progress"], tensors)


def has_training_state(directory: str | Path) -> bool:
    source = Path(directory) / STATE_DIR
    return (source / TENSORS).is_file() and (source / STATE_JSON).is_file()


def checkpoint_step(path: Path) -> int | None:
    """N for a directory named checkpoint-N, else None."""
    name = path.name
    if name.startswith("checkpoint-") and name.removeprefix("checkpoint-").isdigit():
        return int(name.removeprefix("checkpoint-"))
    return None


def safetensors_intact(path: str | Path) -> bool:
    """True when `path` is a whole safetensors file: its header parses and its size is exactly what the
    header says (a truncated write fails this). No tensor is loaded; flipped bits inside the data are
    not detected (the format carries no checksum)."""
    import struct

    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return False
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                return False
            header = json.loads(f.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        return size == 8 + length + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint directory `path` cannot be resumed from (a sentence), or None when it is intact."""
    path = Path(path)
    if not has_training_state(path):
        return "it has no training state"
    for file in sorted(path.rglob("*.safetensors")):
        if not safetensors_intact(file):
            return f"{file} is truncated or corrupt"
    for file in sorted(path.rglob("*.json")):
        try:
            json.loads(file.read_text())
        except (OSError, ValueError):
            return f"{file} is truncated or corrupt"
    return None


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint-N directory with the largest N that is complete and intact.

    Checkpoint directories appear by one rename once complete, so training state means complete; a
    newer one whose files were truncated or damaged afterwards (a full disk, a copy cut short) is
    skipped with a warning naming it, and the previous good one is returned.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [(checkpoint_step(p), p) for p in directory.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    for _, path in sorted(found, reverse=True):
        if not has_training_state(path):
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s for resume: %s; falling back to the previous one", path, problem)
    return None
