"""The RL stage's training attempts as a person reads them: what a rollback did in one sentence
(tasks/stages/rl/guard.py), each attempt its own line in the plots and the evaluation report naming the step the
export takes (tasks/stages/rl/reporting.py, tasks/reporting/plots.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import load_config
from rlhf_core.evaluation.guard import Rollback
from tasks.reporting.plots import Line, close, curve_figure, lines_figure
from tasks.stages.rl.evaluation_report import eval_panels, exported_lines
from tasks.stages.rl.guard import rollback_sentence

ROLLBACK = Rollback(attempt=1, at_step=40, rule="kl_budget", to_step=0, kl_scale=2.0, set_aside=("checkpoint-40",))


def summary(gold: float, kl: float) -> dict[str, float]:
    return {"eval/vader_mean": gold, "eval/kl_exact_mean": kl}


def test_the_rollback_sentence_says_where_to_what_was_set_aside_and_the_new_kl_coefficient():
    ppo = load_config(None, ["ppo.kl_coef=0.6"])
    sentence = rollback_sentence(ppo, ROLLBACK, Path("out/ppo/k/rolled_back/1"))
    assert sentence == (
        "guard: attempt 1 rolled back at step 40 (kl_budget) to the start (step 0); checkpoint-40 set aside under "
        "out/ppo/k/rolled_back/1; ppo.kl_coef is now 1.2 (0.6 x 2, guard.kl_coef_factor 2 per rollback); "
        "attempt 2 trains on from step 0 (MLflow run ppo-attempt-2)"
    )
    grpo = load_config(None, ["rl.algorithm=grpo", "grpo.beta=0.0"])
    second = Rollback(2, 120, "divergence", 80, 4.0)
    sentence = rollback_sentence(grpo, second, Path("d"))
    assert "attempt 2 rolled back at step 120 (divergence) to checkpoint-80; no checkpoint to set aside" in sentence
    assert "grpo.beta is 0, so guard.kl_coef_factor changes nothing" in sentence
    assert sentence.endswith("attempt 3 trains on from step 80 (MLflow run grpo-attempt-3)")


def test_each_attempt_is_a_line_of_its_own_the_rolled_back_one_dashed_from_where_it_branched_off():
    ended_on = {0: summary(0.1, 0.0), 40: summary(0.3, 1.5), 80: summary(0.5, 2.5)}
    rolled_back = {40: summary(0.4, 3.625)}
    panels = eval_panels(ended_on, ["vader", "kl_exact"], "vader", [(ROLLBACK, rolled_back)])
    first, last = panels["eval kl_exact"]
    assert first == Line([(0, 0.0), (40, 3.625)], "attempt 1, rolled back at step 40", dashed=True)
    assert last == Line([(0, 0.0), (40, 1.5), (80, 2.5)], "attempt 2")
    assert list(panels) == ["eval vader (gold)", "eval kl_exact"]
    fig = lines_figure(panels, "PPO")
    try:
        dashed, solid = fig.axes[1].get_lines()
        assert dashed.get_linestyle() == "--" and solid.get_linestyle() == "-"
        assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == [first.label, last.label]
    finally:
        close(fig)


def test_without_a_rollback_a_panel_is_one_unlabelled_line_as_before():
    (line,) = eval_panels({0: summary(0.1, 0.0), 40: summary(0.3, 1.5)}, ["vader"], "vader", [])["eval vader (gold)"]
    assert line == Line([(0, 0.1), (40, 0.3)])
    fig = curve_figure({"kl": [(1, 0.5), (2, 0.7)]}, "PPO")
    try:
        (drawn,) = fig.axes[0].get_lines()
        assert list(drawn.get_xdata()) == [1, 2] and fig.axes[0].get_legend() is None
    finally:
        close(fig)


@pytest.mark.parametrize(
    ("exported", "expected"),
    [
        (
            (120, "best"),
            [
                "Exported: the checkpoint of step 120 (export.select `best`).",
                "Gold metric `vader`: 0.1000 at step 0 -> 0.6000 at step 120, the exported one (+0.5000); "
                "the last evaluation (step 160): 0.5500.",
            ],
        ),
        (
            (160, "last"),
            [
                "Exported: the checkpoint of step 160 (export.select `last`).",
                "Gold metric `vader`: 0.1000 at step 0 -> 0.5500 at step 160, the exported one (+0.4500).",
            ],
        ),
        (None, ["No checkpoint is exported: the guard stopped RL before the first one was saved."]),
    ],
)
def test_the_evaluation_report_names_the_step_the_export_takes(exported, expected):
    summaries = {0: summary(0.1, 0.0), 120: summary(0.6, 2.0), 160: summary(0.55, 2.9)}
    assert exported_lines(summaries, "vader", exported) == expected
