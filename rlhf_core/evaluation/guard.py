"""The guard: rules against over-optimization and collapse, checked on every evaluation's summary.

A policy that raises the proxy reward by drifting far from where it started (KL), by collapsing into a
few phrases (distinct-2), by changing its length, or while a gold metric falls (the proxy is being
gamed) has learned to hack the reward model, not the task. Each rule of `guard` (see
`rlhf_core.config.GuardConfig`) compares the latest evaluation with the initial policy's (step 0) and
with the evaluations before it; a breach is a `Trigger` with the rule's action: warn, stop or rollback.

`GuardLedger` keeps the history (the summaries by step, the triggers and the rollbacks), gives the `Verdict` on
each evaluation (`judge`: continue, stop or rollback, from the history and the rules), decides which checkpoints
passed every rule and which training attempt wrote a step, and is saved next to the checkpoints as JSON, so a
resumed run keeps it. Acting on a verdict (leaving the loop, setting checkpoints aside) is the RL stage's.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlhf_core.config import GuardConfig
from rlhf_core.config.errors import UserError
from rlhf_core.evaluation.promotion import eval_kl

SEVERITY = {"warn": 0, "stop": 1, "rollback": 2}


@dataclass(frozen=True)
class Trigger:
    """One rule broken at one evaluation."""

    rule: str
    action: str
    step: int
    value: float
    limit: float
    message: str


@dataclass(frozen=True)
class Rollback:
    """One rollback: the training attempt it ended (1: the first), the step of its breach and the rule broken,
    the step training went back to, the KL scale of the attempt after it, the checkpoints set aside (their
    directory names) and what it did, in one sentence."""

    attempt: int
    at_step: int
    rule: str
    to_step: int
    kl_scale: float
    set_aside: tuple[str, ...] = ()
    message: str = ""


class GuardStopError(UserError):
    """The guard ended RL in a way the pipeline cannot go on from (no checkpoint to export); one sentence."""


class GuardBreach(Exception):
    """Raised from an evaluation callback at a breach whose action ends or rewinds training."""

    def __init__(self, trigger: Trigger):
        super().__init__(trigger.message)
        self.trigger = trigger

    def __reduce__(self):  # pickled with its trigger: every process raises the evaluating one's decision
        return type(self), (self.trigger,)


class GuardStop(GuardBreach):
    """The breach's action is 'stop'."""


class GuardRollback(GuardBreach):
    """The breach's action is 'rollback'."""


def relative_to_initial(summary: dict[str, float], initial: dict[str, float]) -> dict[str, float]:
    """eval/length_ratio and eval/distinct_2_ratio: the summary against the initial policy's (when defined)."""
    out = {}
    for key, name in (("eval/length_mean", "eval/length_ratio"), ("eval/distinct_2", "eval/distinct_2_ratio")):
        if summary.get(key) is not None and initial.get(key):
            out[name] = summary[key] / initial[key]
    return out


def column_key(column: str) -> str:
    return f"eval/{column}_mean"


