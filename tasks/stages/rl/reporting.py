"""The RL stage's reporting, which reports and decides nothing: its `PolicyReporter` (the loop's callbacks, and
what the guard tells it).

Each held-out evaluation is a metric set, a CSV table in MLflow, a Parquet file beside the run
(tasks/stages/rl/eval_rows.py), with the guard's verdict on it; each checkpoint is registered with its KL and that
verdict as tags; at the end the evaluations are plotted and tabulated (tasks/stages/rl/evaluation_report.py), and
`finish` hands on the checkpoint that `export.select` picks (tasks/stages/rl/checkpoint_selection.py).

A guard rollback starts a new training attempt, shown as one: its metrics, evaluations and checkpoints go to an
MLflow run of its own nested in the stage run (`ppo-attempt-2`, tasks/tracking/runs.py `attempt_run`), its
Prefect artifacts' keys carry it (`ppo-attempt-2-eval-step-40`), its checkpoints' versions the tag `attempt`,
and the plots draw each attempt as its own line, the ones rolled back dashed. What the guard did is one
sentence (tasks/stages/rl/guard.py): in the guard's Prefect artifact of that step, a tag and the description of
the stage run, the attempt run's description and the log.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from rlhf_core.config import PipelineConfig
from rlhf_core.evaluation.guard import GuardLedger, GuardStopError, Rollback, Verdict, divergence_off
from rlhf_core.rl.step import training_metric_names
from rlhf_core.training.loop import LoopResult
from tasks import tracking
from tasks.launch import launcher
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.plots import Line, close, lines_figure
from tasks.reporting.progress import print_rows, publish_markdown, publish_table
from tasks.reporting.reporter import StageReporter
from tasks.stage_io import Checkpoint
from tasks.stages.data import PreparedData
from tasks.stages.initialization import InitPlan
from tasks.stages.rl.checkpoint_selection import select_step
from tasks.stages.rl.eval_rows import load_eval_history, readable_rows, save_eval_rows, set_aside_history
from tasks.stages.rl.evaluation_report import report_evaluations
from tasks.stages.rl.guard import Guard, GuardListener


class PolicyReporter(StageReporter):
    """The RL stage's reporting: checkpoints tagged with their KL, held-out evaluations, GRPO's completions, and
    each training attempt after a guard rollback in an MLflow run of its own."""

    def __init__(
        self,
        cfg: PipelineConfig,
        run_id: str,
        data: PreparedData,
        plan: InitPlan,
        key: str,
        guard: Guard,
        gold: str | None,
    ):
        algorithm = cfg.rl.algorithm
        self.names = training_metric_names(algorithm)
        lineage = {"algorithm": algorithm, **plan.lineage}
        super().__init__(
            StageIdentity(cfg, algorithm, run_id, key, data.fingerprint),
            model=RegisteredModel(cfg.registry.policy_model_name, lineage=lineage),
            curves={
                self.names.score: (self.names.score,),
                "kl": (self.names.kl,) if self.names.kl else (),
                "eval/gold": (f"eval/{gold}_mean",) if gold else (),
            },
        )
        self.key, self.out_dir, self.gold, self.stage_run_id = key, guard.out_dir, gold, run_id
        self.guard = guard  # read only: the ledger is the guard's
        for step, summary in sorted(self.ledger.evals.items()):  # a resumed attempt's checkpoints carry them too
            self.writer.step_metrics[step] = summary
        self.attempts = Attempts(self.stage, run_id)
        self.pending_guard: tuple[str, list[str], str] | None = None  # a breach's artifact, told what was done
        if self.ledger.rollbacks and self.ledger.stopped_at is None:  # resumed after a rollback
            self.tag({"rlhf.attempt": str(self.ledger.attempt)})
        if off := divergence_off(cfg.guard, gold):
            self.logger.info(off)

    def __exit__(self, error_type, error, traceback) -> None:
        try:
            super().__exit__(error_type, error, traceback)
        except BaseException as err:
            self.attempts.end(type(err), err, err.__traceback__)
            raise
        self.attempts.end(error_type, error, traceback)

    @property
    def ledger(self) -> GuardLedger:
        return self.guard.ledger

    def listener(self) -> GuardListener:
        """What the guard tells this reporter (tasks/stages/rl/guard.py)."""
        return GuardListener(self.on_eval, self.on_guard_action, self.begin_attempt, self.wait_registrations)

    @property
    def prefix(self) -> str:
        """What the stage's Prefect artifact keys start with: `ppo`, or `ppo-attempt-2` after a rollback."""
        attempt = self.ledger.attempt
        return tracking.runs.attempt_run_name(self.stage, attempt) if attempt > 1 else self.stage

    def checkpoint_tags(self, path: Path, step: int) -> dict[str, str]:
        saved = json.loads((path.parent / "metrics.json").read_text())
        kl = saved.get(self.names.kl)
        tags = {"kl": f"{kl:.4f}"} if kl is not None else {}
        if (attempt := self.ledger.attempt_of(step)) > 1:  # one version per attempt of a step (registry identity)
            tags["attempt"] = str(attempt)
        if step in self.ledger.evals:  # the guard's verdict on this step's evaluation
            broken = self.ledger.broken(step)
            tags.update({"guard.passed": str(not broken).lower(), "guard.broken": ",".join(broken)})
        return tags

    def on_eval(self, rows: list[dict], step: int, verdict: Verdict) -> None:
        """One evaluation and the guard's verdict on it: metrics, a CSV table in MLflow, a Parquet file beside the
        run, a Prefect table, the console, and each broken rule (`report_triggers`)."""
        summary = self.ledger.evals[step]  # with the ratios to the initial policy
        tracking.logs.log_metrics(self.run_id, summary, step)
        # one table per evaluation step, nothing overwritten: CSV, which MLflow's UI shows
        readable = readable_rows(rows, step)
        tracking.logs.log_table(self.run_id, readable, f"eval/completions_step_{step:06d}.csv")
        save_eval_rows(self.out_dir, rows, step)
        self.record(summary, step)
        shown = [{k: v for k, v in r.items() if k != "rendered_prompt"} for r in readable[:20]]
        what = f" (attempt {self.ledger.attempt})" if self.ledger.attempt > 1 else ""
        publish_table(f"{self.prefix}-eval-step-{step}", shown, f"Held-out completions at step {step}{what}")
        print_rows(
            shown[:5],
            f"{self.stage.upper()} held-out completions at step {step}{what} ({'first 5 of ' if len(rows) > 5 else 'all '}{len(rows)})",
        )
        self.logger.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in summary.items()))
        self.report_triggers(verdict)

    def report_triggers(self, verdict: Verdict) -> None:
        """Each breach as a metric, a run tag, a console line and one Prefect artifact per evaluation (for a breach
        that stops or rolls back, published once the guard has acted: `on_guard_action`)."""
        triggers, step = verdict.triggers, verdict.step
        if not triggers:
            return
        tracking.logs.log_metrics(self.run_id, {f"guard/{t.rule}": t.value for t in triggers}, step)
        tracking.logs.log_metrics(self.run_id, {"guard/triggers": float(len(self.ledger.all_triggers))}, step)
        tracking.logs.set_run_tags(self.stage_run_id, {f"guard.{t.rule}": t.message[:250] for t in triggers})
        for t in triggers:
            self.logger.warning("%s", t.message)
        lines = [f"- **{t.rule}** ({t.action}): {t.message}" for t in triggers]
        what = f" (attempt {self.ledger.attempt})" if self.ledger.attempt > 1 else ""
        guard = (f"{self.prefix}-guard-step-{step}", lines, f"Guard rules broken at step {step}{what}")
        if verdict.action == "continue":
            publish_markdown(guard[0], "\n".join(guard[1]), guard[2])
        else:
            self.pending_guard = guard

    def on_guard_action(self, step: int, sentence: str) -> None:
        """What the guard did at the breach of `step` (stop, or roll back), in one sentence: in the log, the
        guard's Prefect artifact of that step, and the stage run's tags and description."""
        guard, self.pending_guard = self.pending_guard, None
        report_guard_action(self, step, sentence, guard)

    def begin_attempt(self) -> None:
        """The next training attempt after a rollback (tasks/stages/rl/guard.py): the curves start over from the step
        it goes back to, and its metrics, evaluations and checkpoints go to a run of its own in the stage run."""
        rollback = self.ledger.rollback_log[-1]
        self.attempts.begin(rollback, self.writer.start_over(rollback.to_step), self.switch_run)

    def on_completions(self, rows: list[dict], step: int) -> None:
        """GRPO's sampled completions of one step: completions/completions_step_NNNNNN.csv in MLflow, .parquet here."""
        import pandas as pd

        path = self.out_dir / "completions" / f"completions_step_{step:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(path)
        tracking.logs.log_table(self.run_id, rows, f"completions/completions_step_{step:06d}.csv")

    def finish(self, result: LoopResult | None) -> Checkpoint:
        """The progress completed, curves and the evaluation report published; the stage's Checkpoint: the
        one export.select picks (result None: the guard stopped RL)."""
        self.done()
        if result is not None and result.skipped_steps:
            self.logger.warning("%d optimizer steps were skipped because a loss was not finite", result.skipped_steps)
        if any(self.history.values()):
            self.attempts.plot(self.history, self.ledger.attempt)
        evals = {s: r for s, r in load_eval_history(self.out_dir).items() if s in self.ledger.evals}
        try:
            step = select_step(self.cfg, self.ledger, self.out_dir, self.stage, self.logger)
        except GuardStopError:
            report_stage_evaluations(self, evals, None)
            raise
        report_stage_evaluations(self, evals, step)
        return stage_checkpoint(self, result, step, evals)


