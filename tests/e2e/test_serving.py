"""Serving the registered policy: `mlflow models serve` on `models:/smoke-policy@candidate`, posts to
/invocations with and without generation params, n completions of a prompt, a prompt longer than the context,
bad requests, the exported generation_config, and its traffic traced into a real `mlflow server` where a
feedback is logged on a trace (tests/tasks/loaders/test_policy.py has the served policy's answers in detail).

The smoke pipeline trains and registers the policy into a SQLite store, the serving process's registry; its
tracking URI is the `mlflow server` (with credentials in it, which that server ignores), its experiment
`traffic`. The servers run in this environment (`--env-manager local`) on free loopback ports and are stopped
(their process groups) at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import AssessmentSource
from mlflow.tracking import MlflowClient
from transformers import pipeline

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.models.loading import load_tokenizer
from tasks.runtime.server_processes import stop_group, wait_healthy
from tests.fixtures.servers import free_port, running_mlflow_server

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SMOKE = str(REPO / "configs" / "smoke.yaml")
USER = [{"role": "user", "content": "i thought the food was"}]  # the demo's longest answers follow this start
SECRETS = ("uri-secret-1", "env-secret-2")  # the serving process's tracking credentials: in no trace, no log line
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def invoke(base: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{base}/invocations", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def refused(base: str, body: dict) -> tuple[int, dict]:
    try:
        invoke(base, body)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    raise AssertionError(f"{body} was answered 200")


def untraced(answer: dict) -> dict:
    """An answer without its trace ids (every request is a trace of its own)."""
    return {"predictions": [{k: v for k, v in r.items() if k != "trace_id"} for r in answer["predictions"]]}


def stored_trace(tracking_uri: str, trace_id: str, timeout_s: float = 30.0):
    """The trace once MLflow's background export in the serving process has stored it (it batches for up to 5 s)."""
    client, deadline = MlflowClient(tracking_uri), time.monotonic() + timeout_s
    while True:
        try:
            return client.get_trace(trace_id)
        except mlflow.exceptions.MlflowException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture
def traffic_server(tmp_path):
    """A real `mlflow server` for the served traffic's traces, started on a thread beside the test (the pipeline
    runs meanwhile) and stopped after it: `traffic_server()` waits for it and gives its host:port."""
    with ExitStack() as stack, ThreadPoolExecutor(1) as pool:  # the pool waits for the start before the stop
        started = pool.submit(stack.enter_context, running_mlflow_server(tmp_path / "traffic"))
        yield lambda: started.result()[0]


