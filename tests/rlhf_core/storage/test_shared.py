"""rlhf_core/storage/shared.py: every process proves it sees the others' marks in run.output_dir.

The processes are threads here, with collectives over a barrier; the real thing (Ray workers on two
nodes, one of them with its own private run directory) is tests/distributed/test_ray_launcher.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rlhf_core.storage.shared import PROBE_DIR, SharedStorageError, check_shared_storage, storage_verdict


class ThreadGroup:
    """from_main and all_gather for `world` threads, each call a rendezvous of all of them."""

    def __init__(self, world: int):
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world, timeout=20)
        self.local = threading.local()

    def all_gather(self, obj):
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def from_main(self, obj):
        return self.all_gather(obj)[0]


def run_ranks(dirs: list[Path]) -> list[BaseException | None]:
    """check_shared_storage on one thread per directory (rank r sees dirs[r] as run.output_dir)."""
    group, errors = ThreadGroup(len(dirs)), [None] * len(dirs)

    def rank(r: int) -> None:
        group.local.rank = r
        try:
            check_shared_storage(
                dirs[r], r, len(dirs), f"node-{r}", from_main=group.from_main, all_gather=group.all_gather
            )
        except BaseException as err:  # noqa: BLE001 (collected for the test)
            errors[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_processes_that_share_the_directory_pass_and_leave_nothing_behind(tmp_path):
    shared = tmp_path / "out"
    assert run_ranks([shared] * 3) == [None, None, None]
    assert not (shared / PROBE_DIR).exists()


def test_a_process_with_its_own_directory_fails_every_process_with_one_sentence(tmp_path):
    dirs = [tmp_path / "shared", tmp_path / "shared", tmp_path / "private"]
    errors = run_ranks(dirs)
    assert all(isinstance(e, SharedStorageError) for e in errors)
    # every process raises the same sentence (each names its own run.output_dir, one path on a real cluster):
    # the first process that missed a mark, and whose marks it missed
    assert len({str(e).split(" is not shared storage")[1] for e in errors}) == 1
    message = str(errors[0])
    assert message.startswith(f"run.output_dir {dirs[0]} is not shared storage: the worker of rank 0 on node-0")
    assert "cannot see what rank 2 on node-2 wrote there" in message and message.count(".") <= 2


def test_the_verdict_names_the_blind_worker_and_the_writers_it_missed():
    assert storage_verdict(Path("/data/run"), [(0, "a", []), (1, "b", [])]) is None
    verdict = storage_verdict(Path("/data/run"), [(0, "a", []), (1, "b", [0, 2]), (2, "c", [])])
    assert verdict == (
        "run.output_dir /data/run is not shared storage: the worker of rank 1 on b cannot see what rank 0 on a, "
        "rank 2 on c wrote there; every node must mount it at the same path (NFS, a shared volume)"
    )


def test_marks_of_an_earlier_killed_attempt_do_not_count(tmp_path):
    shared = tmp_path / "out"
    stale = shared / PROBE_DIR / "deadbeef"  # an attempt killed before it cleaned up: every rank's mark
    stale.mkdir(parents=True)
    for r in range(2):
        (stale / f"rank-{r}.json").write_text("{}")
    errors = run_ranks([shared, tmp_path / "elsewhere"])  # a fresh token from rank 0: the old marks are not looked at
    assert all(isinstance(e, SharedStorageError) for e in errors)
    assert (stale / "rank-1.json").is_file()  # what it did not write, it leaves alone