class Attempts:
    """The RL stage's training attempts after guard rollbacks in this process: the MLflow run of the one under
    way (nested in the stage run: tasks/tracking/runs.py `attempt_run`) and the curves of those rolled back."""

    def __init__(self, stage: str, stage_run_id: str):
        self.stage, self.stage_run_id = stage, stage_run_id
        self.run = ExitStack()  # the run of the attempt under way (none for the stage's first)
        self.rolled_back: list[tuple[str, dict[str, list[tuple[int, float]]]]] = []  # (label, curves)

    def begin(self, rollback: Rollback, curves: dict, switch_run: Callable[[str], None]) -> None:
        """The attempt after `rollback`, whose attempt left `curves`: its run started and `switch_run` to it; the
        run of the attempt before (when it had one) ends FINISHED."""
        self.rolled_back.append((f"attempt {rollback.attempt}, rolled back at step {rollback.at_step}", curves))
        attempt = rollback.attempt + 1
        description = f"Attempt {attempt} of the {self.stage} stage: {rollback.message.removeprefix('guard: ')}."
        previous, self.run = self.run, ExitStack()
        switch_run(
            self.run.enter_context(tracking.runs.attempt_run(self.stage_run_id, self.stage, attempt, description))
        )
        previous.close()
        tracking.logs.set_run_tags(self.stage_run_id, {"rlhf.attempts": str(attempt)})

    def end(self, error_type, error, traceback) -> None:
        """The run of the attempt under way ends with the stage: FINISHED, or FAILED when `error`."""
        self.run.__exit__(error_type, error, traceback)

    def plot(self, history: dict[str, list[tuple[int, float]]], attempt: int) -> None:
        """<stage>_curves.png in the stage run: each curve of `history` (the attempt under way, `attempt`) against
        step, and each attempt rolled back its own dashed line."""
        current = f"attempt {attempt}" if self.rolled_back else None
        panels = {
            name: [
                *(Line(curves.get(name, []), label, dashed=True) for label, curves in self.rolled_back),
                Line(points, current),
            ]
            for name, points in history.items()
            if points or any(curves.get(name) for _, curves in self.rolled_back)
        }
        fig = lines_figure(panels, self.stage.upper())
        tracking.logs.log_figure(self.stage_run_id, fig, f"{self.stage}_curves.png")
        close(fig)


