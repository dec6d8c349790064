"""The RL stage's reporting: its `PolicyReporter` (the loop's callbacks) and the report of its evaluations.

Each held-out evaluation is a metric set, an MLflow table, a Parquet file (tasks/stages/eval_rows.py) and the
guard's verdict in its ledger (tasks/stages/guard.py); each checkpoint is registered with its KL and that
verdict as tags; at the end the evaluations are plotted and tabulated, and `finish` hands on the
checkpoint that `export.select` picks (tasks/stages/checkpoint_selection.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_core.config import PipelineConfig
from rlhf_core.evaluation.generations import summarize_rows
from rlhf_core.evaluation.guard import GuardRollback, GuardStop, Trigger, strongest
from rlhf_core.rl.step import training_metric_names
from rlhf_core.training.loop import LoopResult
from tasks import tracking
from tasks.launch import launcher
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.plots import close, curve_figure
from tasks.reporting.progress import print_rows, publish_markdown, publish_table
from tasks.reporting.reporter import StageReporter
from tasks.stage_io import Checkpoint
from tasks.stages.checkpoint_selection import select_step
from tasks.stages.data import PreparedData
from tasks.stages.eval_rows import load_eval_history, readable_rows, save_eval_rows
from tasks.stages.guard import load_ledger, save_ledger
from tasks.stages.initialization import InitPlan


class PolicyReporter(StageReporter):
    """The RL stage's reporting: checkpoints tagged with their KL, held-out evaluations, GRPO's completions."""

    def __init__(
        self,
        cfg: PipelineConfig,
        run_id: str,
        data: PreparedData,
        plan: InitPlan,
        key: str,
        out_dir: Path,
        gold: str | None,
    ):
        algorithm = cfg.rl.algorithm
        self.names = training_metric_names(algorithm)
        lineage = {
            "algorithm": algorithm,
            "reward_model_version": plan.reward_identity,
            "base_model": plan.policy_identity,
        }
        super().__init__(
            StageIdentity(cfg, algorithm, run_id, key, data.fingerprint),
            model=RegisteredModel(cfg.registry.policy_model_name, lineage=lineage),
            curves={
                self.names.score: (self.names.score,),
                "kl": (self.names.kl,),
                "eval/gold": (f"eval/{gold}_mean",) if gold else (),
            },
        )
        self.key, self.out_dir, self.gold = key, out_dir, gold
        self.ledger = load_ledger(out_dir)
        for step, summary in sorted(self.ledger.evals.items()):  # a resumed attempt's checkpoints carry them too
            self.writer.step_metrics[step] = summary

    def checkpoint_tags(self, path: Path, step: int) -> dict[str, str]:
        saved = json.loads((path.parent / "metrics.json").read_text())
        kl = saved.get(self.names.kl)
        tags = {"kl": f"{kl:.4f}"} if kl is not None else {}
        if step in self.ledger.evals:  # the guard's verdict on this step's evaluation
            broken = self.ledger.broken(step)
            tags.update({"guard.passed": str(not broken).lower(), "guard.broken": ",".join(broken)})
        return tags

    def on_eval(self, rows: list[dict], step: int) -> None:
        triggers = self.ledger.observe(step, summarize_rows(rows), self.cfg.guard, self.cfg.gold_metric())
        summary = self.ledger.evals[step]  # with the ratios to the initial policy
        save_ledger(self.ledger, self.out_dir)
        tracking.logs.log_metrics(self.run_id, summary, step)
        # one MLflow table and one Parquet file per evaluation step: nothing is overwritten
        readable = readable_rows(rows, step)
        tracking.logs.log_table(self.run_id, readable, f"eval/completions_step_{step:06d}.json")
        self.artifact(save_eval_rows(self.out_dir, rows, step), "eval")
        self.record(summary, step)
        shown = [{k: v for k, v in r.items() if k != "rendered_prompt"} for r in readable[:20]]
        publish_table(f"{self.stage}-eval-step-{step}", shown, f"Held-out completions at step {step}")
        print_rows(shown[:5], f"{self.stage.upper()} held-out completions at step {step} (first 5 of {len(rows)})")
        self.logger.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in summary.items()))
        self.report_triggers(triggers, step)
        trigger = strongest(triggers)
        if trigger is not None and trigger.action == "stop":
            raise GuardStop(trigger)
        if trigger is not None and trigger.action == "rollback":
            raise GuardRollback(trigger)

    def report_triggers(self, triggers: list[Trigger], step: int) -> None:
        """Each breach as a metric, a run tag, a console line and one Prefect artifact per evaluation."""
        if not triggers:
            return
        tracking.logs.log_metrics(self.run_id, {f"guard/{t.rule}": t.value for t in triggers}, step)
        tracking.logs.log_metrics(self.run_id, {"guard/triggers": float(len(self.ledger.all_triggers))}, step)
        self.tag({f"guard.{t.rule}": t.message[:250] for t in triggers})
        for t in triggers:
            self.logger.warning("%s", t.message)
        lines = [f"- **{t.rule}** ({t.action}): {t.message}" for t in triggers]
        publish_markdown(f"{self.stage}-guard-step-{step}", "\n".join(lines), f"Guard rules broken at step {step}")

    def on_completions(self, rows: list[dict], step: int) -> None:
        """GRPO's sampled completions of one step as <out_dir>/completions/completions_step_NNNNNN.parquet."""
        import pandas as pd

        path = self.out_dir / "completions" / f"completions_step_{step:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(path)
        self.artifact(path, "completions")

    def finish(self, result: LoopResult | None) -> Checkpoint:
        """The progress completed, curves and the evaluation report published; the stage's Checkpoint: the
        one export.select picks (result None: the guard stopped RL)."""
        self.done()
        if result is not None and result.skipped_steps:
            self.logger.warning("%d optimizer steps were skipped because a loss was not finite", result.skipped_steps)
        if next(iter(self.history.values())):
            self.plot(f"{self.stage}_curves.png", self.stage.upper(), {k: v for k, v in self.history.items() if v})
        evals = {s: r for s, r in load_eval_history(self.out_dir).items() if s in self.ledger.evals}
        if launcher.is_main():
            report_evaluations(self.run_id, self.stage, evals, self.gold)
        step = select_step(self.cfg, self.ledger, self.out_dir, self.stage, self.logger)
        metrics = {
            **(result.metrics if result is not None and result.step == step else {}),
            **self.ledger.evals.get(step, {}),
        }
        triggers = self.ledger.all_triggers
        return Checkpoint(
            path=str((self.out_dir / f"checkpoint-{step}" / "policy").resolve()),
            model_uri=self.version_of(step),
            step=step,
            metrics={**metrics, "guard/triggers": float(len(triggers))},
            key=self.key,
            extra={
                "resumed_from": result.resumed_from if result is not None else None,
                "skipped_steps": result.skipped_steps if result is not None else 0,
                "gold": self.gold,
                "eval_history": dict(sorted(self.ledger.evals.items())),
                "final_eval": self.ledger.evals.get(step, {}),
                "final_rows": evals.get(step, [])[:5],
                "initial_rows": evals.get(0, [])[:5],
                "selected": self.cfg.export.select,
                "guard_broken": self.ledger.broken(step),
                "guard_triggers": [t.message for t in triggers],
                "guard_stopped_at": self.ledger.stopped_at,
                "rollbacks": self.ledger.rollbacks,
            },
        )


