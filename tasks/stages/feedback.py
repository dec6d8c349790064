"""The data stage's `traces:<experiment>` sources: users' feedback on the served policy as a table file.

`feedback_source` reads the experiment's traced answers (tasks/tracking/feedback.py) in the source's window,
turns them into preference pairs or prompts (rlhf_core/data/feedback.py) and writes them, with their
provenance, to <output_dir>/data/feedback/<table>.jsonl, which the data stage then reads as any local file.
The window ends now (`until_ms`, the cut-off the pipeline keeps in the registry once its candidate is
registered) and starts at `since`: all feedback, the last training's cut-off, or a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlhf_core.config import DatasetSpec, PipelineConfig
from rlhf_core.data.feedback import Window, feedback_prompts, feedback_table
from rlhf_core.data.rows import DataValidationError, Kind
from rlhf_core.data.tables import save_rows
from tasks import tracking


@dataclass(frozen=True)
class FeedbackRead:
    """A traces: source read: the file written, its window's end, rows, and the report's sentences."""

    path: str
    experiment: str
    until_ms: int
    rows: int
    notes: list[str] = field(default_factory=list)


def window_of(cfg: PipelineConfig, spec: DatasetSpec, until_ms: int, field_name: str) -> Window:
    """The source's window: since 'all' (None), a time, or the last training's cut-off (None before the first)."""
    if spec.since == "last_training":
        since = tracking.feedback.last_cutoff(cfg.registry.policy_model_name, spec.feedback_experiment, field_name)
    else:
        since = spec.since_ms()
    return Window(since_ms=since, until_ms=until_ms)


def feedback_rows(
    cfg: PipelineConfig, spec: DatasetSpec, kind: Kind, field_name: str, stop_text: str = ""
) -> tuple[list[dict], FeedbackRead]:
    """The rows a traces: source gives now (pairs for preference tables, prompts for prompt tables); `stop_text`
    ends each completion a stop token ended."""
    experiment = spec.feedback_experiment
    until_ms = int(time.time() * 1000)
    window = window_of(cfg, spec, until_ms, field_name)
    answers = tracking.feedback.answered_prompts(experiment, field_name)
    if kind == "preference":
        table = feedback_table(answers, window, stop_text, spec.split)
        rows, notes = table.pairs, table.sentences()
    elif kind == "prompt":
        rows, notes = feedback_prompts(answers, window, spec.split), []
    else:
        raise DataValidationError(
            f"{field_name}.path: a traces: source gives preference pairs or prompts, not SFT text"
        )
    return rows, FeedbackRead("", experiment, until_ms, len(rows), notes)


def feedback_source(
    cfg: PipelineConfig, name: str, field_name: str, spec: DatasetSpec, kind: Kind, tokenizer
) -> FeedbackRead:
    """Read a traces: source and write its rows as <output_dir>/data/feedback/<name>.jsonl, each completion that
    stopped ending on the tokenizer's eos token as the policy wrote it (the reward model reads sequences that end on
    it, as in RL); no rows in the window is a one-sentence DataValidationError."""
    rows, read = feedback_rows(cfg, spec, kind, field_name, getattr(tokenizer, "eos_token", None) or "")
    if not rows:
        since = "" if spec.since == "all" else f" since {spec.since}"
        said = f" ({'; '.join(read.notes)})" if read.notes else ""
        raise DataValidationError(
            f"{field_name}.path: the experiment '{read.experiment}' holds no "
            f"{'feedback pairs' if kind == 'preference' else 'traced prompts'}{since} to train on{said}"
        )
    path = cfg.run.output_dir / "data" / "feedback" / f"{name}.jsonl"
    save_rows(rows, path)
    return FeedbackRead(str(path), read.experiment, read.until_ms, read.rows, read.notes)


def new_pairs(cfg: PipelineConfig) -> tuple[int, str]:
    """(the feedback pairs data.preference's traces: source holds after the last training's cut-off, its
    experiment), read from the config's tracking store: what `rlhf-feedback-watch` counts. A source of another
    kind is a one-sentence UserError."""
    spec = cfg.data.preference
    if spec.feedback_experiment is None:
        raise DataValidationError(
            f"data.preference.path is '{spec.path}': rlhf-feedback-watch counts the feedback of a "
            "traces:<experiment> source (docs/feedback.md)"
        )
    tracking.store.configure(cfg.tracking_uri())
    rows, read = feedback_rows(cfg, spec.model_copy(update={"since": "last_training"}), "preference", "data.preference")
    return len(rows), read.experiment
