"""rlhf_core/training/timing.py: phase times add up per phase, reset on pop, and cost nothing when off."""

from __future__ import annotations

import time

from rlhf_core.training.timing import PhaseTimer


def test_phases_add_up_until_pop_and_reset():
    timer = PhaseTimer("cpu")
    for _ in range(2):
        with timer("generate"):
            time.sleep(0.01)
    with timer("optimize"):
        time.sleep(0.02)
    times = timer.pop()
    assert set(times) == {"time/generate_s", "time/optimize_s"}
    assert 0.02 <= times["time/generate_s"] < 0.5 and 0.02 <= times["time/optimize_s"] < 0.5
    assert timer.pop() == {}


def test_a_phase_that_raises_is_still_timed_and_a_disabled_timer_records_nothing():
    timer = PhaseTimer()
    try:
        with timer("reward"):
            raise ValueError("boom")
    except ValueError:
        pass
    assert "time/reward_s" in timer.pop()
    off = PhaseTimer(enabled=False)
    with off("generate"):
        pass
    assert off.pop() == {}
