"""The guard on the RL stage, the task side: training in attempts, what a breach does, the ledger on disk.

rlhf_core/evaluation/guard.py holds the rules, the ledger and rollback's set-aside; here the RL stage trains under
them (`guarded_training`) and acts on a breach (`act_on_breach`: stop, or roll back, and say so in one sentence).
The ledger lives in <out_dir>/guard.json beside the stage's checkpoints and carries every evaluation, breach,
rollback and stop across attempts and resumes. The RL stage (tasks/stages/rl.py) supplies how an attempt loads its
models and trains; its reporter (tasks/stages/rl_reporting.py) evaluates, records the verdicts, reports what the
guard did and gives each attempt after a rollback its own MLflow run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from rlhf_core.config import PipelineConfig
from rlhf_core.evaluation.guard import GuardBreach, GuardLedger, GuardStop, Rollback, set_aside
from rlhf_core.training.determinism import seed_everything
from rlhf_core.training.parallel import from_main
from tasks import tracking
from tasks.launch import launcher
from tasks.stage_io import checkpoint_steps
from tasks.stages.eval_rows import set_aside_eval_rows

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

    def on_guard_action(self, step: int, sentence: str) -> None: ...

    def begin_attempt(self) -> None: ...


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
    evaluate=..., kl_scale=...)` runs PPO or GRPO and returns the loop's result. The reporter hears what the
    guard did (`on_guard_action`, on rank 0) and starts each attempt after a rollback (`begin_attempt`).

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
        if reporter.ledger.stopped_at is None:
            reporter.begin_attempt()
    return None


def act_on_breach(breach: GuardBreach, cfg: PipelineConfig, reporter: GuardedReporter) -> None:
    """Rank 0's part of a breach: stop, or set the checkpoints (and evaluations) after the last passed one aside
    (a rollback beyond guard.max_rollbacks stops); the ledger records it and is saved, and the reporter hears
    what was done in one sentence."""
    ledger, out_dir, guard, stage = reporter.ledger, reporter.out_dir, cfg.guard, cfg.rl.algorithm
    trigger = breach.trigger
    if isinstance(breach, GuardStop):
        ledger.stopped_at = trigger.step
        sentence = f"guard: stopped {stage} at step {trigger.step} ({trigger.rule}, action stop)"
    elif ledger.rollbacks >= guard.max_rollbacks:
        ledger.stopped_at = trigger.step
        sentence = (
            f"guard: stopped {stage} at step {trigger.step} ({trigger.rule}, action rollback): "
            f"{ledger.rollbacks} rollback(s) done already (guard.max_rollbacks {guard.max_rollbacks})"
        )
    else:
        reporter.wait_registrations()  # the checkpoints set aside keep their versions
        to_step = ledger.last_passed([0, *checkpoint_steps(out_dir)]) or 0
        attempt = ledger.attempt
        moved = set_aside(out_dir, to_step, attempt)
        set_aside_eval_rows(out_dir, to_step, attempt)
        rollback = Rollback(
            attempt=attempt,
            at_step=trigger.step,
            rule=trigger.rule,
            to_step=to_step,
            kl_scale=guard.kl_coef_factor**attempt,
            set_aside=tuple(p.name for p in moved),
        )
        sentence = rollback_sentence(cfg, rollback, out_dir / "rolled_back" / str(attempt))
        ledger.rolled_back(replace(rollback, message=sentence))
    save_ledger(ledger, out_dir)
    reporter.on_guard_action(trigger.step, sentence)


def rollback_sentence(cfg: PipelineConfig, rollback: Rollback, set_aside_dir: Path) -> str:
    """What a rollback did, in one sentence: the attempt it ended and why, the step it went back to, the
    checkpoints it set aside, the KL coefficient of the next attempt and the MLflow run that holds it."""
    stage, attempt = cfg.rl.algorithm, rollback.attempt
    back_to = "the start (step 0)" if rollback.to_step == 0 else f"checkpoint-{rollback.to_step}"
    moved = (
        f"{', '.join(rollback.set_aside)} set aside under {set_aside_dir}"
        if rollback.set_aside
        else "no checkpoint to set aside"
    )
    return (
        f"guard: attempt {attempt} rolled back at step {rollback.at_step} ({rollback.rule}) to {back_to}; {moved}; "
        f"{kl_coefficient(cfg, rollback)}; attempt {attempt + 1} trains on from step {rollback.to_step} "
        f"(MLflow run {tracking.runs.attempt_run_name(stage, attempt + 1)})"
    )


def kl_coefficient(cfg: PipelineConfig, rollback: Rollback) -> str:
    """The KL coefficient after `rollback` (ppo.kl_coef, or grpo.beta), and what guard.kl_coef_factor did to it."""
    scale, factor = rollback.kl_scale, f"guard.kl_coef_factor {cfg.guard.kl_coef_factor:g} per rollback"
    if cfg.rl.algorithm == "ppo":
        if cfg.ppo.adaptive_kl and rollback.to_step > 0:
            return (
                f"the adaptive KL coefficient checkpoint-{rollback.to_step} saved, at {scale:g}x the configured "
                f"scale ({factor})"
            )
        return f"ppo.kl_coef is now {cfg.ppo.kl_coef * scale:g} ({cfg.ppo.kl_coef:g} x {scale:g}, {factor})"
    if cfg.grpo.beta == 0:
        return "grpo.beta is 0, so guard.kl_coef_factor changes nothing"
    return f"grpo.beta is now {cfg.grpo.beta * scale:g} ({cfg.grpo.beta:g} x {scale:g}, {factor})"
