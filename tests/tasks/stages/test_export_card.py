"""tasks/export.export_info: the card names the root base by hub id, local name or "demo", and the data by name."""

from __future__ import annotations

import pytest

from rlhf_core.config import load_config
from rlhf_core.models.card import write_model_card
from tasks.stage_io import Checkpoint
from tasks.stages.data import PreparedData
from tasks.stages.export import base_license, export_info, root_base_name
from tasks.stages.initialization import InitPlan


def make(tmp_path, *overrides, base_model="/abs/demo_world/base_model"):
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'out'}", *overrides])
    data = PreparedData(tables={}, fingerprints={}, base_model=str(base_model), tokenizer=str(base_model))
    plan = InitPlan(
        policy_path="/abs/sft",
        policy_identity="models:/unit-policy-sft/3",
        value_path=None,
        reward_path="/abs/reward",
        reward_identity="models:/unit-reward/2",
        reference="copy",
    )
    trained = Checkpoint(
        path="/abs/out/rl/checkpoint-9", model_uri=None, step=9, metrics={}, extra={"final_eval": {"eval/kl_mean": 1.5}}
    )
    return cfg, data, plan, trained


def test_the_demo_run_card_names_demo_and_keeps_lineage_out_of_base_model(tmp_path):
    info = export_info(*make(tmp_path))
    assert info.base_model == "demo" and info.datasets == ["demo"] and info.eval_dataset == "demo"
    assert info.policy_start == "models:/unit-policy-sft/3" and info.source_checkpoint == "/abs/out/rl/checkpoint-9"
    assert info.reward_model == "models:/unit-reward/2" and info.license is None


def test_a_local_base_is_named_by_its_directory_and_lends_its_license(tmp_path):
    base = tmp_path / "models" / "tiny-base"
    base.mkdir(parents=True)
    write_model_card(base, title="tiny", metadata={"license": "mit"}, body="b")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    cfg, data, plan, trained = make(
        tmp_path,
        f"model.base={base}",
        f"data.prompts.path={prompts}",
        "data.preference.path=org/prefs",
        base_model=base,
    )
    info = export_info(cfg, data, plan, trained)
    assert info.base_model == "tiny-base" and info.license == "mit"
    assert info.datasets == ["org/prefs", "prompts.jsonl"]
    # export.license wins over the base card's
    cfg2 = load_config(None, [f"run.output_dir={tmp_path / 'out'}", f"model.base={base}", "export.license=apache-2.0"])
    assert export_info(cfg2, data, plan, trained).license == "apache-2.0"


@pytest.mark.parametrize(
    ("base", "card", "expected"),
    [
        ("Qwen/Qwen2.5-0.5B", None, "Qwen/Qwen2.5-0.5B"),
        ("models:/unit-policy/4", {"base_model": "org/root"}, "org/root"),
        ("models:/unit-policy/4", {"base_model": "models:/other/1"}, "unit-policy"),
        ("models:/unit-policy@champion", None, "unit-policy"),
    ],
)
def test_the_root_base_is_a_hub_id_never_a_uri(tmp_path, base, card, expected):
    copy = tmp_path / "copy"
    copy.mkdir()
    if card:
        write_model_card(copy, title="registered", metadata=card, body="b")
    cfg, data, _, _ = make(tmp_path, f"model.base={base}", base_model=copy)
    assert root_base_name(cfg, data) == expected


def test_a_hub_base_missing_from_the_cache_has_no_license(tmp_path):
    cfg, data, _, _ = make(tmp_path, "model.base=no-such-org/no-such-model", base_model="no-such-org/no-such-model")
    assert base_license(cfg, data) is None
