"""flows/promote.py: first promotion, a better candidate promoted, a worse one refused, idempotence."""

import json
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from flows.promote import rlhf_promote
from rlhf_core.config import ConfigError
from rlhf_core.data.chat import prompt_columns
from rlhf_core.demo.world import world_rows
from rlhf_core.evaluation.generations import EvalModels, EvalPrompts, EvalSampling, evaluate_generations
from rlhf_core.models.loading import generation_config_of, load_causal_lm, load_tokenizer, stop_token_ids
from rlhf_core.rollout.sampling import SamplingSettings
from tasks import registry, tracking

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
NAME = "smoke-policy"
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def perturbed(base: Path, out: Path, seed: int) -> Path:
    model, tok = load_causal_lm(str(base)), load_tokenizer(str(base))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def register_candidate(model_dir: Path, reference: Path, uri: str) -> str:
    tracking.store.configure(uri)
    experiment = tracking.store.ensure_experiment("promote-test", uri)
    with mlflow.start_run(experiment_id=experiment) as run:
        tags = {"stage": "export", "step": "2", "base_model": str(reference), "reward_model_version": "none"}
        version = registry.register_checkpoint(
            model_dir, NAME, task="text-generation", tags=tags, run_id=run.info.run_id
        )["version"]
    registry.set_alias(NAME, "candidate", version)
    return version


def write_targets(model_dir: Path, world, path: Path) -> None:
    """The greedy completions of `model_dir` on the held-out prompts become the metric's targets."""
    tok = load_tokenizer(str(model_dir))
    prompts, messages = prompt_columns(world_rows(world, "prompt", "test"))
    sampling = EvalSampling(
        SamplingSettings(response_length=6, greedy=True),
        max_prompt_length=20,
        batch_size=64,
        stop_token_ids=stop_token_ids(tok, generation_config_of(str(model_dir))),  # <|im_end|>, <|endoftext|>
    )
    rows = evaluate_generations(
        EvalModels(load_causal_lm(str(model_dir)), tok), EvalPrompts(prompts), sampling, metrics={}
    )
    path.write_text(json.dumps({m[-1]["content"]: r["completion"] for m, r in zip(messages, rows)}))


def test_promotion_first_better_worse_and_idempotent(prefect_harness, tmp_path, mlflow_uri, smoke_world, monkeypatch):
    targets = tmp_path / "targets.json"
    monkeypatch.setenv("RLHF_TEST_TARGETS", str(targets))
    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        "eval.greedy=true",
        "eval.metrics=['tests.flows.promote_metric:agreement']",
        "promote.max_kl=1000",
        "promote.min_improvement=0.5",
    ]
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)  # not the registry an earlier test configured
    base = Path(smoke_world.base_model)
    a = perturbed(base, tmp_path / "a", seed=1)
    b = perturbed(base, tmp_path / "b", seed=2)
    write_targets(a, smoke_world, targets)  # the metric prefers A's completions

    # no champion yet: A passes the absolute gates and becomes champion
    v1 = register_candidate(a, base, mlflow_uri)
    first = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert first["decision"] == "promoted" and first["changed"]
    assert first["candidate_summary"]["eval/agreement_mean"] == 1.0
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v1
    tags = client.get_model_version(NAME, v1).tags
    assert tags["promotion.decision"] == "promoted" and tags["promotion.evaluated_against"] == "none"
    assert float(tags["promotion.candidate_value"]) == 1.0 and "promotion.kl" in tags

    # running it again changes nothing
    again = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert again["decision"] == "unchanged" and not again["changed"]
    assert client.get_model_version(NAME, v1).tags == tags

    # B disagrees with the targets: refused, A stays champion
    v2 = register_candidate(b, base, mlflow_uri)
    worse = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert worse["decision"] == "refused" and "min_improvement" in worse["reason"]
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v1
    refused_tags = client.get_model_version(NAME, v2).tags
    assert refused_tags["promotion.decision"] == "refused" and refused_tags["promotion.evaluated_against"] == v1
    assert float(refused_tags["promotion.champion_value"]) == 1.0
    runs_before = len(client.search_runs([client.get_experiment_by_name("rlhf-smoke").experiment_id]))
    repeat = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert repeat["decision"] == "refused" and not repeat["changed"]
    assert client.get_model_version(NAME, v2).tags == refused_tags
    assert len(client.search_runs([client.get_experiment_by_name("rlhf-smoke").experiment_id])) == runs_before

    # the metric now prefers B's completions: a new candidate like B wins and replaces A
    write_targets(b, smoke_world, targets)
    v3 = register_candidate(b, base, mlflow_uri)
    better = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert better["decision"] == "promoted"
    assert (
        better["candidate_summary"]["eval/agreement_mean"] == 1.0
        and better["champion_summary"]["eval/agreement_mean"] < 0.5
    )
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v3
    assert client.get_model_version(NAME, v1).tags["promotion.replaced_by"] == v3


def test_promote_without_a_candidate_says_what_to_do(prefect_harness, tmp_path, mlflow_uri):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"]
    state = rlhf_promote(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="has no version with the alias 'candidate'; run the pipeline first"):
        state.result()


def test_outside_the_demo_promotion_without_a_gate_stops_before_any_work(prefect_harness, tmp_path, mlflow_uri):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", f"model.base={tmp_path}"]
    state = rlhf_promote(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(
        ConfigError, match="promote.min_value or promote.min_improvement must be set to promote on 'score'"
    ):
        state.result()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "out").exists()


def test_a_retrain_that_cannot_promote_fails_before_training(prefect_harness, tmp_path, mlflow_uri):
    from flows.retrain import rlhf_retrain

    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", f"model.base={tmp_path}"]
    state = rlhf_retrain(config_path=SMOKE, overrides=overrides, return_state=True)
    with pytest.raises(ConfigError, match="promote.min_value or promote.min_improvement must be set"):
        state.result()
    first = rlhf_retrain(config_path=SMOKE, overrides=[*overrides, "promote.min_improvement=0.1"], return_state=True)
    with pytest.raises(ConfigError, match="promote.min_value must be set to promote a first champion"):
        first.result()  # no champion in the registry yet
    assert not (tmp_path / "out").exists()
