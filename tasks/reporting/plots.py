"""Training curves as matplotlib figures (rendered off-screen) for MLflow artifacts.

A panel draws one line per metric, or several: an RL stage the guard rolled back draws each training attempt
as its own line, the ones rolled back dashed and labelled (`Line`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """One line of a panel: its points (step, value), its legend label (None: no legend) and whether it is dashed
    (a training attempt the guard rolled back)."""

    points: list[tuple[int, float]]
    label: str | None = None
    dashed: bool = False


def pyplot():
    """matplotlib's pyplot, drawing off-screen (Agg); imported at the first figure, not with this module: most
    processes that import the reporters (a launched stage's ranks, the CLI) never draw one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curve_figure(history: dict[str, list[tuple[int, float]]], title: str):
    """One panel per metric name: value against step."""
    return lines_figure({name: [Line(points)] for name, points in history.items()}, title)


def lines_figure(panels: dict[str, list[Line]], title: str):
    """One panel per name, each `Line` of it drawn against step (a legend when a line is labelled)."""
    fig, axes = pyplot().subplots(1, len(panels), figsize=(4.5 * len(panels), 3.2), squeeze=False)
    for ax, (name, lines) in zip(axes[0], panels.items()):
        for line in lines:
            steps, values = zip(*line.points) if line.points else ((), ())
            style = {"linestyle": "--", "alpha": 0.7} if line.dashed else {}
            ax.plot(steps, values, marker="o", markersize=2, label=line.label, **style)
        if any(line.label for line in lines):
            ax.legend(fontsize="x-small")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def close(fig) -> None:
    pyplot().close(fig)
