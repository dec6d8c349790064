"""flows/promote.py: first promotion, a better candidate promoted, a worse one refused, idempotence."""

import csv
import io
import json
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from flows.promote import rlhf_promote
from rlhf_core.config import ConfigError
from rlhf_core.config.errors import UserError
from rlhf_core.data.chat import prompt_columns
from rlhf_core.demo.world import world_rows
from rlhf_core.evaluation.generations import EvalModels, EvalPrompts, EvalSampling, evaluate_generations
from rlhf_core.models.loading import generation_config_of, load_causal_lm, load_tokenizer, stop_token_ids
from rlhf_core.rollout.sampling import SamplingSettings
from tasks import registry, tracking
from tasks.promotion.record import TABLE

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
NAME = "smoke-policy"
AGREEMENT = "tests.flows.promote_metric:agreement"
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


def settings(tmp_path: Path, mlflow_uri: str) -> list[str]:
    return [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        "eval.greedy=true",
        "promote.max_kl=1000",
    ]


def register_candidate(model_dir: Path, reference: Path, uri: str, reward_model: str | None = None) -> str:
    tracking.store.configure(uri)
    experiment = tracking.store.ensure_experiment("promote-test", uri)
    with mlflow.start_run(experiment_id=experiment) as run:
        tags = {"stage": "export", "step": "2", "base_model": str(reference)}
        if reward_model:
            tags["reward_model_version"] = reward_model
        version = registry.register_checkpoint(
            model_dir, NAME, task="text-generation", tags=tags, run_id=run.info.run_id
        )["version"]
    registry.set_alias(NAME, "candidate", version)
    return version


def promotion_run(client: MlflowClient, version: str):
    """The newest promotion run of `version` (named promote-<model>-v<version>)."""
    experiment = client.get_experiment_by_name("rlhf-smoke").experiment_id
    return client.search_runs(
        [experiment], f"tags.mlflow.runName = 'promote-{NAME}-v{version}'", order_by=["attributes.start_time DESC"]
    )[0]


def register_reward_model(model_dir: Path, uri: str) -> str:
    tracking.store.configure(uri)
    experiment = tracking.store.ensure_experiment("promote-test", uri)
    with mlflow.start_run(experiment_id=experiment) as run:
        version = registry.register_checkpoint(
            model_dir, "smoke-rm", task="text-classification", tags={"stage": "reward"}, run_id=run.info.run_id
        )["version"]
    return f"models:/smoke-rm/{version}"


