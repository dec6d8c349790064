"""The served policy (tasks/loaders/policy.py) behind MLflow's own scoring server, on the four fixture
families' shapes: completions only (an empty one visible), prompts longer than the context cut from the
left and said so, bad params and inputs answered 400 with one sentence."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from fastapi.testclient import TestClient
from mlflow.pyfunc import scoring_server
from transformers import pipeline

from tasks import registry
from tasks.loaders import policy as policy_loader
from tasks.registry.logged_model import LoaderFlavor
from tests.fixtures.real_shapes import FAMILIES, build_family, family, render_prompt

pytestmark = pytest.mark.filterwarnings("ignore")
CONTEXT = 128  # the fixture models' max_position_embeddings


def test_fit_prompt_cuts_from_the_left_and_keeps_the_start_token():
    assert policy_loader.fit_prompt([1, 2, 3], 3, keep_first=True) == ([1, 2, 3], 0)
    assert policy_loader.fit_prompt([9, 2, 3, 4, 5], 3, keep_first=True) == ([9, 4, 5], 2)
    assert policy_loader.fit_prompt([9, 2, 3, 4, 5], 3, keep_first=False) == ([3, 4, 5], 2)
    assert policy_loader.fit_prompt([9, 2, 3], 1, keep_first=True) == ([3], 2)  # no room for both


def test_generation_settings_fill_defaults_and_turn_temperature_zero_into_greedy():
    defaults = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "do_sample": True}
    assert policy_loader.generation_settings(None, defaults, CONTEXT) == defaults
    got = policy_loader.generation_settings({"temperature": 0.0, "max_new_tokens": 3}, defaults, CONTEXT)
    assert got == {"max_new_tokens": 3, "temperature": 0.0, "top_p": 0.9, "do_sample": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Each family's tiny model saved as a policy version is saved, loaded by mlflow.pyfunc, behind the
    scoring server's app: {family: (TestClient, model directory)}."""
    root = tmp_path_factory.mktemp("served")
    out = {}
    for name in FAMILIES:
        source = build_family(name, root / "sources")
        out[name] = (TestClient(scoring_server.init(mlflow.pyfunc.load_model(str(save(source, root / name))))), source)
    return out


