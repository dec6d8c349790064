"""The guard on the RL stage, the task side: training in attempts, what a breach does, the ledger on disk.

rlhf_core/evaluation/guard.py holds the rules, the ledger and rollback's set-aside; here the RL stage trains under
them (`guarded_training`) and acts on a breach (`act_on_breach`: stop, or roll back). The ledger lives in
<out_dir>/guard.json beside the stage's checkpoints and carries every evaluation, breach, rollback and
stop across attempts and resumes. The RL stage (tasks/stages/rl.py) supplies how an attempt loads its models
and trains; its reporter (tasks/stages/rl_reporting.py) evaluates and records the verdicts.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rlhf_core.config import PipelineConfig
from rlhf_core.evaluation.guard import GuardBreach, GuardLedger, GuardStop, set_aside
from rlhf_core.training.determinism import seed_everything
from rlhf_core.training.parallel import from_main
from tasks.launch import launcher
from tasks.stage_io import checkpoint_steps

GUARD_FILE = "guard.json"  # the guard's ledger, next to the RL stage's checkpoints


def load_ledger(out_dir: Path) -> GuardLedger:
    """The ledger of the stage directory `out_dir` (an empty one before its first evaluation)."""
    return GuardLedger.load(out_dir / GUARD_FILE)


def save_ledger(ledger: GuardLedger, out_dir: Path) -> None:
    ledger.save(out_dir / GUARD_FILE)


class GuardedReporter(Protocol):
    """What the guard uses of the RL stage's reporter (tasks/stages/rl_reporting.py `PolicyReporter`)."""

    ledger: GuardLedger
    out_dir: Path
    logger: Any

    def on_eval(self, rows: list[dict], step: int) -> None: ...

    def wait_registrations(self) -> None: ...


def guarded_training(
    cfg: PipelineConfig,
    reporter: GuardedReporter,
    load: Callable[[], tuple[Any, Callable]],
    train: Callable[..., Any],
):
    """Train under the guard: the initial policy evaluated first (step 0, seeded with run.seed), then PPO or GRPO
    until the end or a breach whose action is 'stop' (None is returned) or 'rollback': the checkpoints after
    the last one that passed every rule are set aside, the KL coefficient multiplied by guard.kl_coef_factor,
    and training resumes from that checkpoint (or from the start) with freshly loaded models; a breach beyond
    guard.max_rollbacks stops. The ledger (<out_dir>/guard.json) carries all of it across attempts.

    `load()` gives an attempt's freshly loaded models and their `evaluate(model, step)`; `train(models,
    evaluate=..., kl_scale=...)` runs PPO or GRPO and returns the loop's result.

    With N processes the evaluating one (rank 0) decides: the loop raises its breach on every process, rank 0
    alone sets checkpoints aside and updates the ledger, and every process then goes on with rank 0's ledger."""
    out_dir = reporter.out_dir
    while reporter.ledger.stopped_at is None:
        models, evaluate = load()
        if launcher.is_main() and 0 not in reporter.ledger.evals and not checkpoint_steps(out_dir):
            # the starting point, for the before/after comparison: seeded as promotion seeds its evaluation of a
            # version, so it does not depend on what this process drew before (stages, loading, Ray or torchrun).
            # Training does not draw from what follows: its loop seeds every generator again when it starts.
            seed_everything(cfg.run.seed)
            reporter.on_eval(evaluate(models.policy, 0), 0)
        try:
            return train(models, evaluate=evaluate, kl_scale=cfg.guard.kl_coef_factor**reporter.ledger.rollbacks)
        except GuardBreach as breach:
            if launcher.is_main():
                act_on_breach(breach, cfg, reporter)
        reporter.ledger = from_main(reporter.ledger)
        # the attempt's models go before the next attempt loads its own: `evaluate` holds them too, and the
        # breach's traceback keeps the training loop's frames, and with them the loop and the models, in a
        # cycle (the frame that re-raised the breach holds it) that only a collection frees
        del models, evaluate
        gc.collect()
    return None


def act_on_breach(breach: GuardBreach, cfg: PipelineConfig, reporter: GuardedReporter) -> None:
    """Rank 0's part of a breach: stop, or set the checkpoints after the last passed one aside (a rollback
    beyond guard.max_rollbacks stops); the ledger records it and is saved."""
    ledger, out_dir, guard = reporter.ledger, reporter.out_dir, cfg.guard
    if isinstance(breach, GuardStop):
        ledger.stopped_at = breach.trigger.step
    elif ledger.rollbacks >= guard.max_rollbacks:
        reporter.logger.warning("guard: %d rollbacks done (guard.max_rollbacks): stopping", ledger.rollbacks)
        ledger.stopped_at = breach.trigger.step
    else:
        reporter.wait_registrations()  # the checkpoints set aside keep their versions
        to_step = ledger.last_passed([0, *checkpoint_steps(out_dir)]) or 0
        moved = set_aside(out_dir, to_step, ledger.rollbacks + 1)
        ledger.rolled_back(to_step)
        reporter.logger.warning(
            "guard: rolled back to step %d (%d checkpoints set aside under %s); the KL coefficient is "
            "now %gx the configured one",
            to_step,
            len(moved),
            out_dir / "rolled_back",
            guard.kl_coef_factor**ledger.rollbacks,
        )
    save_ledger(ledger, out_dir)