def check(history: list[tuple[int, dict[str, float]]], guard: GuardConfig, gold: str | None) -> list[Trigger]:
    """The rules the last evaluation of `history` ((step, summary) in step order, the initial policy's
    first) breaks. The initial evaluation itself breaks none."""
    if len(history) < 2:
        return []
    (_, initial), (step, now) = history[0], history[-1]
    relative = relative_to_initial(now, initial)
    triggers = []

    def breach(rule: str, action: str, value: float, limit: float, what: str) -> None:
        message = f"guard {rule} at step {step}: {what} (action: {action})"
        triggers.append(Trigger(rule, action, step, float(value), float(limit), message))

    kl, rule = eval_kl(now), guard.kl_budget
    if rule.limit is not None and kl is not None and kl > rule.limit:
        breach("kl_budget", rule.action, kl, rule.limit, f"eval KL {kl:.3f} nats > {rule.limit:g}")
    ratio, rule = relative.get("eval/distinct_2_ratio"), guard.min_distinct_ratio
    if rule.limit is not None and ratio is not None and ratio < rule.limit:
        breach(
            "min_distinct_ratio",
            rule.action,
            ratio,
            rule.limit,
            f"distinct-2 is {ratio:.2f} of the initial policy's < {rule.limit:g}",
        )
    ratio, rule = relative.get("eval/length_ratio"), guard.max_length_change
    if rule.limit is not None and ratio is not None and abs(ratio - 1) > rule.limit:
        breach(
            "max_length_change",
            rule.action,
            abs(ratio - 1),
            rule.limit,
            f"mean length is {ratio:.2f}x the initial policy's (change {abs(ratio - 1):.2f} > {rule.limit:g})",
        )
    div = guard.divergence
    if div.evals is not None and gold is not None and len(history) > div.evals:
        window = [summary for _, summary in history[-(div.evals + 1) :]]
        proxy = [w.get(column_key(div.proxy)) for w in window]
        golds = [w.get(column_key(gold)) for w in window]
        if None not in proxy and None not in golds:
            rising = all(b > a for a, b in zip(proxy, proxy[1:]))
            falling = all(b < a for a, b in zip(golds, golds[1:]))
            if rising and falling:
                breach(
                    "divergence",
                    div.action,
                    golds[-1] - golds[0],
                    float(div.evals),
                    f"{div.proxy} rose {proxy[0]:.3f} -> {proxy[-1]:.3f} while {gold} fell "
                    f"{golds[0]:.3f} -> {golds[-1]:.3f} over {div.evals} evaluations",
                )
    return triggers


def divergence_off(guard: GuardConfig, gold: str | None) -> str | None:
    """Why the divergence rule watches nothing, in one sentence (said once in the log and the summary), or None:
    it runs, or guard.divergence.evals null turned it off on purpose."""
    if guard.divergence.evals is None or gold is not None:
        return None
    return (
        "guard: the divergence rule is off for lack of a gold metric (eval.metrics is empty and "
        "guard.divergence.gold is null); name a metric function in eval.metrics to watch "
        f"{guard.divergence.proxy} against it"
    )


def strongest(triggers: list[Trigger]) -> Trigger | None:
    """The trigger whose action goes furthest (rollback > stop > warn); None for none."""
    return max(triggers, key=lambda t: SEVERITY[t.action], default=None)


@dataclass(frozen=True)
class Verdict:
    """The guard's verdict on the evaluation of `step`: the rules it broke, and what training does next (`action`):
    'continue' when none was broken or only rules whose action is warn, else the strongest breach's, 'stop' or
    'rollback'."""

    step: int
    triggers: tuple[Trigger, ...] = ()

    @property
    def breach(self) -> Trigger | None:
        """The broken rule whose action goes furthest; None when none was broken."""
        return strongest(list(self.triggers))

    @property
    def action(self) -> str:
        breach = self.breach
        return "continue" if breach is None or breach.action == "warn" else breach.action

    def ending(self) -> GuardBreach | None:
        """What leaves the training loop on this verdict: GuardStop or GuardRollback, None to continue."""
        if self.action == "continue":
            return None
        return (GuardStop if self.action == "stop" else GuardRollback)(self.breach)