def report_guard_action(
    reporter: PolicyReporter, step: int, sentence: str, guard: tuple[str, list[str], str] | None
) -> None:
    """What the guard did at the breach of `step`: the log, the breach's Prefect artifact `guard` (key, lines,
    title) ending with `sentence`, the stage run's tag `guard.stopped` or `guard.rollback.<n>` and description."""
    reporter.logger.warning("%s", sentence)
    key, lines, title = guard or (f"{reporter.stage}-guard-step-{step}", [], f"Guard at step {step}")
    did = sentence.removeprefix("guard: ")
    publish_markdown(key, "\n".join([*lines, "", f"**What the guard did**: {did}."]), title)
    ledger, run_id = reporter.ledger, reporter.stage_run_id
    if ledger.stopped_at is not None:
        tracking.logs.set_run_tags(run_id, {"guard.stopped": sentence})
        return
    tracking.logs.set_run_tags(run_id, {f"guard.rollback.{r.attempt}": r.message for r in ledger.rollback_log})
    note = "\n".join(f"- {r.message.removeprefix('guard: ')}." for r in ledger.rollback_log)
    tracking.logs.describe_run(
        run_id, f"The guard rolled this stage back; each later attempt has a run of its own:\n\n{note}"
    )


def report_stage_evaluations(reporter: PolicyReporter, evals: dict[int, list[dict]], exported: int | None) -> None:
    """The evaluation report (`report_evaluations`) in the stage run, with the attempts rolled back and the
    exported step (None: none)."""
    if not launcher.is_main():
        return
    set_aside = set_aside_history(reporter.out_dir)
    rolled_back = [(r, set_aside[r.attempt]) for r in reporter.ledger.rollback_log if r.attempt in set_aside]
    selected = (exported, reporter.cfg.export.select) if exported is not None else None
    report_evaluations(reporter.stage_run_id, reporter.stage, evals, reporter.gold, selected, rolled_back)


