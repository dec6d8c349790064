"""The served policy (tasks/loaders/policy.py) behind MLflow's own scoring server, on the four fixture
families' shapes: completions only (an empty one visible), prompts longer than the context cut from the
left and said so, bad params and inputs answered 400 with one sentence."""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import yaml
from fastapi.testclient import TestClient
from mlflow.entities import SpanType
from mlflow.pyfunc import scoring_server
from transformers import pipeline

from tasks import registry
from tasks.loaders import policy as policy_loader
from tasks.registry.logged_model import LoaderFlavor
from tests.fixtures.real_shapes import FAMILIES, build_family, family, render_prompt
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.filterwarnings("ignore")
CONTEXT = 128  # the fixture models' max_position_embeddings


def test_fit_prompt_cuts_from_the_left_and_keeps_the_start_token():
    assert policy_loader.fit_prompt([1, 2, 3], 3, keep_first=True) == ([1, 2, 3], 0)
    assert policy_loader.fit_prompt([9, 2, 3, 4, 5], 3, keep_first=True) == ([9, 4, 5], 2)
    assert policy_loader.fit_prompt([9, 2, 3, 4, 5], 3, keep_first=False) == ([3, 4, 5], 2)
    assert policy_loader.fit_prompt([9, 2, 3], 1, keep_first=True) == ([3], 2)  # no room for both


def test_generation_settings_fill_defaults_and_turn_temperature_zero_into_greedy():
    defaults = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "do_sample": True, "n": 1}
    assert policy_loader.generation_settings(None, defaults, CONTEXT) == defaults
    got = policy_loader.generation_settings({"temperature": 0.0, "max_new_tokens": 3, "n": 2}, defaults, CONTEXT)
    assert got == {"max_new_tokens": 3, "temperature": 0.0, "top_p": 0.9, "do_sample": False, "n": 2}


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
            "index": 0,
            "trace_id": "",
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
    ({"inputs": ["hi"], "params": {"n": 0}}, "params.n must be an integer from 1 to 16, got 0"),
    ({"inputs": ["hi"], "params": {"n": 17}}, "params.n must be an integer from 1 to 16, got 17"),
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


def test_n_completions_per_prompt_come_prompt_by_prompt_then_by_index(served):
    client, _ = served["gpt2"]
    prompts = ["the cat saw", "a bird"]
    status, body = post(client, {"inputs": prompts, "params": {"n": 3, "max_new_tokens": 4, "do_sample": False}})
    assert status == 200, body
    records = body["predictions"]
    assert [r["index"] for r in records] == [0, 1, 2, 0, 1, 2]
    assert [name for name, _ in policy_loader.OUTPUT_COLUMNS][-2:] == ["index", "trace_id"]
    assert all(r["trace_id"] == "" for r in records)  # not traced: no MLflow experiment in the environment
    _, once = post(client, {"inputs": prompts, "params": {"max_new_tokens": 4, "do_sample": False}})
    for single, three in zip(once["predictions"], [records[:3], records[3:]], strict=True):
        assert [r["completion"] for r in three] == [single["completion"]] * 3  # greedy: n copies of one text
        assert {r["prompt_tokens"] for r in three} == {single["prompt_tokens"]} and single["index"] == 0
    _, sampled = post(client, {"inputs": ["the cat saw"], "params": {"n": 4, "do_sample": True, "max_new_tokens": 8}})
    assert [r["index"] for r in sampled["predictions"]] == [0, 1, 2, 3]


def test_the_signature_has_n_and_the_new_columns():
    from transformers import GenerationConfig

    signature = policy_loader.generation_signature(GenerationConfig())
    assert signature.params.to_dict()[-1] == {"name": "n", "type": "long", "default": 1, "shape": None}
    assert [c["name"] for c in signature.outputs.to_dict()][-2:] == ["index", "trace_id"]


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


# tracing (tasks/loaders/policy.py's docstring): against a SQLite store, or a tracking server nobody listens on
TRACE_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID")
TRACE_ENV += ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", *policy_loader.TRACE_ENV_DEFAULTS)


