"""The exported version as the registry shows it: its tags name the reward model only when one scored the policy,
and its description's first line is plain text that says, when the checkpoint broke a guard rule, that promotion
will refuse it."""

from __future__ import annotations

from dataclasses import replace

from tasks import tracking
from tasks.stages.export import promotion_blocked, version_description
from tests.tasks.stages.test_export_card import make


def test_a_policy_without_a_reward_model_has_no_reward_model_tag(tmp_path):
    _, _, plan, _ = make(tmp_path)
    assert plan.lineage == {"base_model": "models:/unit-policy-sft/3", "reward_model_version": "models:/unit-reward/2"}
    assert replace(plan, reward_path=None, reward_identity="none").lineage == {
        "base_model": "models:/unit-policy-sft/3"
    }


def test_a_candidate_that_broke_a_guard_rule_says_first_that_it_cannot_be_promoted(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking.runs, "code_version", lambda: "0.1.0")
    cfg, _, plan, trained = make(tmp_path)
    broke = replace(trained, extra={**trained.extra, "guard_broken": ["max_length_change"], "selected": "best"})
    first, *rest = version_description(cfg, plan, broke).split("\n\n")
    assert first == promotion_blocked(broke)
    assert first.startswith("Cannot be promoted: ") and "max_length_change" in first and "`" not in first
    assert rest[0] == "PPO policy of run rlhf-ppo-seed42, exported at step 9 (export.select best), 0 guard rollback(s)."
    assert "- source checkpoint: `/abs/out/rl/checkpoint-9`" in rest[-1]
    assert "- reward model: `models:/unit-reward/2`" in rest[-1] and "- code version: `0.1.0`" in rest[-1]


def test_a_candidate_that_passed_starts_with_what_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking.runs, "code_version", lambda: "0.1.0")
    cfg, _, plan, trained = make(tmp_path)
    assert promotion_blocked(trained) is None
    no_reward = replace(plan, reward_path=None, reward_identity="none")
    text = version_description(cfg, no_reward, trained)
    assert text.startswith("PPO policy of run rlhf-ppo-seed42, exported at step 9") and "- reward model: none" in text