def test_the_candidate_is_served_and_obeys_generation_params(prefect_harness, tmp_path, mlflow_uri, traffic_server):
    # SFT long enough that the smoke policy answers in words rather than in special tokens
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "sft.max_steps=150"]
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    export_dir = Path(summary.get("export_dir") or tmp_path / "out" / "export")
    generation = json.loads((export_dir / "generation_config.json").read_text())
    # the demo base sets no sampling defaults: greedy, the run's response length, never RL's sampling
    assert generation["do_sample"] is False and generation["max_new_tokens"] == 6
    assert not {"temperature", "top_k", "top_p"} & set(generation)
    tok = load_tokenizer(str(export_dir))
    # the demo policy is a chat model: a served prompt is the chat template's, as a client renders it
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert prompt == "<bos><|im_start|>user\ni thought the food was<|im_end|>\n<|im_start|>assistant\n"

    candidate = MlflowClient(mlflow_uri, mlflow_uri).get_model_version_by_alias("smoke-policy", "candidate")
    traffic_host = traffic_server()
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"http://someone:{SECRETS[0]}@{traffic_host}",
        "MLFLOW_REGISTRY_URI": mlflow_uri,
    }
    env.update({"MLFLOW_EXPERIMENT_NAME": "traffic", "MLFLOW_TRACKING_USERNAME": "someone"})
    env.pop("MLFLOW_EXPERIMENT_ID", None)  # the experiment by name alone, whatever this process was pointed at
    env["MLFLOW_TRACKING_PASSWORD"] = SECRETS[1]
    # the server starts `uvicorn` from PATH: this environment's, also when the venv is not activated
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"})
    log_path = tmp_path / "serve.log"
    args = [str(BIN / "mlflow"), "models", "serve", "-m", "models:/smoke-policy@candidate"]
    args += ["--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, f"{base}/ping", "mlflow models serve", log_path, timeout_s=120)
        # n completions of one prompt: one trace, on the tracking server, once its export lands (checked below)
        pair = invoke(base, {"inputs": [prompt], "params": {"n": 2}})["predictions"]
        assert [r["index"] for r in pair] == [0, 1] and pair[0]["trace_id"] == pair[1]["trace_id"] != ""
        default = invoke(base, {"inputs": [prompt]})
        short = invoke(base, {"inputs": [prompt], "params": {"max_new_tokens": 2, "do_sample": False}})
        print(json.dumps({"default": default, "short": short}))
        (served_default,), (served_short,) = default["predictions"], short["predictions"]
        assert set(served_default) == {
            "completion",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "truncated_prompt_tokens",
            "index",
            "trace_id",
        }
        assert served_default["prompt_tokens"] == len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert served_short["completion_tokens"] <= 2
        # without params: the signature's defaults, i.e. the exported generation_config (greedy, 6 new tokens)
        assert served_short["completion_tokens"] <= served_default["completion_tokens"] <= 6
        assert untraced(invoke(base, {"inputs": [prompt]})) == untraced(default)  # greedy: the same text again
        assert served_default["completion"].startswith(served_short["completion"])  # greedy: its first two tokens
        # the new text alone, exactly what transformers' own pipeline makes of the export directory
        local = pipeline("text-generation", model=str(export_dir))
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        anchor = local.model.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1] :]
        assert served_short["completion"] == tok.decode(anchor, skip_special_tokens=True)
        # transformers applies the template itself to messages, and the reply stops at <|im_end|>
        reply = local(USER)[0]["generated_text"][-1]
        assert reply["role"] == "assistant" and served_default["completion"].strip() == reply["content"].strip()
        assert "<|im_end|>" not in reply["content"] and " " in reply["content"]  # words with spaces between
        # a prompt 40x the context is cut from the left and the answer says so
        (long,) = invoke(base, {"inputs": [prompt * 200]})["predictions"]
        context = json.loads((export_dir / "config.json").read_text())["max_position_embeddings"]
        assert long["truncated_prompt_tokens"] > 1000 and long["prompt_tokens"] == context - 6
        # bad requests: 400 and one sentence, no stack trace
        for body, start in [
            ({"inputs": [prompt], "params": {"max_new_tokens": -1}}, "params.max_new_tokens must be"),
            ({"inputs": [prompt], "params": {"temperature": -1.0, "do_sample": True}}, "params.temperature must be"),
            ({"inputs": 5}, "inputs[0] must be a prompt string"),
        ]:
            status, answer = refused(base, body)
            assert status == 400 and answer["message"].startswith(start) and "\n" not in answer["message"]
            assert "stack_trace" not in answer
        greedy = invoke(base, {"inputs": [prompt], "params": {"temperature": 0.0, "do_sample": True}})
        assert untraced(greedy) == untraced(default)  # temperature 0: greedy
        assert pair[0]["completion"] == pair[1]["completion"] == served_default["completion"]  # greedy, twice
        # the n = 2 request's trace on the tracking server: the version's name and number, a feedback logged on it
        trace = stored_trace(f"http://{traffic_host}", pair[0]["trace_id"])
        said = [line for line in log_path.read_text(errors="replace").splitlines() if "served policy:" in line]
        assert trace.info.tags.get("rlhf.model_name") == "smoke-policy", said  # the load's warning says why not
        assert trace.info.tags["rlhf.kind"] == "policy"
        assert trace.info.tags["rlhf.model_version"] == str(candidate.version)
        (span,) = trace.data.spans
        assert span.name == "generate" and span.inputs["prompt"] == prompt and span.inputs["params"]["n"] == 2
        assert [c["completion"] for c in span.outputs["completions"]] == [r["completion"] for r in pair]
        assert not any(secret in trace.to_json() for secret in SECRETS)
        previous = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(f"http://{traffic_host}")
        try:
            source = AssessmentSource(source_type="HUMAN", source_id="e2e")
            feedback = mlflow.log_feedback(trace_id=trace.info.trace_id, name="preferred", value=True, source=source)
            assert [a.assessment_id for a in mlflow.get_trace(trace.info.trace_id).info.assessments] == [
                feedback.assessment_id
            ]
        finally:
            mlflow.set_tracking_uri(previous)
        assert not any(secret in log_path.read_text(errors="replace") for secret in SECRETS)
    except BaseException:
        print(log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        stop_group(proc)
