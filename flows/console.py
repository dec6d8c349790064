"""What the `rlhf` command prints: the configuration reference, and after a run where everything went, the
alignment before and after, and samples of the exported policy."""

from __future__ import annotations

import logging
from pathlib import Path

from rlhf_core.config.redaction import redact


def fields_markdown() -> str:
    """Every config field, its default and meaning, as the Markdown table of docs/configuration.md."""
    from rlhf_core.config.reference import render_reference

    return render_reference()


def print_summary(summary: dict) -> None:
    """The pipeline flow's summary: where the MLflow store, checkpoints, export and model versions are."""
    from rich.console import Console
    from rich.table import Table

    uri = summary["tracking_uri"]
    table = Table(title="Where everything is", show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("where", overflow="fold")
    table.add_row("MLflow store", redact(uri))
    if uri.startswith("sqlite:///"):
        table.add_row("MLflow artifacts", str(Path(uri.removeprefix("sqlite:///")).parent / "mlruns"))
    table.add_row("Output directory", summary["output_dir"])
    if summary.get("demo_world"):
        table.add_row("Demo world", summary["demo_world"])
    table.add_row("Checkpoints", ", ".join(summary["checkpoints"]) or "(none)")
    table.add_row("Last RL checkpoint", summary["policy_path"])
    if summary.get("policy_model_uri"):
        table.add_row("Its model version", summary["policy_model_uri"])
    table.add_row("Exported policy", summary["export_dir"])
    if summary.get("candidate_uri"):
        table.add_row("Exported model version", f"{summary['candidate_uri']} = {summary['candidate_alias']}")
        if summary.get("candidate_blocked"):
            table.add_row("Its promotion", summary["candidate_blocked"])
    if summary.get("reward_model_path"):
        table.add_row("Reward model (HF format)", summary["reward_model_path"])
    if summary.get("reward_model_uri"):
        table.add_row("Reward model version", summary["reward_model_uri"])
    for key, value in summary.get("metrics", {}).items():
        table.add_row(key, f"{value:.4f}")
    console = Console(width=max(140, Console().width))  # paths stay on one line in logs
    if summary.get("final_eval_rows"):
        from rlhf_core.data.chat import shown_prompt
        from tasks.reporting.progress import print_rows

        rows = [{**row, "prompt": shown_prompt(row["prompt"])} for row in summary["final_eval_rows"]]
        print_rows(rows, "Held-out completions of the exported policy (first 5)")
    console.print(table)
    print_alignment(console, summary)
    if uri.startswith("sqlite"):
        console.print(
            f"Open the MLflow UI: {mlflow_command()} ui --backend-store-uri {uri} --port 5000"
            " and browse http://127.0.0.1:5000"
        )
    else:
        console.print(f"MLflow UI: {redact(uri)}")


def mlflow_command() -> str:
    """The `mlflow` of this environment, as the user types it: `.venv/bin/mlflow` in a checkout, `mlflow` where
    the environment's scripts are on PATH (the container image)."""
    import shutil
    import sys

    beside = Path(sys.executable).parent / "mlflow"
    if shutil.which("mlflow") == str(beside):
        return "mlflow"
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)


SAMPLE_PROMPTS = 3  # held-out prompts shown before and after, on the console and in the run's summary
SAMPLES_TITLE = "Three held-out prompts, before and after"