def save(source: Path, destination: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    LoaderFlavor(policy_loader).save_model(
        destination,
        transformers_model={"model": model, "tokenizer": AutoTokenizer.from_pretrained(source)},
        task="text-generation",
        signature=policy_loader.generation_signature(model.generation_config),
        pip_requirements=registry.model_requirements(),
    )
    return destination


def post(client, body) -> tuple[int, dict]:
    response = client.post("/invocations", json=body)
    return response.status_code, response.json()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_completion_is_the_new_text_alone_as_transformers_generates_it(served, name):
    client, source = served[name]
    status, body = post(
        client, {"inputs": ["the cat saw", "a bird"], "params": {"max_new_tokens": 6, "do_sample": False}}
    )
    assert status == 200, body
    local = pipeline("text-generation", model=str(source))
    for prompt, record in zip(["the cat saw", "a bird"], body["predictions"], strict=True):
        anchor = local(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
        assert record["completion"] == anchor
        assert record["truncated_prompt_tokens"] == 0 and record["completion_tokens"] <= 6
        assert record["finish_reason"] == ("length" if record["completion_tokens"] == 6 else "stop")


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "llama-3-instruct"])
def test_a_rendered_chat_prompt_is_read_as_the_template_tokenizes_it(served, name):
    client, source = served[name]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    messages = [{"role": "user", "content": "what does the cat see"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    status, body = post(client, {"inputs": [rendered], "params": {"max_new_tokens": 2}})
    assert status == 200, body
    # Llama 3's template writes <|begin_of_text|> and its tokenizer would add another: the server adds none
    assert body["predictions"][0]["prompt_tokens"] == len(ids)
    if name == "llama-3-instruct":
        assert render_prompt(tok, family(name), "x") != rendered  # the data sets' form has no bos; this one does


@pytest.mark.parametrize("name", FAMILIES)
def test_a_prompt_longer_than_the_context_is_cut_from_the_left_and_says_so(served, name):
    client, source = served[name]
    long_prompt = "the cat saw a bird and " * 200
    status, body = post(client, {"inputs": [long_prompt], "params": {"max_new_tokens": 8}})
    assert status == 200, body
    (record,) = body["predictions"]
    assert record["prompt_tokens"] == CONTEXT - 8
    assert record["truncated_prompt_tokens"] > 1000
    assert isinstance(record["completion"], str)


def test_an_empty_completion_is_empty_and_stopped(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = build_family("qwen2.5-instruct", tmp_path / "sources")
    model, tok = AutoModelForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    first = model.generate(**tok(["the cat saw"], return_tensors="pt"), max_new_tokens=1, do_sample=False)[0, -1]
    # a stop id the model emits at once: an instruct model's second stop id does this for real
    model.generation_config.eos_token_id = [*model.generation_config.eos_token_id, int(first)]
    model.save_pretrained(source)
    client = TestClient(scoring_server.init(mlflow.pyfunc.load_model(str(save(source, tmp_path / "v")))))
    status, body = post(client, {"inputs": ["the cat saw"], "params": {"do_sample": False}})
    assert status == 200, body
    prompt_tokens = len(tok("the cat saw")["input_ids"])
    assert body["predictions"] == [
        {
            "completion": "",
            "finish_reason": "stop",
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "truncated_prompt_tokens": 0,
        }
    ]


BAD_REQUESTS = [
    (
        {"inputs": ["hi"], "params": {"max_new_tokens": -1}},
        f"params.max_new_tokens must be an integer from 1 to {CONTEXT - 1}, got -1",
    ),
    (
        {"inputs": ["hi"], "params": {"max_new_tokens": CONTEXT}},
        f"params.max_new_tokens must be an integer from 1 to {CONTEXT - 1}, got {CONTEXT}",
    ),
    (
        {"inputs": ["hi"], "params": {"temperature": -0.5, "do_sample": True}},
        "params.temperature must be a number of at least 0 (0: greedy), got -0.5",
    ),
    ({"inputs": ["hi"], "params": {"top_p": 1.5}}, "params.top_p must be a number above 0 and at most 1, got 1.5"),
    ({"inputs": 5}, "inputs[0] must be a prompt string, got int 5"),
    ({"inputs": [0.5, 2.0]}, "inputs[0] must be a prompt string, got float 0.5"),
    ({"inputs": []}, "inputs must hold at least one prompt string"),
    ({"inputs": ["the cat", ""]}, "inputs[1] is empty and this tokenizer adds no start token to generate from"),
    ({"inputs": {"a": ["x"]}}, "inputs must be a prompt string or a list of them, got dict"),
]


@pytest.mark.parametrize(("body", "sentence"), BAD_REQUESTS, ids=[s.split(" must")[0] for _, s in BAD_REQUESTS])
def test_a_bad_request_is_a_400_of_one_sentence(served, body, sentence):
    client, _ = served["gpt2"]
    status, answer = post(client, body)
    assert status == 400
    assert answer["message"] == sentence  # not prefixed with the request, no stack trace
    assert "stack_trace" not in answer and answer["error_code"] == "INVALID_PARAMETER_VALUE"


def test_temperature_zero_with_sampling_is_greedy(served):
    client, _ = served["qwen2.5-instruct"]  # its generation_config samples at 0.7
    greedy = post(client, {"inputs": ["the cat saw"], "params": {"do_sample": False, "max_new_tokens": 6}})
    zero = post(
        client, {"inputs": ["the cat saw"], "params": {"do_sample": True, "temperature": 0, "max_new_tokens": 6}}
    )
    assert greedy == zero and greedy[0] == 200


@pytest.mark.slow  # a Python process of its own
def test_the_version_holds_its_loader_which_imports_nothing_of_this_repository(tmp_path):
    source = build_family("gpt2", tmp_path / "sources")
    version = save(source, tmp_path / "v")
    mlmodel = (version / "MLmodel").read_text()
    assert "loader_module: served_policy" in mlmodel and "transformers:" in mlmodel
    code = version / "code" / "served_policy.py"
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(ast.parse(code.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not imported & {"tasks", "rlhf_core", "flows", "tests"}
    # loaded and run by a Python that cannot import this repository's packages, from another directory
    moved = shutil.copytree(version, tmp_path / "elsewhere" / "v")
    script = (
        "import sys, json; sys.modules.update(dict.fromkeys(['tasks', 'rlhf_core', 'flows', 'tests'])); "
        "import mlflow; m = mlflow.pyfunc.load_model('v'); "
        "print(json.dumps(m.predict(['the cat'], params={'max_new_tokens': 2}).to_dict('records')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=moved.parent, capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(record) == {name for name, _ in policy_loader.OUTPUT_COLUMNS}
    # and MLflow's transformers flavor still loads it as model and tokenizer
    components = mlflow.transformers.load_model(str(version), return_type="components")
    assert {"model", "tokenizer"} <= set(components)