@pytest.fixture(scope="module")
def gpt2_version(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("traced")
    return save(build_family("gpt2", root / "sources"), root / "version")


@pytest.fixture(autouse=True)
def untraced_environment(monkeypatch):
    """Every test starts without an experiment in the environment (`mlflow.set_experiment` elsewhere in the
    process writes MLFLOW_EXPERIMENT_ID there), so a test that does not ask for tracing gets none."""
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def tracking(monkeypatch):
    """`use(tracking_uri, registry_uri)`: MLflow pointed there as a serving process's environment points it;
    the environment, MLflow's URIs, its tracer and the loss counter on its loggers put back after."""
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    for name in TRACE_ENV:  # each put back as it was after the test, whatever the load sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    before = tracking_utils._tracking_uri, registry_utils._registry_uri

    def use(tracking_uri: str, registry_uri: str | None = None) -> None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(registry_uri or tracking_uri)

    yield use
    mlflow.flush_trace_async_logging(terminate=True)
    for name in policy_loader.EXPORT_LOGGERS:
        for found in [f for f in logging.getLogger(name).filters if isinstance(f, policy_loader.TraceLosses)]:
            logging.getLogger(name).removeFilter(found)
    mlflow.set_tracking_uri(before[0])
    registry_utils._registry_uri = before[1]


@pytest.fixture(scope="module")
def sqlite_store():
    """`store(directory)`: the URI of an empty SQLite store there (a copy of tasks/tracking/store.py's template,
    made once: MLflow's migrations take seconds)."""
    from tasks.tracking.store import empty_store_template

    template = empty_store_template()

    def store(directory: Path) -> str:
        if template:
            shutil.copyfile(template, directory / "mlflow.db")
        return f"sqlite:///{directory / 'mlflow.db'}"

    return store


def registered(version: Path, tmp_path: Path) -> Path:
    """A copy of `version` that the store's registry knows as version 2 of smoke-policy: two checkpoints of one
    run registered, the copy's MLmodel naming the run and the second's logged model."""
    experiment_id = mlflow.create_experiment("train")
    with mlflow.start_run(experiment_id=experiment_id) as run:
        pass
    for step in (1, 2):
        logged = mlflow.initialize_logged_model(f"rl-step-{step}", run.info.run_id, experiment_id=experiment_id)
        mlflow.register_model(f"models:/{logged.model_id}", "smoke-policy")
    copy = shutil.copytree(version, tmp_path / "registered")
    meta = yaml.safe_load((copy / "MLmodel").read_text())
    meta.update(run_id=run.info.run_id, model_id=logged.model_id)
    (copy / "MLmodel").write_text(yaml.safe_dump(meta))
    return copy


def test_a_traced_prompt_is_one_trace_of_the_contract(gpt2_version, sqlite_store, tmp_path, tracking, monkeypatch):
    tracking(sqlite_store(tmp_path))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "traffic")
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_TRACE_LOGGING", "false")  # stored before predict returns: no flush
    policy = policy_loader._load_pyfunc(str(registered(gpt2_version, tmp_path)))
    assert {k: os.environ[k] for k in policy_loader.TRACE_ENV_DEFAULTS} == policy_loader.TRACE_ENV_DEFAULTS
    params = {"n": 2, "max_new_tokens": 3}
    before = time.time_ns()
    answer = policy.predict(["the cat saw", "a bird"], params=params).to_dict("records")
    after = time.time_ns()
    assert [r["index"] for r in answer] == [0, 1, 0, 1]
    ids = [r["trace_id"] for r in answer]
    assert ids[0] == ids[1] != ids[2] == ids[3] and ids[0].startswith("tr-")
    experiment_id = mlflow.get_experiment_by_name("traffic").experiment_id
    for prompt, records in [("the cat saw", answer[:2]), ("a bird", answer[2:])]:
        trace = mlflow.get_trace(records[0]["trace_id"])
        assert trace.info.experiment_id == experiment_id
        assert {k: v for k, v in trace.info.tags.items() if k.startswith("rlhf.")} == {
            "rlhf.model_name": "smoke-policy",
            "rlhf.model_version": "2",
            "rlhf.kind": "policy",
        }
        (span,) = trace.data.spans
        assert span.name == "generate" and span.span_type == SpanType.LLM and span.parent_id is None
        settings = policy_loader.generation_settings(params, policy.defaults, policy.context)
        assert span.inputs == {"prompt": prompt, "params": settings} and settings["n"] == 2
        assert span.outputs == {
            "completions": [  # the stop token's text too (GPT-2's eos), which the answer leaves out
                {
                    **{k: r[k] for k in ("index", "completion", "finish_reason", "completion_tokens")},
                    "stop_token": "<|endoftext|>" if r["finish_reason"] == "stop" else "",
                }
                for r in records
            ],
            "prompt_tokens": records[0]["prompt_tokens"],
            "truncated_prompt_tokens": 0,
        }
        assert before <= span.start_time_ns < span.end_time_ns <= after  # the generation's own times
    assert len(mlflow.search_traces(locations=[experiment_id], return_type="list")) == 2


def test_without_an_experiment_nothing_is_traced(gpt2_version, sqlite_store, tmp_path, tracking):
    tracking(sqlite_store(tmp_path))
    policy = policy_loader._load_pyfunc(str(gpt2_version))
    assert policy.traces is None and "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    (record,) = policy.predict(["the cat saw"], params={"max_new_tokens": 2}).to_dict("records")
    assert record["trace_id"] == "" and record["index"] == 0