def print_alignment(console, summary: dict) -> None:
    """Before (the initial policy, step 0) and after (the exported checkpoint) side by side: the gold and
    proxy rewards, the KL, length and diversity, the guard's verdict, and the completions of the same
    SAMPLE_PROMPTS prompts; then the one-line gold gain."""
    from rich.table import Table

    from rlhf_core.data.chat import shown_prompt
    from rlhf_core.data.tool_calls import TRANSCRIPT_LEGEND, holds_transcripts
    from rlhf_core.evaluation.promotion import alignment_rows

    gold, history = summary.get("gold_metric"), {int(k): v for k, v in (summary.get("eval_history") or {}).items()}
    if 0 not in history or len(history) < 2:
        return
    after_step = summary.get("selected_step")
    after_step = after_step if after_step in history else max(history)
    before, after = history[0], history[after_step]
    table = Table(title=f"Alignment: the initial policy (step 0) and the exported one (step {after_step})")
    for column in ("", "before", "after", "after / before"):
        table.add_column(column)
    for row in alignment_rows(before, after, gold):
        table.add_row(*row)
    console.print(table)
    triggers = summary.get("guard_triggers") or []
    console.print(f"Guard: {len(triggers)} trigger(s)" + "".join(f"\n  {t}" for t in triggers[:10]))
    for sentence in summary.get("guard_rollbacks") or []:
        console.print(f"  what it did: {sentence}")
    if summary.get("guard_off"):
        console.print(summary["guard_off"])
    pairs = list(zip(summary.get("initial_eval_rows") or [], summary.get("final_eval_rows") or []))[:SAMPLE_PROMPTS]
    if pairs:
        legend = TRANSCRIPT_LEGEND if holds_transcripts([row for pair in pairs for row in pair]) else None
        samples = Table(title=SAMPLES_TITLE, caption=legend)
        for column in ("prompt", "before", "after"):
            samples.add_column(column, overflow="fold")
        for first, last in pairs:
            samples.add_row(shown_prompt(first["prompt"]), first["completion"], last["completion"])
        console.print(samples)
    key = f"eval/{gold}_mean"
    if key in before and key in after:
        console.print(
            f"Gold metric {gold}: {before[key]:.3f} at step 0 -> {after[key]:.3f} at step {after_step} "
            f"({after[key] - before[key]:+.3f})"
        )


def memory_table(estimate, budget_gib: float | None) -> str:
    """`rlhf validate`'s estimate of the peak memory per device: the largest stage's parts (GiB) and total, the
    other stages' peaks, what was not counted, and the budget (run.memory_budget_gib). Plain text that, as the
    rest of what validate prints, reads as YAML (no ': ' inside a line)."""
    gib, peak = 2**30, estimate.peak
    unknown = [phrase.replace(": ", ", ") for phrase in estimate.unknown]  # an error's text may hold one
    head = "Peak memory per device, estimated before training (no weights built)"
    if peak is None:
        return f"{head}:\n  unknown, " + "; ".join(unknown)
    lines = [f"{head}, the {peak.stage} stage on {estimate.device}:", f"  {'part':<44}{'GiB':>8}"]
    lines += [f"  {p.name:<44}{p.bytes / gib:>8.2f}" for p in peak.parts]
    lines.append(f"  {'total per device':<44}{peak.total / gib:>8.2f}")
    others = [f"{s.stage} {s.total / gib:.2f} GiB" for s in estimate.stages if s is not peak]
    if others:
        lines.append(f"  at their peaks the other stages take {', '.join(others)}")
    lines += [f"  not counted, {phrase}" for phrase in unknown]
    if budget_gib is not None:
        lines.append(f"  within run.memory_budget_gib {budget_gib:g}")
    return "\n".join(lines)


def promotion_line(result: dict) -> str:
    """`rlhf promote`'s verdict in one line: the candidate and champion versions, the decision and why."""
    return (
        f"{result['model']} version {result['candidate']} vs champion {result['champion']}: "
        f"{result['decision']}{'' if result['changed'] else ' (nothing changed)'}; {result['reason']}"
    )


class _NoTraceback(logging.Filter):
    """Drops the traceback of a known failure (`kinds`) from a console handler's record: Prefect logs every
    failed task's and flow's exception with its traceback, and for these the sentence is the whole story
    (the stage's log file holds its processes' tracebacks; Prefect's API log keeps its own)."""

    def __init__(self, kinds: tuple[type[BaseException], ...]):
        super().__init__()
        self.kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, self.kinds):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_known_failures(kinds: tuple[type[BaseException], ...]) -> None:
    """Keep the tracebacks of `kinds` off the console (Prefect's console handlers)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, _NoTraceback) for f in handler.filters):
            handler.addFilter(_NoTraceback(kinds))
