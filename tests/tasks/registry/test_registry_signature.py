"""A registered text-generation version carries a signature with per-request generation params and an
input example; pyfunc obeys the params (tests/tasks/loaders/test_policy.py has the served answers)."""

import json
from pathlib import Path

import mlflow
import pytest
import torch
from transformers import GenerationConfig

from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.storage.saving import save_hf_dir
from tasks import registry, tracking

pytestmark = pytest.mark.filterwarnings("ignore")


def test_a_policy_version_has_the_generation_params_and_an_input_example(cfg, smoke_world, tmp_path):
    tok = load_tokenizer(str(smoke_world.tokenizer))
    model = load_causal_lm(str(smoke_world.base_model))
    model.generation_config = GenerationConfig(
        max_new_tokens=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    save_hf_dir(model, tok, tmp_path / "policy")
    tags = {"stage": "export", "stage_key": "k", "step": "1"}
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "export") as run_id:
        uri = registry.register_once(
            tmp_path / "policy", "unit-policy", task="text-generation", tags=tags, run_id=run_id
        )
    # MLflow ran the model on the input example; the run's random state is where it was
    assert torch.equal(torch.random.get_rng_state(), before)
    info = mlflow.models.get_model_info(uri)
    params = {p.name: (p.dtype.name, p.default) for p in info.signature.params.params}
    # the defaults are the checkpoint's generation_config: greedy, its max_new_tokens
    assert params == {
        "max_new_tokens": ("long", 5),
        "temperature": ("double", 1.0),
        "top_p": ("double", 1.0),
        "do_sample": ("boolean", False),
        "n": ("long", 1),
    }
    # prompts in (checked by the served policy itself), a completion and its counts out
    assert info.signature.inputs is None
    assert [c.name for c in info.signature.outputs.inputs][:2] == ["completion", "finish_reason"]
    assert info.saved_input_example_info is not None
    local = Path(mlflow.artifacts.download_artifacts(uri))
    example = json.loads((local / "serving_input_example.json").read_text())
    assert example["params"] == {"max_new_tokens": 2}

    served = mlflow.pyfunc.load_model(uri)
    prompt = "the food was"
    short = served.predict([prompt], params={"max_new_tokens": 1}).to_dict("records")
    default = served.predict([prompt]).to_dict("records")
    assert short[0]["prompt_tokens"] == default[0]["prompt_tokens"] == len(tok(prompt)["input_ids"])
    assert short[0]["completion_tokens"] <= 1 and default[0]["completion_tokens"] <= 5
    assert default[0]["completion"].startswith(short[0]["completion"])  # the new text only, greedy
    assert default == served.predict([prompt]).to_dict("records")  # greedy by default: the same text twice


def test_a_reward_model_version_takes_layout_widths_not_generation_params(cfg, smoke_world, tmp_path):
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(str(smoke_world.tokenizer))
    scorer = AutoModelForSequenceClassification.from_pretrained(smoke_world.base_model, num_labels=1)
    save_hf_dir(scorer, tok, tmp_path / "reward")
    tags = {"stage": "reward", "stage_key": "k", "step": "1"}
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "reward") as run_id:
        uri = registry.register_once(
            tmp_path / "reward", "unit-reward", task="text-classification", tags=tags, run_id=run_id
        )
    signature = mlflow.models.get_model_info(uri).signature
    # the widths a request lays its records out in (tasks/loaders/reward.py), no generation params
    assert {p.name: p.default for p in signature.params.params} == {"prompt_width": 0, "completion_width": 0}
    assert [c.name for c in signature.outputs.inputs] == ["score"]
