"""Training state on disk without pickle: tensors in safetensors, everything else in JSON.

`save_training_state` writes optimizer, scheduler, RNG and loop position beside a checkpoint;
`load_training_state` restores them so a resumed run continues exactly where it stopped. Nested
containers are encoded so that int dict keys and tuples survive the JSON round trip.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlhf_core.storage.ownership import remove_orphan_temps  # noqa: F401  (resume cleans up with it)
from rlhf_core.storage.saving import atomic_dir

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


def save_training_state(
    directory: str | Path,
    *,
    optimizer,
    scheduler,
    progress: dict[str, Any],
    process_rngs: list[dict[str, Any]] | None = None,
) -> Path:
    """Write <directory>/training_state/ atomically: tensors.safetensors + state.json.

    optimizer None: its state is not saved (DeepSpeed and FSDP split it across processes); a resume
    then restarts the optimizer's moments and keeps everything else. `process_rngs`: every process's
    `rng_state()` in rank order (data parallel: each process samples from its own stream), which
    `restore_process_rng` gives back to each of them on resume.
    """
    target = Path(directory) / STATE_DIR
    tensors: dict[str, torch.Tensor] = {}
    payload = {
        "optimizer": None if optimizer is None else encode(optimizer.state_dict(), tensors, "optimizer"),
        "scheduler": encode(scheduler.state_dict(), tensors, "scheduler"),
        "rng": encode(rng_state(), tensors, "rng"),
        "progress": encode(progress, tensors, "progress"),
    }
    if process_rngs is not None and len(process_rngs) > 1:
        payload["process_rngs"] = encode(process_rngs, tensors, "process_rngs")
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


def restore_process_rng(directory: str | Path, rank: int, world: int) -> bool:
    """Set this process's RNG to what it was when the checkpoint was saved by `world` processes; False (and
    nothing set) when the checkpoint holds no such state (one process, another process count, an older save)."""
    source = Path(directory) / STATE_DIR
    payload = json.loads((source / STATE_JSON).read_text())
    saved = payload.get("process_rngs")
    if saved is None or len(saved) != world:
        return False
    set_rng_state(decode(saved[rank], load_file(str(source / TENSORS))))
    return True


def has_training_state(directory: str | Path) -> bool:
    source = Path(directory) / STATE_DIR
    return (source / TENSORS).is_file() and (source / STATE_JSON).is_file()


def checkpoint_step(path: Path) -> int | None:
    """N for a directory named checkpoint-N, else None."""
    name = path.name
    if name.startswith("checkpoint-") and name.removeprefix("checkpoint-").isdigit():
        return int(name.removeprefix("checkpoint-"))
    return None


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(N, path) of every checkpoint-N directory in `directory`, oldest first; [] when it does not exist.

    Complete or not: callers keep their own filter (`has_training_state`, `checkpoint_problem`, a marker)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in directory.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found)


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
    for _, path in reversed(list_checkpoints(directory)):
        if not has_training_state(path):
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s for resume: %s; falling back to the previous one", path, problem)
    return None


def checkpoints_to_delete(dirs_with_metrics, keep_last: int | None, best_key: str | None) -> list[Path]:
    """Which checkpoint-N directories retention deletes: all but the newest `keep_last` and the best one.

    dirs_with_metrics: (path, metrics dict or None) pairs, paths named checkpoint-N (others are never
    returned). The best is the one whose metrics[best_key] is largest (finite numbers only; a tie goes
    to the newer one); with no best_key or no such value only the newest are kept. keep_last None
    keeps everything. Returned oldest first. Pure: reads nothing, deletes nothing.
    """
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    steps = sorted(
        ((checkpoint_step(Path(p)), Path(p), m) for p, m in dirs_with_metrics if checkpoint_step(Path(p)) is not None),
        key=lambda t: t[0],
    )
    keep = {path for _, path, _ in steps[-keep_last:]}
    if best_key is not None:
        scored = [
            (float(m[best_key]), step, path)
            for step, path, m in steps
            if isinstance(m, dict)
            and isinstance(m.get(best_key), (int, float))
            and not isinstance(m.get(best_key), bool)
            and math.isfinite(m[best_key])
        ]
        if scored:
            keep.add(max(scored)[2])
    return [path for _, path, _ in steps if path not in keep]


def _read_metrics(path: Path) -> dict | None:
    try:
        metrics = json.loads((path / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) else None


def prune_checkpoints(
    directory: str | Path, keep_last: int | None, best_keys: tuple[str, ...] | str | None
) -> list[Path]:
    """Delete the checkpoint-N directories of `directory` that `checkpoints_to_delete` selects; return them.

    Only real directories (no symlinks) carrying the marker `atomic_dir` writes are considered or
    deleted; anything else in `directory` is left alone and does not count towards keep_last.
    best_keys: the metric(s) in each checkpoint's metrics.json that name the best one; the first key
    any checkpoint has is used. A directory is first renamed to a hidden sibling, then removed, so a
    run killed half-way leaves no half-deleted checkpoint-N (`remove_orphan_temps` finishes the job).
    Call on the main process only, after the newest checkpoint was saved and registered.
    """
    import shutil
    import tempfile

    from rlhf_core.storage.ownership import ATOMIC_CREATOR, read_marker, write_marker

    if keep_last is None:
        return []
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for _, path in list_checkpoints(directory):
        if path.is_symlink():
            continue
        marker = read_marker(path)
        if marker is None or marker.get("created_by") != ATOMIC_CREATOR:
            continue
        found.append((path, _read_metrics(path)))
    keys = (best_keys,) if isinstance(best_keys, str) else tuple(best_keys or ())
    best_key = next((k for k in keys if any(m is not None and k in m for _, m in found)), None)
    deleted = []
    for path in checkpoints_to_delete(found, keep_last, best_key):
        holder = Path(tempfile.mkdtemp(prefix=f".{path.name}-deleting-", dir=directory))
        try:
            write_marker(holder, ATOMIC_CREATOR, deleting=path.name)  # an interrupted removal is an orphan temp
            path.rename(holder / path.name)
        except OSError:
            shutil.rmtree(holder, ignore_errors=True)
            logger.warning("could not remove old checkpoint %s", path, exc_info=True)
            continue
        shutil.rmtree(holder, ignore_errors=True)
        logger.info("removed checkpoint %s (run.keep_last_checkpoints=%d)", path, keep_last)
        deleted.append(path)
    return deleted


def link_identical_files(artifact_dir: Path | None, checkpoint_dir: Path) -> int:
    """Replace each file under `artifact_dir` whose bytes equal a file of `checkpoint_dir` by a hard link
    to it; returns the bytes saved.

    With a local artifact store (a SQLite tracking URI puts it in mlruns/ beside the database), a
    registered version would otherwise be a second full copy of the checkpoint's weights on the same
    disk. The checkpoint's files are never written in place (checkpoints are replaced by renames), so
    sharing them is safe, and a pruned checkpoint leaves the linked artifact intact. Files on another
    filesystem, or that differ, are left as they are.
    """
    import hashlib

    if artifact_dir is None or not artifact_dir.is_dir():
        return 0

    def digest(path: Path) -> str:
        h = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        return h.hexdigest()

    by_size: dict[int, list[Path]] = {}
    for source in Path(checkpoint_dir).glob("*.safetensors"):
        by_size.setdefault(source.stat().st_size, []).append(source)
    saved = 0
    for artifact in artifact_dir.rglob("*.safetensors"):
        candidates = by_size.get(artifact.stat().st_size, [])
        if not candidates:
            continue
        wanted = digest(artifact)
        for source in candidates:
            if os.path.samefile(source, artifact) or digest(source) != wanted:
                continue
            tmp = artifact.with_name(f".{artifact.name}.link")
            try:
                os.link(source, tmp)
                os.replace(tmp, artifact)
                saved += artifact.stat().st_size
            except OSError:  # another filesystem, or links not allowed: keep the copy
                tmp.unlink(missing_ok=True)
            break
    return saved
