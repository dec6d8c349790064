"""Proof, before any training, that every process of a stage sees the same run directory.

On a cluster the stage's processes run on several machines and hand each other checkpoints through
`run.output_dir` (rank 0 writes, every rank resumes from it), so it must be storage that every node
mounts at the same path. Each process writes a mark into `<output_dir>/.rlhf-probe/<token>/`, waits
for the others, and lists what it sees; a process that misses a mark means the directory is not
shared, and every process raises the same one-sentence error naming the directory and the nodes.
The token is rank 0's, so marks left by an earlier, killed attempt never count.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_core.config.errors import UserError

PROBE_DIR = ".rlhf-probe"


class SharedStorageError(UserError):
    """run.output_dir is not the same storage on every node of the stage."""


def write_mark(directory: Path, rank: int, node: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "node": node}))


def missing_marks(directory: Path, world: int) -> list[int]:
    """The ranks whose mark this process does not see in `directory`."""
    return [r for r in range(world) if not (directory / f"rank-{r}.json").is_file()]


def storage_verdict(output_dir: Path, views: list[tuple[int, str, list[int]]]) -> str | None:
    """The sentence for every process's (rank, node, ranks it missed), or None when every process saw them all."""
    nodes = {rank: node for rank, node, _ in views}
    blind = [(rank, node, missed) for rank, node, missed in views if missed]
    if not blind:
        return None
    rank, node, missed = blind[0]
    writers = ", ".join(f"rank {r} on {nodes.get(r, '?')}" for r in missed)
    return (
        f"run.output_dir {output_dir} is not shared storage: the worker of rank {rank} on {node} cannot see "
        f"what {writers} wrote there; every node must mount it at the same path (NFS, a shared volume)"
    )


def check_shared_storage(
    output_dir: str | Path,
    rank: int,
    world: int,
    node: str,
    *,
    from_main: Callable[[Any], Any],
    all_gather: Callable[[Any], list[Any]],
) -> None:
    """Raise SharedStorageError on every process unless all of them see each other's marks under `output_dir`.

    `from_main` and `all_gather` are the process group's collectives (rlhf_core.training.parallel); every process
    calls this at the same point. The marks are removed again.
    """
    output_dir = Path(output_dir)
    directory = output_dir / PROBE_DIR / from_main(uuid.uuid4().hex)
    write_mark(directory, rank, node)
    all_gather(None)  # every mark written before anyone looks
    views = all_gather((rank, node, missing_marks(directory, world)))
    (directory / f"rank-{rank}.json").unlink(missing_ok=True)
    for empty in (directory, directory.parent):  # the last process out removes them
        try:
            empty.rmdir()
        except OSError:
            pass
    verdict = storage_verdict(output_dir, views)
    if verdict is not None:
        raise SharedStorageError(verdict)
