"""The largest absolute difference each parity comparison reached: recorded by the comparisons
(trl_ppo_common.close, verl_common.close), printed per module by conftest.py's `report_max_diffs`."""

from __future__ import annotations

MAX_DIFFS: dict[str, float] = {}  # comparison -> max abs diff reached in this module


def record_max_diff(name: str, diff: float) -> None:
    MAX_DIFFS[name] = max(MAX_DIFFS.get(name, 0.0), diff)


def max_diffs_report() -> str:
    """One line per comparison, then the largest on the same inputs (math) and, where any comparison is of
    model outputs (named '... (model)'), the largest of those."""
    width = max(map(len, MAX_DIFFS))
    lines = [f"  {key:<{width}}  {diff:.3g}" for key, diff in sorted(MAX_DIFFS.items())]
    math = max((d for k, d in MAX_DIFFS.items() if "(model)" not in k), default=0.0)
    overall = f"  overall: math on the same inputs {math:.3g}"
    models = [d for k, d in MAX_DIFFS.items() if "(model)" in k]
    if models:
        overall += f", model outputs (model) {max(models):.3g}"
    return "\nmax abs diff per comparison:\n" + "\n".join(lines) + "\n" + overall
