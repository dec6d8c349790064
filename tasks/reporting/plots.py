"""Training curves as matplotlib figures (rendered off-screen) for MLflow artifacts."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curve_figure(history: dict[str, list[tuple[int, float]]], title: str):
    """One panel per metric name: value against step."""
    fig, axes = plt.subplots(1, len(history), figsize=(4.5 * len(history), 3.2), squeeze=False)
    for ax, (name, points) in zip(axes[0], history.items()):
        steps, values = zip(*points) if points else ((), ())
        ax.plot(steps, values, marker="o", markersize=2)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def close(fig) -> None:
    plt.close(fig)
