"""Prefect progress artifacts that training callbacks update, throttled to spare the API."""

from __future__ import annotations

import time

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import get_run_context

from rlhf_core.data.tool_calls import TRANSCRIPT_LEGEND, holds_transcripts


def artifact_key(name: str) -> str:
    """A Prefect artifact key from a stage or metric name: lowercase letters, digits and dashes only
    ('reinforce_plus_plus-progress' -> 'reinforce-plus-plus-progress')."""
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def _in_prefect_run() -> bool:
    try:
        get_run_context()
    except Exception:  # MissingContextError outside a flow or task run
        return False
    return True


class StageProgress:
    """A progress artifact for one long stage: `update(done, total)` from the training callback."""

    def __init__(self, key: str, description: str, min_interval_s: float = 2.0):
        self.enabled = _in_prefect_run()
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self.artifact_id = (
            create_progress_artifact(0.0, key=artifact_key(key), description=description) if self.enabled else None
        )

    def update(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (done < total and now - self._last < self.min_interval_s):
            return
        self._last = now
        update_progress_artifact(self.artifact_id, 100.0 * done / max(total, 1))


def publish_table(key: str, rows: list[dict], description: str) -> None:
    """A Prefect table artifact, when running under Prefect; its description ends with the legend of tool
    episodes' transcripts when the rows are theirs."""
    if _in_prefect_run():
        legend = f" {TRANSCRIPT_LEGEND}" if holds_transcripts(rows) else ""
        create_table_artifact(key=artifact_key(key), table=rows, description=description + legend)


def publish_markdown(key: str, markdown: str, description: str) -> None:
    if _in_prefect_run():
        create_markdown_artifact(key=artifact_key(key), markdown=markdown, description=description)


def print_rows(rows: list[dict], title: str) -> None:
    """Rows as a table on the console (long text folded, numbers to 3 decimals), with the legend of tool episodes'
    transcripts under it when the rows are theirs."""
    from rich.console import Console
    from rich.table import Table

    if not rows:
        return
    table = Table(title=title, show_lines=False, caption=TRANSCRIPT_LEGEND if holds_transcripts(rows) else None)
    for key in rows[0]:
        table.add_column(key, overflow="fold", max_width=48 if key in ("prompt", "completion") else None)
    for row in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()])
    Console(width=160).print(table)
