"""Where a training step's time goes: a phase timer whose totals become `time/<phase>_s` metrics.

Each RL step times its phases (generate, the policy's and the reference's log-probability passes,
reward scoring, the value pass, optimization) and returns them with its other metrics, so MLflow
shows them against the step and `make bench` reads them. On CUDA the device is synchronized at each
phase boundary (the kernels are asynchronous, and a timer without it would bill one phase's work to
the next); on CPU nothing is added.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PREFIX = "time/"


class PhaseTimer:
    """Seconds per named phase, summed until `pop`; `enabled=False` makes it free."""

    def __init__(self, device: torch.device | str | None = None, enabled: bool = True):
        self.enabled = enabled
        self.cuda = torch.device(device).type == "cuda" if device is not None else False
        self.totals: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[phase] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """`time/<phase>_s` of every phase timed since the last pop, and reset."""
        out = {f"{PREFIX}{phase}_s": seconds for phase, seconds in self.totals.items()}
        self.totals = defaultdict(float)
        return out
