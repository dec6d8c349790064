"""What a launched stage prints on the console, in our words: the launcher's side of the stage's output.

A stage on Ray streams everything its driver prints (Ray's own lines, the Ray Train controller's, every
worker's, each prefixed by Ray with `(RayTrainWorker pid=..)`) into the stage's log file. The console gets
only what `console_line` keeps: the story lines (`STORY_PREFIX`: which ranks started on which nodes, a
worker lost and the restart, said by `tasks.launch.ray_callback.StageStory` in the controller) and the
workers' own `[rank N] ...` lines, Ray's prefix taken off, each once (two nodes on one host both forward
every worker's lines). The last word of a failed stage is one line: `FAILURE_PREFIX` (the stage failed:
a worker lost after the restarts, an error of ours) or `REFUSAL_PREFIX` (a worker refused the stage with a
user error: a config, data or guard stop that a restart cannot mend).

Nothing here imports Ray: the launcher, the workers and the tests use it without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

STORY_PREFIX = "rlhf-story: "
FAILURE_PREFIX = "rlhf-stage-failed: "  # a failed stage's last word (Ray driver, torchrun's rank 0): one sentence
REFUSAL_PREFIX = "rlhf-stage-refused: "  # a user error inside a worker: one sentence, no restart

# Ray's prefix on a forwarded line: "(RayTrainWorker pid=7261)", "(TrainController pid=7005, ip=10.0.0.2)",
# "(raylet)", "(raylet, ip=10.0.0.2)", "(autoscaler +5s)"
_RAY_PREFIX = re.compile(r"^\((?:[\w.:-]+(?: pid=\d+)?(?:, ip=[^)\s]+)?|autoscaler [^)]*)\) ?")
_RANK_LINE = re.compile(r"^\[rank \d+\] ")
# Ray's own suffix on lines it folded together (RAY_DEDUP_LOGS, which the launcher turns off)
_REPEATED = re.compile(r" \[repeated \d+x across cluster\].*$")


def node_label(node_id: str, hostname: str, ip: str) -> str:
    """How a Ray node is named in every sentence: its id's first 12 characters, its host name and address."""
    return f"node {node_id[:12]} ({hostname}, {ip})"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def start_line(stage: str, start: int, max_failures: int, placed: dict[int, str]) -> str:
    """The line for a worker group that started: the first start, or restart `start - 1` of `max_failures`."""
    ranks = ", ".join(f"rank {rank} on {node}" for rank, node in sorted(placed.items()))
    if start == 1:
        return f"{stage} stage: {plural(len(placed), 'worker')} started: {ranks}"
    return f"{stage} stage: {plural(len(placed), 'worker')} restarted (restart {start - 1} of {max_failures}): {ranks}"


def resume_step(checkpoints: str | Path | None) -> int | None:
    """The step of the newest complete checkpoint in a stage's checkpoint directory, None when there is none."""
    if checkpoints is None or not Path(checkpoints).is_dir():
        return None
    from rlhf_core.storage.checkpoints import checkpoint_step, latest_checkpoint

    latest = latest_checkpoint(checkpoints)
    return checkpoint_step(latest) if latest is not None else None


def resume_point(step: int | None) -> str:
    return f"checkpoint {step}" if step is not None else "the start (no checkpoint yet)"


def loss_line(stage: str, rank: int, node: str, cause: str, restart: int, max_failures: int, step: int | None) -> str:
    """The line for a lost worker that the group restarts after (restart `restart` of `max_failures`)."""
    return (
        f"{stage} stage: rank {rank} on {node} lost: {cause}; restarting the workers from {resume_point(step)} "
        f"(restart {restart} of {max_failures})"
    )


def failure_line(stage: str, what: str, restarts: int, max_failures: int) -> str:
    """The sentence for a stage that failed after `restarts` restarts: `what` died or failed, and where."""
    return (
        f"the {stage} stage failed on Ray after {plural(restarts, 'restart')} (run.max_failures {max_failures}): {what}"
    )


@dataclass
class ConsoleFilter:
    """Feeds on the raw lines of a stage's processes; says which go to the console (`keep`) and remembers the
    failed stage's last word (`failure`, `refusal`). With `story_only` (Ray) only the story and the workers'
    `[rank N]` lines, each once; without (torchrun, whose lines are the workers' own), every line."""

    story_only: bool = True
    seen: set[str] = field(default_factory=set)
    failure: str | None = None
    refusal: str | None = None

    def keep(self, raw: str) -> str | None:
        """The console's text for this line, or None (the log file has it)."""
        text = _REPEATED.sub("", _RAY_PREFIX.sub("", raw, count=1)).rstrip() if self.story_only else raw
        for prefix, slot in ((FAILURE_PREFIX, "failure"), (REFUSAL_PREFIX, "refusal")):
            if text.startswith(prefix):
                setattr(self, slot, text[len(prefix) :])
                return None
        if not self.story_only:
            return text
        if text.startswith(STORY_PREFIX):
            text = text[len(STORY_PREFIX) :]
        elif not _RANK_LINE.match(text):
            return None
        if text in self.seen:
            return None
        self.seen.add(text)
        return text
