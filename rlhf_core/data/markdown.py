"""Markdown tables whose cells show their text as it is: a completion, a transcript or a prompt in a cell of the
pipeline's summary, a version's description or a model card.

A Markdown table row is one line, and `|` ends a cell (in GitHub's, MLflow's and Prefect's renderers alike, even
inside backticks), so a newline becomes `<br>` and a pipe is escaped; a backtick would open a code span, `*`, `_`
and `~` emphasis, `[` a link and `<name` an HTML tag that the renderer hides, so each is escaped too. Every
Markdown table the pipeline writes goes through `markdown_table` (the configuration reference's cells are
Markdown on purpose and keep their own, rlhf_core/config/reference.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_INLINE = re.compile(r"([\\`*_~\[\]|])")  # what would start a code span, emphasis or a link, or end the cell
_TAG_LIKE = re.compile(r"<(?=[A-Za-z/!?])")  # `<tool_call>`, `</s>`: a tag the renderer would hide


def table_cell(value: object) -> str:
    """`value` as the text of one Markdown table cell, shown as it is: newlines as `<br>`, Markdown's inline
    characters and a tag's `<` escaped, surrounding whitespace dropped. None is an empty cell."""
    text = "" if value is None else str(value)
    text = _TAG_LIKE.sub("&lt;", _INLINE.sub(r"\\\1", text.strip()))
    return re.sub(r"\r\n|\r|\n", "<br>", text)


def markdown_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table: `header`, its rule and one line per row, every cell through `table_cell`."""

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(table_cell(c) for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(row) for row in rows)]
