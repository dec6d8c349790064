"""A registered reward-model version as `mlflow.pyfunc` (and so `mlflow models serve`) runs it: the scores of
records with token ids in the trainer's widths are the in-process reward model's (`sequence_scores`) bit for
bit, also through MLflow's scoring app on the four real-shape fixture families (pad == eos, two stop ids, no
pad, a BOS the tokenizer adds); texts score as the tokenizer reads them, and bad requests are refused in one
sentence (tests/tasks/stages/rl/test_served_rewards.py serves it with `mlflow models serve`)."""

import mlflow
import pytest
import torch
from mlflow.exceptions import MlflowException

from rlhf_core.config import load_config
from rlhf_core.models.forward import sequence_scores
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.storage.saving import save_hf_dir
from tasks import registry, tracking
from tasks.loaders import reward as reward_loader
from tasks.loaders.reward import layout, records_of
from tasks.registry.logged_model import LoaderFlavor, loader_module
from tests.fixtures.real_shapes import FAMILIES, build_family, family, prompts_and_answers, render_prompt

pytestmark = pytest.mark.filterwarnings("ignore")


def registered_reward_model(tmp_path, mlflow_uri, smoke_world):
    from transformers import AutoModelForSequenceClassification

    overrides = [f"tracking.uri={mlflow_uri}", "tracking.experiment=t", f"run.output_dir={tmp_path}", "run.name=unit"]
    cfg = load_config(None, overrides)
    tok = load_tokenizer(str(smoke_world.tokenizer))
    torch.manual_seed(0)
    scorer = AutoModelForSequenceClassification.from_pretrained(smoke_world.base_model, num_labels=1)
    torch.nn.init.normal_(scorer.score.weight, std=0.5)  # a head that tells sequences apart
    save_hf_dir(scorer, tok, tmp_path / "reward")
    tags = {"stage": "reward", "stage_key": "k", "step": "1"}
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "reward") as run_id:
        uri = registry.register_once(
            tmp_path / "reward", "unit-reward", task="text-classification", tags=tags, run_id=run_id
        )
    return uri, scorer.eval(), tok


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_the_served_scores_of_token_ids_are_the_in_process_reward_models(tmp_path, mlflow_uri, smoke_world):
    uri, model, tok = registered_reward_model(tmp_path, mlflow_uri, smoke_world)
    assert (
        mlflow.models.get_model_info(uri).flavors["python_function"]["loader_module"]
        == loader_module(reward_loader)
        == "served_reward"
    )
    prompts = [tok("the food was")["input_ids"], tok("i thought the movie")["input_ids"], tok("ok")["input_ids"]]
    eos = tok.eos_token_id
    completions = [
        tok(" great", add_special_tokens=False)["input_ids"] + [eos],
        [eos],
        tok(" bad bad", add_special_tokens=False)["input_ids"],
    ]
    query_ids, query_mask = left_padded(prompts, tok.pad_token_id)
    width = max(map(len, completions))
    responses = torch.tensor([c + [eos] * (width - len(c)) for c in completions])  # pad == eos after the stop
    resp_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    with torch.no_grad():
        expected = sequence_scores(model, query_ids, query_mask, responses, resp_mask, resp_mask.sum(1) - 1)
    served = mlflow.pyfunc.load_model(uri)
    records = [
        {"prompt": tok.decode(p), "completion": tok.decode(c), "prompt_ids": p, "completion_ids": c}
        for p, c in zip(prompts, completions)
    ]
    widths = {"prompt_width": query_ids.shape[1], "completion_width": responses.shape[1]}
    scores = served.predict(records, params=widths)["score"].tolist()
    assert torch.equal(torch.tensor(scores), expected)  # the trainer's layout: bit for bit
    assert len(set(round(s, 4) for s in scores)) == 3  # the head tells them apart: the test can fail
    packed = served.predict(records)["score"].tolist()  # the request's own widths: within float noise
    assert torch.allclose(torch.tensor(packed), expected, atol=1e-5)
    # texts alone: the prompt as the tokenizer reads it, then the completion without special tokens
    text = served.predict([{"prompt": "the food was", "completion": " great"}])["score"].tolist()
    ids = tok("the food was")["input_ids"] + tok(" great", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        one = sequence_scores(
            model,
            torch.tensor([ids[:-1]]),
            torch.ones(1, len(ids) - 1, dtype=torch.long),
            torch.tensor([ids[-1:]]),
            torch.ones(1, 1, dtype=torch.long),
            torch.tensor([0]),
        )
    assert text == pytest.approx(one.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    ("records", "sentence"),
    [
        ([], "non-empty list of records"),
        ([{"prompt": "a"}], "record 0 must hold a prompt and a completion string"),
        ([{"prompt": "a", "completion": "b", "prompt_ids": [1]}], "record 0 has one of prompt_ids and completion_ids"),
        (
            [{"prompt": "a", "completion": "b", "prompt_ids": ["x"], "completion_ids": [1]}],
            "token ids must be a list of integers",
        ),
    ],
)
def test_bad_requests_are_refused_in_one_sentence(records, sentence):
    with pytest.raises(MlflowException, match=sentence):
        records_of(records)


def test_the_layout_is_the_trainers_and_a_width_too_short_is_refused():
    input_ids, mask, last = layout([([5, 6], [7]), ([8], [9, 10])], prompt_width=3, completion_width=2)
    assert input_ids.tolist() == [[0, 5, 6, 7, 0], [0, 0, 8, 9, 10]]
    assert mask.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]] and last.tolist() == [3, 4]
    with pytest.raises(MlflowException, match="params.completion_width 1 is shorter than a record's 2 tokens"):
        layout([([5], [9, 10])], completion_width=1)


