"""The Ray Train controller's side of a stage's story: `StageStory`, a callback of the TrainController.

tasks/launch/ray_driver.py hands it to the TorchTrainer (`RunConfig(callbacks=...)`); it runs in the
controller actor, on the cluster, and prints `STORY_PREFIX` lines that Ray forwards to the driver and
the launcher puts on the console (tasks/launch/story.py): the ranks and nodes of each worker group it
starts, and for a worker lost, which rank on which node, why, and the checkpoint the restarted group
resumes from. When any worker raised a `UserError` (a config, data or guard stop: what a restart
cannot mend), it ends the stage at once instead of spending `run.max_failures` restarts on it: the
exception it raises in `before_controller_execute_failure_decision` becomes Ray Train's ControllerError,
which is never retried, and the driver says the worker's sentence (`StageRefused`). When the restarts are
used up it raises the stage's last sentence the same way (`StageLost`): the controller knows the nodes.

Ray Train's ControllerCallback and WorkerGroupCallback are DeveloperAPI classes of Ray 2.60 (the pinned
release, `pyproject.toml`). Only the driver imports this module; the controller unpickles the callback
by reference, so it needs this project installed on the cluster, as the workers do.
"""

from __future__ import annotations

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.failure_handling import FailureDecision

from rlhf_core.config.errors import UserError
from tasks.launch.story import STORY_PREFIX, failure_line, loss_line, node_label, resume_step, start_line


class StageRefused(Exception):
    """A worker refused the stage with a user error; the message is its sentence."""


class StageLost(Exception):
    """The stage failed after its restarts; the message is the sentence (what, where, how many restarts)."""


def death_cause(error: BaseException) -> tuple[bool, str]:
    """(whether the worker is gone, the cause in a few words) for a worker's error in a poll of its group."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    if isinstance(error, WorkerHealthCheckFailedError):
        error = error.health_check_failure
    if not isinstance(error, RayActorError):
        lines = str(error).strip().splitlines() or [""]
        return False, f"{type(error).__name__}: {lines[-1]}".rstrip(": ")
    text = str(error).lower()
    if error.preempted:
        return True, "its node was preempted"
    if "node" in text and any(word in text for word in ("node has died", "node died", "node was removed")):
        return True, "its node was lost"
    if "low on memory" in text:  # Ray's memory monitor; the kernel's OOM killer reads as any other death
        return True, "its process was killed by Ray's memory monitor (the node ran low on memory)"
    return True, "its process died (killed, or crashed)"


def first_failure(errors: dict[int, BaseException]) -> tuple[int, bool, str]:
    """(rank, gone, cause) of the failure to name: a worker gone first (the others' broken collectives
    follow from it), else the lowest rank's error."""
    causes = {rank: death_cause(error) for rank, error in sorted(errors.items())}
    rank = next((r for r, (gone, _) in causes.items() if gone), min(causes))
    return rank, *causes[rank]


class StageStory(ControllerCallback, WorkerGroupCallback):
    """Prints the stage's story from the controller; ends the stage when a worker refused it (see the module)."""

    def __init__(self, stage: str, max_failures: int, checkpoints: str | None):
        self.stage, self.max_failures, self.checkpoints = stage, max_failures, checkpoints
        self.starts = 0
        self.placed: dict[int, str] = {}
        self.errors: dict[int, BaseException] = {}

    def say(self, line: str) -> None:
        print(STORY_PREFIX + line, flush=True)

    def after_worker_group_start(self, worker_group) -> None:
        self.starts += 1
        self.errors = {}
        self.placed = {
            worker.distributed_context.world_rank: node_label(
                worker.metadata.node_id, worker.metadata.hostname, worker.metadata.node_ip
            )
            for worker in worker_group.get_workers()
        }
        self.say(start_line(self.stage, self.starts, self.max_failures, self.placed))

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        if worker_group_status.errors:
            self.errors = dict(worker_group_status.errors)

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        refusals = [error for _, error in sorted(self.errors.items()) if isinstance(error, UserError)]
        if refusals:
            raise StageRefused(" ".join(str(refusals[0]).split()))
        if not self.errors:
            return  # a failure of Ray's own (the workers could not be placed): the driver names it
        rank, gone, cause = first_failure(self.errors)
        node = self.placed.get(rank, "an unknown node")
        if failure_decision == FailureDecision.RETRY:
            self.say(
                loss_line(self.stage, rank, node, cause, self.starts, self.max_failures, resume_step(self.checkpoints))
            )
        elif failure_decision == FailureDecision.RAISE:
            what = f"rank {rank} on {node} {'lost' if gone else 'failed'}: {cause}"
            raise StageLost(failure_line(self.stage, what, self.starts - 1, self.max_failures))