def repeats_token_zero(base: Path, out: Path) -> Path:
    """The base policy with its output layer zeroed: every logit is 0, so greedy decoding repeats token 0."""
    model, tok = load_causal_lm(str(base)), load_tokenizer(str(base))
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def token_lover(base: Path, out: Path, token: int) -> Path:
    """A reward model that scores a sequence by how close its last token's embedding is to `token`'s: its layers
    add nothing (attention and MLP outputs zeroed, so the residual carries the embedding) and its score head is
    that token's embedding, so a completion ending on `token` scores highest."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.score.weight.copy_(model.model.embed_tokens.weight[token].unsqueeze(0))
    model.config.pad_token_id = load_tokenizer(str(base)).pad_token_id
    model.save_pretrained(out)
    load_tokenizer(str(base)).save_pretrained(out)
    return out


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
    overrides = [*settings(tmp_path, mlflow_uri), f"promote.evaluator.metrics=['{AGREEMENT}']"]
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)  # not the registry an earlier test configured
    base = Path(smoke_world.base_model)
    a = perturbed(base, tmp_path / "a", seed=1)
    b = perturbed(base, tmp_path / "b", seed=2)
    write_targets(a, smoke_world, targets)  # the metric prefers A's completions

    # no champion yet: A is compared with its start, passes the gates and becomes champion
    v1 = register_candidate(a, base, mlflow_uri)
    first = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert first["decision"] == "promoted" and first["changed"]
    assert first["candidate_summary"]["eval/agreement_mean"] == 1.0 and first["n"] == 8
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v1
    version = client.get_model_version(NAME, v1)
    tags = version.tags
    assert tags["promotion.decision"] == "promoted" and tags["promotion.evaluated_against"] == "none"
    assert tags["promotion.evaluator"] == f"metric {AGREEMENT}" and tags["promotion.n"] == "8"
    assert float(tags["promotion.ci_low"]) <= float(tags["promotion.win_rate"]) <= float(tags["promotion.ci_high"])
    assert "promotion.reason" not in tags and "promotion.kl" not in tags  # in the description and the run: short rows
    assert f"Promotion against its start ({base}): promoted: no champion yet; mean agreement 1.0000" in (
        version.description
    )

    # the run holds the table prompt by prompt, as CSV (MLflow's UI shows it as a table)
    run = promotion_run(client, v1)
    assert run.data.metrics["promotion/n"] == 8 and run.data.metrics["candidate/agreement_mean"] == 1.0
    assert run.data.tags["promotion.reason"].startswith("no champion yet")
    table = list(csv.DictReader(io.StringIO(Path(run.info.artifact_uri.removeprefix("file://"), TABLE).read_text())))
    assert len(table) == 8 and {"prompt", "opponent", "candidate", "verdict"} <= set(table[0])
    assert run.data.tags["mlflow.note.content"].startswith(f"# Promotion of {NAME} version {v1}")

    # running it again changes nothing
    again = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert again["decision"] == "unchanged" and not again["changed"]
    assert client.get_model_version(NAME, v1).tags == tags

    # B disagrees with the targets: it loses prompt by prompt, refused, A stays champion
    v2 = register_candidate(b, base, mlflow_uri)
    worse = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert worse["decision"] == "refused" and "not better with 95% confidence" in worse["reason"]
    assert worse["win_rate"] < 0.5
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v1
    refused_tags = client.get_model_version(NAME, v2).tags
    assert refused_tags["promotion.decision"] == "refused" and refused_tags["promotion.evaluated_against"] == v1
    runs_before = len(client.search_runs([client.get_experiment_by_name("rlhf-smoke").experiment_id]))
    repeat = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert repeat["decision"] == "refused" and not repeat["changed"]
    assert client.get_model_version(NAME, v2).tags == refused_tags
    assert len(client.search_runs([client.get_experiment_by_name("rlhf-smoke").experiment_id])) == runs_before

    # the metric now prefers B's completions: a new candidate like B wins on enough prompts and replaces A
    write_targets(b, smoke_world, targets)
    v3 = register_candidate(b, base, mlflow_uri)
    better = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert better["decision"] == "promoted" and better["ci"][0] > 0.5
    assert (
        better["candidate_summary"]["eval/agreement_mean"] == 1.0
        and better["opponent_summary"]["eval/agreement_mean"] < 0.5
    )
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v3
    assert client.get_model_version(NAME, v1).tags["promotion.replaced_by"] == v3


def test_a_candidate_that_games_its_own_reward_model_is_not_promoted(
    prefect_harness, tmp_path, mlflow_uri, smoke_world, monkeypatch
):
    """H repeats one token, which the reward model it was trained against scores highest: judged by that reward
    model (allowed explicitly) H wins every prompt; judged by an evaluator apart it loses, and stays a candidate."""
    targets = tmp_path / "targets.json"
    monkeypatch.setenv("RLHF_TEST_TARGETS", str(targets))
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    base = Path(smoke_world.base_model)
    champion = perturbed(base, tmp_path / "a", seed=1)
    write_targets(champion, smoke_world, targets)  # the evaluator apart: agreement with the champion's answers
    metric = [*settings(tmp_path, mlflow_uri), f"promote.evaluator.metrics=['{AGREEMENT}']"]
    register_candidate(champion, base, mlflow_uri)
    assert rlhf_promote(config_path=SMOKE, overrides=metric)["decision"] == "promoted"

    own = register_reward_model(token_lover(base, tmp_path / "rm", token=0), mlflow_uri)
    hacker = repeats_token_zero(base, tmp_path / "h")
    v2 = register_candidate(hacker, base, mlflow_uri, reward_model=own)
    refused = rlhf_promote(config_path=SMOKE, overrides=metric)
    assert refused["decision"] == "refused" and refused["win_rate"] == 0.0
    assert str(client.get_model_version_by_alias(NAME, "champion").version) != v2

    # its own reward model as the evaluator is refused before any generation
    runs = len(client.search_runs([client.get_experiment_by_name("rlhf-smoke").experiment_id]))
    v3 = register_candidate(hacker, base, mlflow_uri, reward_model=own)
    as_evaluator = [*settings(tmp_path, mlflow_uri), f"promote.evaluator.reward_model={own}"]
    state = rlhf_promote(config_path=SMOKE, overrides=as_evaluator, return_state=True)
    with pytest.raises(UserError, match=f"is {own}, the reward model candidate version {v3} was trained against"):
        state.result()
    assert len(client.search_runs([client.get_experiment_by_name("rlhf-smoke").experiment_id])) == runs
    assert "promotion.decision" not in client.get_model_version(NAME, v3).tags

    # allowed, its own reward model prefers it on every prompt: the gate it could game, and the report says so
    allowed = rlhf_promote(
        config_path=SMOKE, overrides=[*settings(tmp_path, mlflow_uri), "promote.allow_training_reward=true"]
    )
    assert allowed["decision"] == "promoted" and allowed["win_rate"] == 1.0
    run = promotion_run(client, v3)
    assert run.data.tags["mlflow.note.content"].startswith("**Judged by the candidate's own reward model**")


def test_promote_without_a_candidate_says_what_to_do(prefect_harness, tmp_path, mlflow_uri):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"]
    state = rlhf_promote(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="has no version with the alias 'candidate'; run the pipeline first"):
        state.result()


def test_outside_the_demo_promotion_without_an_evaluator_stops_before_any_work(prefect_harness, tmp_path, mlflow_uri):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", f"model.base={tmp_path}"]
    state = rlhf_promote(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match="promote.evaluator must name what judges promotion outside the demo"):
        state.result()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "out").exists()


def test_a_retrain_that_cannot_promote_fails_before_training(prefect_harness, tmp_path, mlflow_uri):
    from flows.retrain import rlhf_retrain

    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", f"model.base={tmp_path}"]
    state = rlhf_retrain(config_path=SMOKE, overrides=overrides, return_state=True)
    with pytest.raises(ConfigError, match="promote.evaluator must name what judges promotion"):
        state.result()
    rm = [*overrides, "promote.evaluator.reward_model=models:/judge-rm@gold"]
    first = rlhf_retrain(config_path=SMOKE, overrides=rm, return_state=True)
    with pytest.raises(ConfigError, match="promote.min_value must be set to promote a first champion"):
        first.result()  # no champion in the registry yet
    assert not (tmp_path / "out").exists()


def test_a_judge_that_is_down_ends_promotion_in_one_sentence_with_nothing_decided(
    prefect_harness, tmp_path, mlflow_uri, smoke_world
):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    base = Path(smoke_world.base_model)
    v1 = register_candidate(perturbed(base, tmp_path / "a", seed=1), base, mlflow_uri)
    judge = (
        f"promote.evaluator.judge={{url: 'http://127.0.0.1:{port}/v1', judge_model: j, max_retries: 0, "
        "template: '{prompt} A: {completion_a} B: {completion_b}', labels: {A: 1.0, B: 0.0}}"
    )
    state = rlhf_promote(config_path=SMOKE, overrides=[*settings(tmp_path, mlflow_uri), judge], return_state=True)
    with pytest.raises(UserError, match=r"^reward judge could not score completion 0 of 8 .*connection failed") as err:
        state.result()
    assert "\n" not in str(err.value)
    with pytest.raises(Exception, match="champion"):
        client.get_model_version_by_alias(NAME, "champion")
    assert not any(k.startswith("promotion.") for k in client.get_model_version(NAME, v1).tags)


def test_a_pairwise_judge_agrees_with_its_metric_and_a_position_bias_is_only_ties(
    prefect_harness, tmp_path, smoke_world
):
    """A served judge that names the more positive completion (VADER) asked in both orders decides every prompt as
    the VADER metric does prompt by prompt; one that always names the first shown makes every prompt a tie."""
    from tests.fixtures.scorers import Behaviour, scorer_in_thread

    base = Path(smoke_world.base_model)
    model = perturbed(base, tmp_path / "a", seed=1)
    template = "{prompt} A: {completion_a} B: {completion_b}"

    def promote(store: str, evaluator: str) -> dict:
        uri = f"sqlite:///{tmp_path / store}.db"
        register_candidate(model, base, uri)
        overrides = [*settings(tmp_path / store, uri), evaluator]
        return rlhf_promote(config_path=SMOKE, overrides=overrides)

    with scorer_in_thread(Behaviour(mode="pairwise")) as (url, behaviour):
        judge = f"promote.evaluator.judge={{url: '{url}/v1', judge_model: j, template: '{template}', labels: {{A: 1.0, B: 0.0, tie: 0.5}}}}"
        judged = promote("judged", judge)
        behaviour.mode = "first"
        biased = promote("biased", judge)
    metric = promote("metric", "promote.evaluator.metrics=['rlhf_core.rewards.functions:vader_compound']")
    assert judged["n"] == metric["n"] == 8 and judged["win_rate"] == metric["win_rate"]
    assert len(behaviour.seen) == 2 * 8 * 2  # two promotions, each prompt asked in both orders
    assert biased["win_rate"] == 0.5 and biased["ci"] == [0.5, 0.5] and biased["decision"] == "refused"
    assert "not better with 95% confidence" in biased["reason"]
