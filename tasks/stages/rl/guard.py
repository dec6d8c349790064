"""The guard on the RL stage, the task side: the ledger on disk, the verdict on each evaluation acted on, training
in attempts.

rlhf_core/evaluation/guard.py holds the rules, the ledger and its `Verdict`; here the stage acts on a verdict: a
`Guard` judges each evaluation (`evaluated`), tells the reporting what it found (which only reports), and leaves the
training loop on a stop or a rollback; `guarded_training` then stops, or sets the checkpoints after the last passed
one aside and trains the next attempt from there. The ledger lives in <out_dir>/guard.json beside the stage's
checkpoints and carries every evaluation, breach, rollback and stop across attempts and resumes.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlhf_core.config import PREFERENCE_ALGORITHMS, PipelineConfig
from rlhf_core.evaluation.generations import summarize_rows
from rlhf_core.evaluation.guard import GuardBreach, GuardLedger, GuardStop, Rollback, Verdict, set_aside
from rlhf_core.training.determinism import seed_everything
from rlhf_core.training.parallel import from_main
from tasks import tracking
from tasks.launch import launcher
from tasks.stage_io import checkpoint_steps
from tasks.stages.rl.eval_rows import set_aside_eval_rows

GUARD_FILE = "guard.json"  # the guard's ledger, next to the RL stage's checkpoints


@dataclass(frozen=True)
class GuardListener:
    """What the stage's reporting hears from the guard: every evaluation with its verdict, what the guard did at a
    breach (one sentence), the start of each attempt after a rollback; `settle()` is called before checkpoints are
    set aside (their registrations finish first, so they keep their versions)."""

    on_eval: Callable[[list[dict], int, Verdict], None]
    on_action: Callable[[int, str], None]
    begin_attempt: Callable[[], None]
    settle: Callable[[], None]


class Guard:
    """The guard of one RL stage directory `out_dir`: its ledger, the verdict on each evaluation, and what a breach
    does there. On N processes the evaluating one (rank 0) judges and acts; `share()` gives every process its ledger."""

    def __init__(self, cfg: PipelineConfig, out_dir: Path):
        self.cfg, self.out_dir = cfg, out_dir
        self.ledger = GuardLedger.load(out_dir / GUARD_FILE)
        self.listener: GuardListener | None = None

    @property
    def kl_scale(self) -> float:
        """What the next attempt's KL coefficient is multiplied by: guard.kl_coef_factor per rollback so far."""
        return self.cfg.guard.kl_coef_factor**self.ledger.rollbacks

    def evaluated(self, rows: list[dict], step: int) -> None:
        """The training loop's on_eval: the evaluation judged and saved in the ledger, the verdict told to the
        reporting; a stop or a rollback leaves the loop (raised on every process: `raise_everywhere`)."""
        verdict = self.ledger.judge(step, summarize_rows(rows), self.cfg.guard, self.cfg.gold_metric())
        self.ledger.save(self.out_dir / GUARD_FILE)
        self.listener.on_eval(rows, step, verdict)
        if (ending := verdict.ending()) is not None:
            raise ending

    def act(self, breach: GuardBreach) -> None:
        """Rank 0's part of a breach: stop, or set the checkpoints (and evaluations) after the last passed one aside
        (a rollback beyond guard.max_rollbacks stops); the ledger records it and is saved, and the listener hears
        what was done in one sentence."""
        ledger, guard, stage, trigger = self.ledger, self.cfg.guard, self.cfg.rl.algorithm, breach.trigger
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
            self.listener.settle()  # the checkpoints set aside keep their versions
            sentence = self._roll_back(breach)
        ledger.save(self.out_dir / GUARD_FILE)
        self.listener.on_action(trigger.step, sentence)

    def _roll_back(self, breach: GuardBreach) -> str:
        ledger, out_dir, trigger = self.ledger, self.out_dir, breach.trigger
        to_step = ledger.last_passed([0, *checkpoint_steps(out_dir)]) or 0
        attempt = ledger.attempt
        moved = set_aside(out_dir, to_step, attempt)
        set_aside_eval_rows(out_dir, to_step, attempt)
        rollback = Rollback(
            attempt=attempt,
            at_step=trigger.step,
            rule=trigger.rule,
            to_step=to_step,
            kl_scale=self.cfg.guard.kl_coef_factor**attempt,
            set_aside=tuple(p.name for p in moved),
        )
        sentence = rollback_sentence(self.cfg, rollback, out_dir / "rolled_back" / str(attempt))
        ledger.rolled_back(replace(rollback, message=sentence))
        return sentence

    def share(self) -> None:
        """Every process goes on with the evaluating process's ledger."""
        self.ledger = from_main(self.ledger)