def report_evaluations(run_id: str, algorithm: str, evals: dict[int, list[dict]], gold: str | None) -> None:
    """The reward, gold metric and KL of every evaluation against step: a PNG in MLflow, linked from a
    Prefect markdown artifact that also tabulates the numbers."""
    if not evals:
        return
    summaries = {step: summarize_rows(rows) for step, rows in sorted(evals.items())}
    columns = [c for c in ("score", gold, "kl_exact", "length") if c]
    series = {c: [(s, m[f"eval/{c}_mean"]) for s, m in summaries.items() if f"eval/{c}_mean" in m] for c in columns}
    series = {f"eval {c}" + (" (gold)" if c == gold else ""): v for c, v in series.items() if v}
    artifact = "eval/eval_curves.png"
    fig = curve_figure(series, f"{algorithm.upper()}: held-out evaluation")
    tracking.logs.log_figure(run_id, fig, artifact)
    close(fig)
    link = tracking.logs.artifact_link(run_id, artifact)
    present = [c for c in columns if any(f"eval/{c}_mean" in m for m in summaries.values())]
    lines = [
        f"# {algorithm.upper()} evaluation on held-out prompts",
        "",
        f"Reward, gold metric and KL against step: {link}",
        "",
        "| step | " + " | ".join(present) + " |",
        "|---" * (len(present) + 1) + "|",
    ]
    for step, m in summaries.items():
        lines.append(
            f"| {step} | "
            + " | ".join(f"{m[f'eval/{c}_mean']:.4f}" if f"eval/{c}_mean" in m else "" for c in present)
            + " |"
        )
    if gold and len(summaries) > 1:
        first, last = summaries[min(summaries)], summaries[max(summaries)]
        key = f"eval/{gold}_mean"
        if key in first and key in last:
            lines += ["", f"Gold metric `{gold}`: {first[key]:.4f} -> {last[key]:.4f} ({last[key] - first[key]:+.4f})"]
    publish_markdown(f"{algorithm}-evaluation", "\n".join(lines), f"{algorithm.upper()} held-out evaluation")