def stage_checkpoint(reporter: PolicyReporter, result: LoopResult | None, step: int, evals: dict) -> Checkpoint:
    """What the RL stage hands on: the checkpoint of `step` (export.select's), its version, metrics and story."""
    ledger = reporter.ledger
    metrics = {**(result.metrics if result is not None and result.step == step else {}), **ledger.evals.get(step, {})}
    triggers = ledger.all_triggers
    return Checkpoint(
        path=str((reporter.out_dir / f"checkpoint-{step}" / "policy").resolve()),
        model_uri=reporter.version_of(step),
        step=step,
        metrics={**metrics, "guard/triggers": float(len(triggers))},
        key=reporter.key,
        extra={
            "resumed_from": result.resumed_from if result is not None else None,
            "skipped_steps": result.skipped_steps if result is not None else 0,
            "gold": reporter.gold,
            "eval_history": dict(sorted(ledger.evals.items())),
            "final_eval": ledger.evals.get(step, {}),
            "final_rows": evals.get(step, [])[:5],
            "initial_rows": evals.get(0, [])[:5],
            "selected": reporter.cfg.export.select,
            "guard_broken": ledger.broken(step),
            "guard_triggers": [t.message for t in triggers],
            "guard_stopped_at": ledger.stopped_at,
            "rollbacks": ledger.rollbacks,
            "guard_rollbacks": [r.message for r in ledger.rollback_log],
            "attempt": ledger.attempt_of(step),
        },
    )