def test_a_trace_the_tracking_server_never_got_is_counted_and_said(gpt2_version, tracking, monkeypatch, caplog):
    tracking(f"http://127.0.0.1:{free_port()}")  # nobody listens there
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "1")  # no lookup: tracing on although the server is down
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the user's setting wins over the default
    mlflow_lines = ListHandler()
    logging.getLogger(policy_loader.EXPORT_LOGGERS[0]).addHandler(mlflow_lines)
    try:
        with caplog.at_level(logging.WARNING):
            policy = policy_loader._load_pyfunc(str(gpt2_version))
            assert "traces name no model version" in caplog.text  # its MLmodel names no run: no tags, said once
            started = time.monotonic()
            (record,) = policy.predict(["the cat saw"], params={"max_new_tokens": 2}).to_dict("records")
            assert time.monotonic() - started < 20  # a hang guard, not a timing claim
            assert record["trace_id"].startswith("tr-")
    finally:
        logging.getLogger(policy_loader.EXPORT_LOGGERS[0]).removeHandler(mlflow_lines)
    mlflow.flush_trace_async_logging()  # MLflow's background export of the traces so far, done
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "10"
    assert policy.traces.losses.count == 1
    said = f"served policy: trace {record['trace_id']} was not stored (tracking server unreachable); 1 trace lost"
    assert said in caplog.text
    assert not mlflow_lines.records  # MLflow's own warning (the URI in it) dropped for ours


def test_no_credential_reaches_a_trace_or_a_log_line(
    gpt2_version, sqlite_store, tmp_path, tracking, monkeypatch, caplog
):
    # the registry behind a URI with a password (down: its error names the URI), the tracking password set
    tracking(sqlite_store(tmp_path), f"http://someone:uri-secret-1@127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", mlflow.get_registry_uri())
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "someone")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "env-secret-2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the registry's refusal at once
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "traffic")
    with caplog.at_level(logging.WARNING):
        policy = policy_loader._load_pyfunc(str(registered_nowhere(gpt2_version, tmp_path)))
        (record,) = policy.predict(["the cat saw"], params={"max_new_tokens": 2}).to_dict("records")
    mlflow.flush_trace_async_logging()  # MLflow's background export of the traces so far, done
    text = mlflow.get_trace(record["trace_id"]).to_json()
    assert "the cat saw" in text and "registry could not be read" in caplog.text
    for secret in ("uri-secret-1", "env-secret-2"):
        assert secret not in text and secret not in caplog.text


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def registered_nowhere(version: Path, tmp_path: Path) -> Path:
    """A copy of `version` whose MLmodel names a run and logged model: the registry is asked for them."""
    copy = shutil.copytree(version, tmp_path / "named")
    meta = yaml.safe_load((copy / "MLmodel").read_text())
    meta.update(run_id="0" * 32, model_id="m-" + "0" * 32)
    (copy / "MLmodel").write_text(yaml.safe_dump(meta))
    return copy


@pytest.mark.parametrize("name", FAMILIES)
def test_the_stop_token_a_trace_names_is_the_text_that_encodes_back_to_that_stop_id(tmp_path, name):
    """Qwen2.5 base (pad == eos), Qwen2.5 and Llama 3 instruct (two stop ids) and GPT-2 (no pad): a completion that
    stopped names its stop token, and the feedback pair built from it (rlhf_core/data/feedback.py) ends on text the
    tokenizer reads back as that very id, as RL's sequences end."""
    import torch

    from rlhf_core.data.feedback import PREFERENCE, AnsweredPrompt, Assessment, Window, feedback_table

    policy = policy_loader._load_pyfunc(str(save(build_family(name, tmp_path / "sources"), tmp_path / "v")))
    ids, _ = policy._fit(0, "the cat saw", {**policy.defaults, "n": 1})
    word = policy.tokenizer("a", add_special_tokens=False)["input_ids"]
    for stop_id in sorted(policy.stop_ids):
        written = torch.tensor([ids + word + [stop_id]])
        policy.model.generate = lambda written=written, **_: written
        done = policy._generate(ids, {**policy.defaults, "max_new_tokens": 4})
        assert done["finish_reason"] == "stop" and done["stop_token"] == policy.tokenizer.decode([stop_id])
        chose = (Assessment("a", PREFERENCE, 0, 2),)
        answer = AnsweredPrompt("tr", "the cat saw", (done["completion"], "b"), "", 1, chose, (done["stop_token"], ""))
        (pair,) = feedback_table([answer], Window(None, 10)).pairs
        encoded = policy.tokenizer(pair["chosen"], add_special_tokens=False)["input_ids"]
        assert encoded[-1] == stop_id, (name, pair["chosen"])