def guarded_training(
    guard: Guard,
    load: Callable[[], tuple[Any, Callable]],
    inputs_for: Callable[[Any, Callable, float], Any],
    trainer: Callable[[Any], Any],
):
    """Train under the guard: the initial policy evaluated first (step 0, seeded with run.seed), then PPO or GRPO
    until the end or a breach whose action is 'stop' (None is returned) or 'rollback': the checkpoints after
    the last one that passed every rule are set aside, the KL coefficient multiplied by guard.kl_coef_factor,
    and training resumes from that checkpoint (or from the start) with freshly loaded models; a breach beyond
    guard.max_rollbacks stops.

    `load()` gives an attempt's freshly loaded models and their `evaluate(model, step)`; `inputs_for(models,
    evaluate, kl_scale)` the trainer's input, whose on_eval is `guard.evaluated`; `trainer(inputs)` (train_ppo or
    train_grpo) trains and returns the loop's result.

    With N processes the evaluating one (rank 0) decides: the loop raises its breach on every process, rank 0
    alone sets checkpoints aside and updates the ledger, and every process then goes on with rank 0's ledger."""
    while guard.ledger.stopped_at is None:
        models, evaluate = load()
        if launcher.is_main() and 0 not in guard.ledger.evals and not checkpoint_steps(guard.out_dir):
            # the starting point, for the before/after comparison: seeded as promotion seeds its evaluation of a
            # version, so it does not depend on what this process drew before (stages, loading, Ray or torchrun).
            # Training does not draw from what follows: its loop seeds every generator again when it starts.
            seed_everything(guard.cfg.run.seed)
            guard.evaluated(evaluate(models.policy, 0), 0)
        try:
            return trainer(inputs_for(models, evaluate, guard.kl_scale))
        except GuardBreach as breach:
            if launcher.is_main():
                guard.act(breach)
        guard.share()
        # the attempt's models go before the next attempt loads its own: `evaluate` holds them too, and the
        # breach's traceback keeps the training loop's frames, and with them the loop and the models, in a
        # cycle (the frame that re-raised the breach holds it) that only a collection frees
        del models, evaluate
        gc.collect()
        if guard.ledger.stopped_at is None:
            guard.listener.begin_attempt()
    return None


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
    """The KL coefficient after `rollback` (ppo.kl_coef, grpo.beta or dpo.beta), and what guard.kl_coef_factor did to it."""
    scale, factor = rollback.kl_scale, f"guard.kl_coef_factor {cfg.guard.kl_coef_factor:g} per rollback"
    if cfg.rl.algorithm == "ppo":
        if cfg.ppo.adaptive_kl and rollback.to_step > 0:
            return (
                f"the adaptive KL coefficient checkpoint-{rollback.to_step} saved, at {scale:g}x the configured "
                f"scale ({factor})"
            )
        return f"ppo.kl_coef is now {cfg.ppo.kl_coef * scale:g} ({cfg.ppo.kl_coef:g} x {scale:g}, {factor})"
    if cfg.rl.algorithm in PREFERENCE_ALGORITHMS:  # DPO's beta weighs the pull back to the reference
        if cfg.dpo.reference_free:
            return "dpo.reference_free is on, so no reference pulls back and guard.kl_coef_factor changes nothing"
        return f"dpo.beta is now {cfg.dpo.beta * scale:g} ({cfg.dpo.beta:g} x {scale:g}, {factor})"
    if cfg.grpo.beta == 0:
        return "grpo.beta is 0, so guard.kl_coef_factor changes nothing"
    return f"grpo.beta is now {cfg.grpo.beta * scale:g} ({cfg.grpo.beta:g} x {scale:g}, {factor})"