@dataclass
class GuardLedger:
    """Evaluations by step and their breaches (of the current branch: a rollback abandons what came after the
    step it returns to), every breach ever seen, the rollbacks done (their count, and each one in
    `rollback_log`) and the step the guard stopped RL at; saved as JSON next to the checkpoints."""

    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    triggers: list[Trigger] = field(default_factory=list)
    all_triggers: list[Trigger] = field(default_factory=list)
    rollbacks: int = 0
    stopped_at: int | None = None
    rollback_log: list[Rollback] = field(default_factory=list)

    @property
    def attempt(self) -> int:
        """The training attempt under way: 1, and one more after each rollback."""
        return self.rollbacks + 1

    def attempt_of(self, step: int) -> int:
        """The attempt that wrote the current branch's `step`: the one after the last rollback that went back
        to a step before it (steps up to a rollback's `to_step` are its earlier attempt's)."""
        if len(self.rollback_log) < self.rollbacks:  # a ledger saved before rollbacks were logged one by one
            return self.attempt
        attempt = 1
        for rollback in self.rollback_log:
            if rollback.to_step < step:
                attempt = rollback.attempt + 1
        return attempt

    def judge(self, step: int, summary: dict[str, float], guard: GuardConfig, gold: str | None) -> Verdict:
        """Record the evaluation at `step` (its ratios to the initial one added) and give the guard's verdict: its
        breaches of the rules against the history so far."""
        # a rollback re-runs steps: evaluations after `step` belong to the abandoned branch
        self.evals = {s: v for s, v in self.evals.items() if s < step}
        initial = self.evals.get(0, summary)
        self.evals[step] = {**summary, **relative_to_initial(summary, initial)}
        found = check(sorted(self.evals.items()), guard, gold)
        self.triggers = [t for t in self.triggers if t.step < step] + found
        self.all_triggers += found
        return Verdict(step, tuple(found))

    def rolled_back(self, rollback: Rollback) -> None:
        """Forget the evaluations and breaches after the rollback's `to_step` (they will be run again), count
        the rollback and log it."""
        self.evals = {s: v for s, v in self.evals.items() if s <= rollback.to_step}
        self.triggers = [t for t in self.triggers if t.step <= rollback.to_step]
        self.rollbacks += 1
        self.rollback_log.append(rollback)

    def broken(self, step: int) -> list[str]:
        """The rules the evaluation at `step` broke (empty: it passed, or there was none)."""
        return sorted({t.rule for t in self.triggers if t.step == step})

    def passed(self, step: int) -> bool:
        """Whether an evaluation ran at `step` and broke no rule."""
        return step in self.evals and not self.broken(step)

    def best(self, steps: list[int], metric_key: str) -> int | None:
        """Of checkpoint `steps`, the passed one with the highest `metric_key` (the later one on ties)."""
        scored = [
            (self.evals[s][metric_key], s)
            for s in steps
            if self.passed(s) and s > 0 and _finite(self.evals[s].get(metric_key))
        ]
        return max(scored)[1] if scored else None

    def last_passed(self, steps: list[int]) -> int | None:
        """The latest of `steps` whose evaluation passed every rule (0, the initial policy, counts)."""
        return max((s for s in steps if self.passed(s)), default=None)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        payload = {
            "evals": {str(k): v for k, v in sorted(self.evals.items())},
            "triggers": [asdict(t) for t in self.triggers],
            "all_triggers": [asdict(t) for t in self.all_triggers],
            "rollbacks": self.rollbacks,
            "stopped_at": self.stopped_at,
            "rollback_log": [asdict(r) for r in self.rollback_log],
        }
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> GuardLedger:
        path = Path(path)
        if not path.is_file():
            return cls()
        data = json.loads(path.read_text())
        return cls(
            evals={int(k): v for k, v in data.get("evals", {}).items()},
            triggers=[Trigger(**t) for t in data.get("triggers", [])],
            all_triggers=[Trigger(**t) for t in data.get("all_triggers", [])],
            rollbacks=int(data.get("rollbacks", 0)),
            stopped_at=data.get("stopped_at"),
            rollback_log=[
                Rollback(**{**r, "set_aside": tuple(r.get("set_aside", ()))}) for r in data.get("rollback_log", [])
            ],
        )


def set_aside(out_dir: str | Path, after_step: int, attempt: int) -> list[Path]:
    """Move the checkpoint-N directories of `out_dir` with N > after_step into out_dir/rolled_back/<attempt>/
    (kept for inspection, never deleted), so that a resume starts from the checkpoint at after_step."""
    from rlhf_core.storage.checkpoints import list_checkpoints

    out_dir = Path(out_dir)
    moved = []
    for step, path in list_checkpoints(out_dir):
        if step > after_step:
            target = out_dir / "rolled_back" / str(attempt) / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
            moved.append(target)
    return moved


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