@pytest.mark.parametrize("name", FAMILIES)
def test_on_real_shapes_the_served_scores_of_a_rollout_are_the_in_process_ones(name, tmp_path):
    """A rollout whose completions end on the family's stop id and are padded after it (with the stop id itself
    where pad == eos or there is no pad), scored by the served source through the scoring app."""
    from fastapi.testclient import TestClient
    from mlflow.pyfunc import scoring_server
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.config import RewardSource
    from rlhf_core.rewards.remote_scorers import RemoteScorer
    from rlhf_core.rewards.sources import model_reward, remote_reward
    from tests.fixtures.small_models import rollout_of

    spec, source = family(name), build_family(name, tmp_path / "sources")
    tok = load_tokenizer(str(source))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1).eval()
    LoaderFlavor(reward_loader).save_model(
        tmp_path / "version",
        transformers_model={"model": model, "tokenizer": tok},
        task="text-classification",
        signature=reward_loader.score_signature(),
        pip_requirements=registry.model_requirements(),
    )
    client = TestClient(scoring_server.init(mlflow.pyfunc.load_model(str(tmp_path / "version"))))

    def post(url, body, headers, timeout_s):
        return client.post("/invocations", json=body).json()

    stop = tok.convert_tokens_to_ids(spec.stop_tokens[0])
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop
    pairs = prompts_and_answers()[:4]
    prompts = [tok(render_prompt(tok, spec, q))["input_ids"] for q, _ in pairs]
    answers = [tok(a, add_special_tokens=False)["input_ids"][: 2 + i] + [stop] for i, (_, a) in enumerate(pairs)]
    query_ids, query_mask = left_padded(prompts, pad)
    width = max(map(len, answers)) + 2  # padding after every stop, as the decode loop leaves it
    rollout = rollout_of(torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers]))
    rollout.query_ids, rollout.query_mask = query_ids, query_mask
    rollout.responses = torch.tensor([a + [pad] * (width - len(a)) for a in answers])
    rows = [{"prompt": tok.decode(p)} for p in prompts]
    texts = [r["prompt"] for r in rows], [tok.decode(a) for a in answers]
    config = RewardSource(name="rm", kind="reward_model", url="http://app/invocations")
    served = remote_reward("rm", 1.0, RemoteScorer(config, config.url, field="f", post=post))
    in_process = model_reward("rm", 1.0, model)
    expected = in_process.score(*texts, rollout, rows)
    # to float tolerance: each side pads its batch to its own width (in process: no column no row uses)
    assert served.score(*texts, rollout, rows) == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert len({round(v, 5) for v in expected}) == 4  # the head tells them apart: the test can fail
    if spec.prepend_bos:  # a rendered prompt that starts with the BOS gets no second one from the server
        record = {"prompt": tok.bos_token + "Tell me", "completion": " the cat"}
        prompt_ids, _ = reward_loader.ServedReward(model, tok)._encode(record)
        assert prompt_ids.count(tok.bos_token_id) == 1
