"""rlhf_core/evaluation/guard.py: each rule fires on a synthetic history that breaks it and stays quiet otherwise;
the ledger keeps branches, picks checkpoints and survives a round trip through JSON."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import DivergenceRule, GuardConfig, GuardRule, load_config
from rlhf_core.evaluation.guard import (
    GuardLedger,
    Rollback,
    Verdict,
    check,
    relative_to_initial,
    set_aside,
    strongest,
)

REPO = Path(__file__).resolve().parents[3]
INITIAL = {
    "eval/score_mean": 0.0,
    "eval/vader_compound_mean": 0.0,
    "eval/kl_k3_mean": 0.0,
    "eval/length_mean": 4.0,
    "eval/distinct_2": 0.8,
}


def at(**changes) -> dict[str, float]:
    return {**INITIAL, **{f"eval/{k}" if not k.startswith("eval/") else k: v for k, v in changes.items()}}


def only(**rules) -> GuardConfig:
    """A guard with every rule off but `rules`."""
    off = {
        "kl_budget": GuardRule(),
        "min_distinct_ratio": GuardRule(),
        "max_length_change": GuardRule(),
        "divergence": DivergenceRule(evals=None),
    }
    return GuardConfig(**{**off, **rules})


def fired(history, guard, gold="vader_compound") -> list[str]:
    return [t.rule for t in check(list(enumerate(history)), guard, gold)]


def test_kl_budget_uses_k3_and_fires_only_above_the_limit():
    guard = only(kl_budget=GuardRule(limit=3.0, action="rollback"))
    assert fired([INITIAL, at(kl_k3_mean=2.9)], guard) == []
    assert fired([INITIAL, at(kl_k3_mean=3.1)], guard) == ["kl_budget"]
    # k1 only when k3 is missing
    no_k3 = {k: v for k, v in at(kl_mean=5.0).items() if k != "eval/kl_k3_mean"}
    assert fired([INITIAL, no_k3], guard) == ["kl_budget"]
    (trigger,) = check([(0, INITIAL), (40, at(kl_k3_mean=6.25))], guard, None)
    assert (trigger.action, trigger.step, trigger.value, trigger.limit) == ("rollback", 40, 6.25, 3.0)
    assert trigger.message == "guard kl_budget at step 40: eval KL 6.250 nats > 3 (action: rollback)"


def test_min_distinct_ratio_compares_with_the_initial_policy():
    guard = only(min_distinct_ratio=GuardRule(limit=0.5))
    assert fired([INITIAL, at(distinct_2=0.41)], guard) == []  # 0.51 of 0.8
    assert fired([INITIAL, at(distinct_2=0.39)], guard) == ["min_distinct_ratio"]
    assert fired([INITIAL], guard) == []  # the initial evaluation breaks nothing


def test_max_length_change_fires_both_ways():
    guard = only(max_length_change=GuardRule(limit=0.3, action="stop"))
    assert fired([INITIAL, at(length_mean=5.1)], guard) == []  # +27.5%
    assert fired([INITIAL, at(length_mean=2.9)], guard) == []  # -27.5%
    assert fired([INITIAL, at(length_mean=5.3)], guard) == ["max_length_change"]
    assert fired([INITIAL, at(length_mean=2.7)], guard) == ["max_length_change"]


def test_the_demo_rolls_back_answers_30_percent_shorter():
    """configs/demo.yaml's length rule, as PPO's seed 42 met it (docs/guard.md): the answers' mean fell from 3.195
    to 2.207 tokens by step 40 (x0.69) at 2.85 nats, under the KL budget; the rule rolls back, once."""
    guard = load_config(str(REPO / "configs" / "demo.yaml")).guard
    start = at(length_mean=3.195, kl_exact_mean=0.0)
    ledger = GuardLedger()
    ledger.judge(0, start, guard, "vader_compound")
    verdict = ledger.judge(40, at(length_mean=2.207, kl_exact_mean=2.845), guard, "vader_compound")
    assert verdict.action == "rollback" and [t.rule for t in verdict.triggers] == ["max_length_change"]
    assert fired([start, at(length_mean=2.27, kl_exact_mean=2.9)], guard) == []  # x0.71: inside the 30%


def test_divergence_needs_the_proxy_up_and_gold_down_at_each_of_k_evaluations():
    guard = only(divergence=DivergenceRule(evals=2, action="warn"))
    rising = [at(score_mean=s, vader_compound_mean=g) for s, g in [(1, 0.5), (2, 0.4), (3, 0.3)]]
    assert fired([INITIAL, *rising], guard) == ["divergence"]
    assert fired([INITIAL, *rising[:2]], guard) == []  # gold fell at only one of the last two steps
    both_up = [at(score_mean=s, vader_compound_mean=g) for s, g in [(1, 0.1), (2, 0.4), (3, 0.5)]]
    assert fired([INITIAL, *both_up], guard) == []
    flat_proxy = [at(score_mean=s, vader_compound_mean=g) for s, g in [(1, 0.5), (1, 0.4), (3, 0.3)]]
    assert fired([INITIAL, *flat_proxy], guard) == []
    assert fired([INITIAL, *rising], guard, gold=None) == []  # no gold metric, no divergence


def test_relative_to_initial_and_the_strongest_action():
    assert relative_to_initial(at(length_mean=2.0, distinct_2=0.2), INITIAL) == {
        "eval/length_ratio": 0.5,
        "eval/distinct_2_ratio": 0.25,
    }
    guard = GuardConfig(
        kl_budget=GuardRule(limit=1.0, action="stop"),
        min_distinct_ratio=GuardRule(limit=0.9, action="rollback"),
        max_length_change=GuardRule(limit=0.1, action="warn"),
    )
    triggers = check([(0, INITIAL), (5, at(kl_k3_mean=2.0, distinct_2=0.1, length_mean=8.0))], guard, None)
    assert {t.rule for t in triggers} == {"kl_budget", "min_distinct_ratio", "max_length_change"}
    assert strongest(triggers).action == "rollback" and strongest([]) is None


def test_the_ledger_keeps_a_branch_picks_checkpoints_and_round_trips(tmp_path):
    guard = only(kl_budget=GuardRule(limit=3.0, action="rollback"))
    ledger = GuardLedger()
    assert ledger.judge(0, INITIAL, guard, None) == Verdict(0)
    ledger.judge(10, at(kl_k3_mean=1.0, score_mean=2.0), guard, None)
    ledger.judge(20, at(kl_k3_mean=2.0, score_mean=3.0), guard, None)
    verdict = ledger.judge(30, at(kl_k3_mean=5.0, score_mean=4.0), guard, None)
    (trigger,) = verdict.triggers
    assert (verdict.action, verdict.breach) == ("rollback", trigger)
    assert ledger.broken(30) == ["kl_budget"] and ledger.passed(20) and not ledger.passed(30)
    assert not ledger.passed(15)  # no evaluation at that step
    assert ledger.evals[20]["eval/length_ratio"] == 1.0
    assert ledger.best([10, 20, 30], "eval/score_mean") == 20  # 30 scores higher but broke a rule
    assert ledger.last_passed([0, 10, 20, 25, 30]) == 20
    assert (ledger.attempt, ledger.attempt_of(30)) == (1, 1)
    ledger.rolled_back(Rollback(1, 30, "kl_budget", 20, 2.0, ("checkpoint-30",), "attempt 1 rolled back"))
    assert sorted(ledger.evals) == [0, 10, 20] and ledger.triggers == [] and ledger.all_triggers == [trigger]
    assert ledger.rollbacks == 1 and ledger.attempt == 2
    assert [ledger.attempt_of(s) for s in (10, 20, 21, 30)] == [1, 1, 2, 2]  # the trunk is the first attempt's
    ledger.judge(30, at(kl_k3_mean=1.5, score_mean=3.5), guard, None)  # the branch after the rollback
    assert ledger.passed(30) and ledger.best([10, 20, 30], "eval/score_mean") == 30
    ledger.stopped_at = 30
    ledger.save(tmp_path / "guard.json")
    assert GuardLedger.load(tmp_path / "guard.json") == ledger
    assert GuardLedger.load(tmp_path / "missing.json") == GuardLedger()


def test_the_attempt_of_a_step_is_the_one_after_the_last_rollback_to_an_earlier_step():
    ledger = GuardLedger()
    ledger.rolled_back(Rollback(1, 80, "kl_budget", 40, 2.0))  # attempt 2 trains 41 on
    ledger.rolled_back(Rollback(2, 60, "kl_budget", 0, 4.0))  # checkpoint-40 gone: attempt 3 trains 1 on
    assert [ledger.attempt_of(s) for s in (0, 30, 40, 50, 90)] == [1, 3, 3, 3, 3]
    ledger = GuardLedger(rollbacks=1)  # saved before rollbacks were logged: the attempt under way
    assert ledger.attempt_of(10) == 2


def test_set_aside_moves_later_checkpoints_and_deletes_nothing(tmp_path):
    for step in (10, 20, 30, 40):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "weights").write_text(str(step))
    (tmp_path / "checkpoint-notes").mkdir()
    moved = set_aside(tmp_path, 20, attempt=1)
    assert [p.name for p in moved] == ["checkpoint-30", "checkpoint-40"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-10",
        "checkpoint-20",
        "checkpoint-notes",
    ]
    assert (tmp_path / "rolled_back" / "1" / "checkpoint-40" / "weights").read_text() == "40"


@pytest.mark.parametrize("action", ["warn", "stop", "rollback", "explode"])
def test_actions_are_validated(action):
    if action == "explode":
        with pytest.raises(ValueError):
            GuardRule(limit=1.0, action=action)
    else:
        assert GuardRule(limit=1.0, action=action).action == action


def test_a_breach_crosses_processes_as_the_same_decision():
    import pickle

    from rlhf_core.evaluation.guard import GuardBreach, GuardRollback, GuardStop, Trigger

    trigger = Trigger("kl_budget", "rollback", 4, 5.0, 1.0, "eval KL 5.000 nats > 1")
    for cls in (GuardStop, GuardRollback):
        copy = pickle.loads(pickle.dumps(cls(trigger)))  # what the broadcast from the evaluating process does
        assert type(copy) is cls and isinstance(copy, GuardBreach)
        assert copy.trigger == trigger and str(copy) == trigger.message


def test_the_divergence_rule_says_it_is_off_without_a_gold_metric():
    from rlhf_core.config import GuardConfig
    from rlhf_core.evaluation.guard import divergence_off

    guard = GuardConfig()
    said = divergence_off(guard, None)
    assert said == (
        "guard: the divergence rule is off for lack of a gold metric (eval.metrics is empty and "
        "guard.divergence.gold is null); name a metric function in eval.metrics to watch score against it"
    )
    assert divergence_off(guard, "vader_compound") is None  # it runs
    assert divergence_off(GuardConfig(divergence={"evals": None}), None) is None  # off on purpose: nothing to say
    # and the rule then never fires, however the proxy and a metric move
    history = [(s, {"eval/score_mean": float(s), "eval/m_mean": -float(s)}) for s in range(5)]
    from rlhf_core.evaluation.guard import check

    assert not [t for t in check(history, guard, None) if t.rule == "divergence"]
    assert [t for t in check(history, guard, "m") if t.rule == "divergence"]


def test_a_verdict_continues_on_warnings_and_ends_the_attempt_on_stop_or_rollback():
    from rlhf_core.evaluation.guard import GuardRollback, GuardStop, Trigger

    warn = Trigger("max_length_change", "warn", 8, 0.4, 0.3, "length x0.6")
    stop = Trigger("divergence", "stop", 8, 1.0, 2.0, "gold fell")
    rollback = Trigger("kl_budget", "rollback", 8, 5.0, 3.0, "eval KL 5 nats")
    assert (Verdict(8).action, Verdict(8).breach, Verdict(8).ending()) == ("continue", None, None)
    warned = Verdict(8, (warn,))
    assert (warned.action, warned.breach, warned.ending()) == ("continue", warn, None)
    stopped = Verdict(8, (warn, stop)).ending()
    assert type(stopped) is GuardStop and stopped.trigger == stop
    ended = Verdict(8, (stop, rollback, warn))
    assert ended.action == "rollback" and type(ended.ending()) is GuardRollback and ended.ending().trigger == rollback
