"""The RL stage's evaluations in one report: reward, gold metric and KL against step as a PNG in the stage's MLflow
run (each attempt the guard rolled back a dashed line of its own, from where it branched off), a Prefect
markdown artifact that tabulates the numbers of the branch the stage ended on and names the step exported, and in
the stage run's description which of its KL metrics to read (`kl_guide`: MLflow has no metric descriptions)."""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_core.evaluation.generations import summarize_rows
from rlhf_core.evaluation.guard import Rollback
from rlhf_core.rl.step import training_metric_names
from tasks import tracking
from tasks.reporting.plots import Line, close, lines_figure
from tasks.reporting.progress import publish_markdown


def report_evaluations(
    run_id: str,
    algorithm: str,
    evals: dict[int, list[dict]],
    gold: str | None,
    exported: tuple[int, str] | None = None,
    rolled_back: Sequence[tuple[Rollback, dict[int, list[dict]]]] = (),
) -> None:
    """The reward, gold metric and KL of every evaluation against step: a PNG in MLflow (each attempt the guard
    rolled back a dashed line of its own), linked from a Prefect markdown artifact `<algorithm>-evaluation` that
    tabulates the numbers of the branch the stage ended on and names the step exported ((step, export.select));
    which KL to read (`kl_guide`) in the description of the stage run `run_id`."""
    if not evals:
        return
    summaries = {step: summarize_rows(rows) for step, rows in sorted(evals.items())}
    columns = [c for c in ("score", gold, "kl_exact", "length") if c]
    present = [c for c in columns if any(f"eval/{c}_mean" in m for m in summaries.values())]
    artifact = "eval/eval_curves.png"
    discarded = [(r, {s: summarize_rows(rows) for s, rows in sorted(h.items())}) for r, h in rolled_back]
    fig = lines_figure(eval_panels(summaries, present, gold, discarded), f"{algorithm.upper()}: held-out evaluation")
    tracking.logs.log_figure(run_id, fig, artifact)
    close(fig)
    if "kl_exact" in present:
        tracking.logs.describe_run(run_id, kl_guide(algorithm), keep=True)
    lines = [
        f"# {algorithm.upper()} evaluation on held-out prompts",
        "",
        f"Reward, gold metric and KL against step: {tracking.logs.artifact_link(run_id, artifact)}",
        *(["", rolled_back_paragraph(rolled_back)] if rolled_back else []),
        "",
        "| step | " + " | ".join(present) + " |",
        "|---" * (len(present) + 1) + "|",
    ]
    chosen = exported[0] if exported else None
    for step, m in summaries.items():
        cells = [f"{m[f'eval/{c}_mean']:.4f}" if f"eval/{c}_mean" in m else "" for c in present]
        lines.append(f"| {step}{' (exported)' if step == chosen else ''} | " + " | ".join(cells) + " |")
    lines += ["", *exported_lines(summaries, gold, exported)]
    title = f"{algorithm.upper()} held-out evaluation" + (f" (exported step {chosen})" if chosen is not None else "")
    publish_markdown(f"{algorithm}-evaluation", "\n".join(lines), title)


def kl_guide(algorithm: str) -> str:
    """Which of the RL stage run's KL metrics to read, a sentence each (rlhf_core/evaluation/generations.py)."""
    name = training_metric_names(algorithm).kl
    training = f"`{name}`" + ("" if algorithm == "ppo" else " (where logged)")
    said = (
        f" {training} is the training batch's sampling estimate."
        if name
        else " Training logs no KL: it samples nothing."
    )
    return (
        "**Which KL to read**: `eval/kl_exact_mean`, the exact KL to the initial policy on the held-out prompts (nats "
        "per completion), which the guard and promotion read. `eval/kl_mean` (k1) and `eval/kl_k3_mean` (k3) are "
        f"sampling estimates of it, kept as diagnostics.{said}"
    )


def eval_panels(
    summaries: dict[int, dict], columns: list[str], gold: str | None, discarded: list[tuple[Rollback, dict]]
) -> dict[str, list[Line]]:
    """One panel per evaluation column: the branch the stage ended on, and each attempt rolled back (its
    summaries by step) dashed from the step it branched off (`to_step`)."""
    panels = {}
    for c in columns:
        key = f"eval/{c}_mean"
        points = [(s, m[key]) for s, m in summaries.items() if key in m]
        lines = []
        for r, rolled in discarded:
            trunk = [(r.to_step, summaries[r.to_step][key])] if key in summaries.get(r.to_step, {}) else []
            later = [(s, m[key]) for s, m in rolled.items() if key in m]
            lines.append(Line(trunk + later, f"attempt {r.attempt}, rolled back at step {r.at_step}", dashed=True))
        current = f"attempt {discarded[-1][0].attempt + 1}" if discarded else None
        panels[f"eval {c}" + (" (gold)" if c == gold else "")] = [*lines, Line(points, current)]
    return panels


def rolled_back_paragraph(rolled_back: Sequence[tuple[Rollback, dict]]) -> str:
    """What the guard rolled back, for the report: dashed in the figure, not in the table."""
    said = "; ".join(f"attempt {r.attempt} at step {r.at_step} ({r.rule}) to step {r.to_step}" for r, _ in rolled_back)
    return (
        f"The guard rolled back {said}. The rolled-back evaluations are dashed in the figure; the table holds "
        "those of the attempt the stage ended on."
    )


def exported_lines(summaries: dict[int, dict], gold: str | None, exported: tuple[int, str] | None) -> list[str]:
    """Which step the export takes (export.select) and the gold metric from step 0 to it, and at the last step."""
    if exported is None:
        return ["No checkpoint is exported: the guard stopped RL before the first one was saved."]
    step, select = exported
    lines = [f"Exported: the checkpoint of step {step} (export.select `{select}`)."]
    key, first, last = f"eval/{gold}_mean", min(summaries), max(summaries)
    if gold and len(summaries) > 1 and key in summaries[first]:
        start = summaries[first][key]
        if key in summaries.get(step, {}):
            end = summaries[step][key]
            text = f"Gold metric `{gold}`: {start:.4f} at step {first} -> {end:.4f} at step {step}, the exported one"
            text += f" ({end - start:+.4f})"
        else:
            text = f"Gold metric `{gold}`: {start:.4f} at step {first}; the exported step {step} was not evaluated"
        if last != step and key in summaries[last]:
            text += f"; the last evaluation (step {last}): {summaries[last][key]:.4f}"
        lines.append(text + ".")
    return lines
