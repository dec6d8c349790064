"""Serving the registered policy: `mlflow models serve` on `models:/smoke-policy@candidate`, posts to
/invocations with and without generation params, a prompt longer than the context, bad requests, and the
exported generation_config (tests/tasks/loaders/test_policy.py has the served policy's answers in detail).

The smoke pipeline trains and registers the policy; the server runs in this environment
(`--env-manager local`) on a free loopback port and is stopped (its process group) at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from transformers import pipeline

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.models.loading import load_tokenizer
from tasks.runtime.server_processes import stop_group, wait_healthy
from tests.fixtures.servers import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SMOKE = str(REPO / "configs" / "smoke.yaml")
USER = [{"role": "user", "content": "i thought the food was"}]  # the demo's longest answers follow this start
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


def test_the_candidate_is_served_and_obeys_generation_params(prefect_harness, tmp_path, mlflow_uri):
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

    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri, "MLFLOW_REGISTRY_URI": mlflow_uri}
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
        }
        assert served_default["prompt_tokens"] == len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert served_short["completion_tokens"] <= 2
        # without params: the signature's defaults, i.e. the exported generation_config (greedy, 6 new tokens)
        assert served_short["completion_tokens"] <= served_default["completion_tokens"] <= 6
        assert invoke(base, {"inputs": [prompt]}) == default  # greedy: the same text again
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
        assert greedy == default  # temperature 0: greedy
    except BaseException:
        print(log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        stop_group(proc)
