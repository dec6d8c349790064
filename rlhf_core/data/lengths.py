"""Token lengths of a table against the limits: percentiles, the rows a limit cuts or drops, the table printed.

`rlhf validate` and the data stage measure every table the same way (`rlhf_core.data.tables.apply_length_policy`
counts the tokens); this module turns those counts into what a user reads before training: p50, p95 and the
longest row of each table beside the limit that applies to it, how many rows are over it and what
data.overlong does to them, and the policy's context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# which limit each kind of table is held to: (config field, what is measured)
LIMITS = {
    "preference": ("data.max_length", "prompt + the longer answer"),
    "prompt": ("data.max_prompt_length", "prompt"),
    "text": ("data.max_length", "text"),
}


def percentile(values: list[int], q: float) -> int:
    """The nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]


@dataclass(frozen=True)
class TableLengths:
    """One table's token lengths against its limit, and what the length policy does to the rows over it."""

    table: str
    kind: str
    rows: int
    p50: int
    p95: int
    longest: int
    limit: int
    over: int
    action: Literal["truncate", "drop"]

    @property
    def limit_field(self) -> str:
        return LIMITS[self.kind][0]

    @property
    def kept(self) -> int:
        return self.rows - self.over if self.action == "drop" else self.rows

    def effect(self) -> str:
        """What happens to the rows over the limit, in words: 'none over', '3 truncated', '3 dropped'."""
        if not self.over:
            return "none over"
        return f"{self.over} {'dropped' if self.action == 'drop' else 'truncated'}"

    def sentence(self, source: str) -> str:
        """The warning the data stage logs when rows are over the limit."""
        verb = "are dropped" if self.action == "drop" else "will be truncated to it"
        return (
            f"{source}: {self.over} of {self.rows} rows are longer than {self.limit_field} {self.limit} tokens "
            f"(the longest has {self.longest}) and {verb}"
        )

    def as_row(self) -> dict:
        """The table's columns in the data stage's report (its `data-report` Prefect table artifact)."""
        return {
            "tokens_p50": self.p50,
            "tokens_p95": self.p95,
            "tokens_max": self.longest,
            "limit": f"{self.limit_field} {self.limit}",
        }


def measure(
    table: str, kind: str, lengths: list[int], *, limit: int, action: Literal["truncate", "drop"]
) -> TableLengths:
    """The lengths of one table's rows (tokens, as `LIMITS` says what is counted) against `limit`."""
    if kind not in LIMITS:
        raise ValueError(f"unknown table kind {kind!r}; known: {', '.join(LIMITS)}")
    if not lengths:
        return TableLengths(table, kind, 0, 0, 0, 0, limit, 0, action)
    return TableLengths(
        table=table,
        kind=kind,
        rows=len(lengths),
        p50=percentile(lengths, 50),
        p95=percentile(lengths, 95),
        longest=max(lengths),
        limit=limit,
        over=sum(n > limit for n in lengths),
        action=action,
    )


HEADER = ("table", "rows", "p50", "p95", "max", "limit", "over the limit")


def length_table(measured: list[TableLengths], skipped: dict[str, str], context: str) -> str:
    """The token-length table `rlhf validate` prints: one line per measured table, then the tables it could
    not measure here (and why), then the policy's context length (`context`, already in words)."""
    lines = [
        (m.table, str(m.rows), str(m.p50), str(m.p95), str(m.longest), f"{m.limit_field} {m.limit}", m.effect())
        for m in measured
    ]
    widths = [max(len(row[i]) for row in [HEADER, *lines]) for i in range(len(HEADER))]
    out = ["Token lengths of the data, against the limits:"]
    for row in [HEADER, *lines] if lines else []:
        out.append(
            "  "
            + "  ".join(
                cell.ljust(w) if i in (0, 5, 6) else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
    reasons: dict[str, list[str]] = {}
    for table, why in skipped.items():  # tables skipped for one reason share a line
        reasons.setdefault(why, []).append(table)
    out += [f"  {', '.join(tables)}: not measured here ({why})" for why, tables in reasons.items()]
    out.append(f"The policy's context: {context}.")
    return "\n".join(out)
