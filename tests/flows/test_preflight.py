"""`rlhf validate` (and the first step of `rlhf run`) check everything that can be checked without
training, and a user's error is one sentence on stderr with exit code 2, no traceback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

import flows.cli
from flows.cli import is_user_error, main
from rlhf_core.config import load_config
from rlhf_core.data.rows import DataValidationError
from tasks.checks.preflight import preflight_problems
from tests.fixtures.servers import free_port
from tests.fixtures.tables import write_jsonl

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")

FUNCTIONS = """
def no_kwargs(prompts=None, completions=None):
    return [0.0] * len(completions)

def positional(texts):
    return [0.0] * len(texts)

def fine(prompts=None, completions=None, **kwargs):
    return [1.0] * len(completions)
"""


@pytest.fixture
def funcs(tmp_path, monkeypatch):
    """A module `preflight_funcs` on sys.path with reward functions of several signatures."""
    (tmp_path / "preflight_funcs.py").write_text(FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "preflight_funcs"


def cli(command: str, tmp_path: Path, capsys, *sets: str) -> tuple[int, str]:
    base = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    argv = [command, "--config", SMOKE]
    for text in (*base, *sets):
        argv += ["--set", text]
    code = main(argv)
    return code, capsys.readouterr().err.strip()


def assert_one_sentence(code: int, err: str, expected: str, tmp_path: Path) -> None:
    assert code == 2, err
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()  # before any work


def test_a_valid_config_passes(tmp_path, capsys):
    code, err = cli("validate", tmp_path, capsys)
    assert code == 0 and err == ""
    assert preflight_problems(load_config(SMOKE)) == []


@pytest.mark.parametrize(
    "sets, expected",
    [
        (
            ["rl.algorithm=grpo", "grpo.rewards=[{name: bad, function: 'no_such_module:score'}]"],
            "grpo.rewards[0].function: could not import module 'no_such_module'",
        ),
        (
            ["rl.algorithm=grpo", "grpo.rewards=[{name: r, function: 'preflight_funcs:no_kwargs'}]"],
            "grpo.rewards[0].function: 'preflight_funcs:no_kwargs' cannot be called as fn(prompts=..., completions=..., "
            "**kwargs) (it takes no **kwargs",
        ),
        (["rl.algorithm=grpo", "grpo.rewards=[{name: r, function: 'preflight_funcs:positional'}]"], "cannot be called"),
        (
            ["eval.metrics=['rlhf_core.rewards.functions:no_such_metric']"],
            "eval.metrics: module 'rlhf_core.rewards.functions' has no function 'no_such_metric'",
        ),
        (
            ["eval.metrics=['preflight_funcs:positional']"],
            "eval.metrics: 'preflight_funcs:positional' cannot be called as fn(prompts=..., completions=...)",
        ),
    ],
)
def test_reward_and_metric_functions_are_imported_and_their_signature_checked(funcs, tmp_path, capsys, sets, expected):
    code, err = cli("validate", tmp_path, capsys, *sets)
    assert_one_sentence(code, err, expected, tmp_path)


def test_a_function_with_the_right_signature_passes(funcs, tmp_path, capsys):
    code, err = cli(
        "validate",
        tmp_path,
        capsys,
        "rl.algorithm=grpo",
        "eval.metrics=['preflight_funcs:no_kwargs']",
        "grpo.rewards=[{name: r, function: 'preflight_funcs:fine'}]",
    )
    assert code == 0, err


@pytest.mark.parametrize(
    "rows, field, expected",
    [
        (None, "data.prompts", "data.prompts.path: {dir}/prompts.jsonl does not exist"),
        (
            [{"question": "hi"}],
            "data.prompts",
            "prompts.jsonl has no column `prompt` (row 1 has ['question']); map it with data.prompts.columns.prompt",
        ),
        (["{not json"], "data.prompts", "prompts.jsonl row 1 is not valid JSON"),
        ([{"prompt": 3}], "data.eval_prompts", "prompts.jsonl row 1 column `prompt` holds a int, not a string"),
        ([{"prompt": None}], "data.prompts", "prompts.jsonl row 1 column `prompt` is missing a value"),
        ([{"prompt": "p", "chosen": "a"}], "data.preference", "has no column `rejected`"),
        ([{"text": "t"}], "sft.dataset", None),
        ([{"prompt": "p", "chosen": "", "rejected": "b"}], "data.preference", "row 1 column `chosen` is empty"),
        (
            [{"prompt": "p", "chosen": [{"role": "assistant", "content": ""}], "rejected": "b"}],
            "data.preference",
            "row 1 column `chosen` ends with an empty `assistant` message",
        ),
    ],
)
def test_data_paths_exist_and_their_first_rows_parse(tmp_path, capsys, rows, field, expected):
    path = tmp_path / "prompts.jsonl"
    if rows is not None:
        write_jsonl(path, rows)
    code, err = cli("validate", tmp_path, capsys, f"{field}.path={path}")
    if expected is None:
        assert code == 0, err
    else:
        assert_one_sentence(code, err, expected.format(dir=tmp_path), tmp_path)


def test_a_glob_matching_nothing_and_a_renamed_column(tmp_path, capsys):
    code, err = cli("validate", tmp_path, capsys, f"data.prompts.path={tmp_path}/prefs/*.jsonl")
    assert_one_sentence(code, err, f"data.prompts.path: the glob {tmp_path}/prefs/*.jsonl matches no", tmp_path)
    write_jsonl(tmp_path / "q.jsonl", [{"question": f"hi {i}"} for i in range(8)])  # one PPO step's prompts
    code, err = cli(
        "validate",
        tmp_path,
        capsys,
        f"data.prompts.path={tmp_path / 'q.jsonl'}",
        "data.prompts.columns.prompt=question",
    )
    assert code == 0, err


def test_a_directory_that_cannot_be_listed_or_a_file_that_cannot_be_read_is_one_sentence(tmp_path, capsys, monkeypatch):
    (tmp_path / "prompts").mkdir()

    def refuse(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "iterdir", refuse)
    code, err = cli("validate", tmp_path, capsys, f"data.prompts.path={tmp_path / 'prompts'}")
    assert_one_sentence(code, err, f"data.prompts.path: {tmp_path / 'prompts'} could not be read (", tmp_path)
    monkeypatch.undo()
    (tmp_path / "p.parquet").write_text("not parquet")
    code, err = cli("validate", tmp_path, capsys, f"data.prompts.path={tmp_path / 'p.parquet'}")
    assert_one_sentence(
        code, err, f"data.prompts.path: {tmp_path / 'p.parquet'} could not be read as parquet (", tmp_path
    )


@pytest.mark.parametrize(
    "sets, expected",
    [
        (
            ["model.base=./no/such/model", "sft.enabled=false", "init.policy=base"],
            "model.base: directory ./no/such/model does not exist",
        ),
        (
            ["model.base=not a hub name!", "sft.enabled=false", "init.policy=base"],
            "model.base: 'not a hub name!' is neither an existing local directory nor a hub model name",
        ),
        (["model.tokenizer=/no/such/tokenizer"], "model.tokenizer: directory /no/such/tokenizer does not exist"),
        (["reward.base=/no/such/reward"], "reward.base: directory /no/such/reward does not exist"),
        (["reward.base=models:/x"], "reward.base: 'models:/x' must look like models:/<name>/<version>"),
        (
            ["rl.algorithm=grpo", "grpo.rewards=[{name: rm, model: /no/rm}]"],
            "grpo.rewards[0].model: directory /no/rm does not exist",
        ),
    ],
)
def test_model_and_tokenizer_sources(tmp_path, capsys, sets, expected):
    code, err = cli("validate", tmp_path, capsys, *sets)
    assert_one_sentence(code, err, expected, tmp_path)


def test_a_truncated_weights_file_is_named_before_any_work(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    (model / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")  # a header cut short
    code, err = cli("validate", tmp_path, capsys, f"model.base={model}", "sft.enabled=false", "init.policy=base")
    assert_one_sentence(
        code, err, f"model.base: {model}/model.safetensors is not a complete safetensors file (", tmp_path
    )


@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_output_directory_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, where):
    if where == "file":  # a parent that is a file
        (tmp_path / "notes.txt").write_text("mine")
        out, expected = tmp_path / "notes.txt" / "run", f"run.output_dir: {tmp_path}/notes.txt is a file"
    else:  # a read-only file system (/proc takes no new file, even from root)
        out, expected = Path("/proc/rlhf-out"), "run.output_dir: /proc/rlhf-out cannot be written here (/proc: "
    code, err = cli("validate", tmp_path, capsys, f"run.output_dir={out}")
    assert code == 2 and err.count("\n") == 0 and expected in err, err
    assert list(tmp_path.iterdir()) == ([tmp_path / "notes.txt"] if where == "file" else [])
    assert (where != "file") or (tmp_path / "notes.txt").read_text() == "mine"


def test_prompt_and_response_must_fit_the_demo_context(tmp_path, capsys):
    code, err = cli("validate", tmp_path, capsys, "rl.response_length=60")
    assert_one_sentence(
        code,
        err,
        "data.max_prompt_length 20 + rl.response_length 60 = 80 tokens exceeds the policy's "
        "context of 64 (model.demo.max_position_embeddings)",
        tmp_path,
    )


def test_prompt_and_response_must_fit_a_local_models_context(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 20}))
    code, err = cli("validate", tmp_path, capsys, f"model.base={model}", "sft.enabled=false", "init.policy=base")
    assert_one_sentence(
        code,
        err,
        f"= 26 tokens exceeds the policy's context of 20 (max_position_embeddings in {model}/config.json)",
        tmp_path,
    )


def test_a_length_limit_above_a_local_models_context_is_refused(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 48}))
    code, err = cli("validate", tmp_path, capsys, f"model.base={model}", "data.max_length=60")
    assert_one_sentence(
        code,
        err,
        f"data.max_length 60 exceeds the policy's context of 48 (max_position_embeddings in {model}/config.json)",
        tmp_path,
    )


def test_conversational_data_without_a_chat_template_is_refused(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 128}))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    prompts = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}]}])
    sets = (f"model.base={model}", "sft.enabled=false", "init.policy=base", f"data.prompts.path={prompts}")
    code, err = cli("validate", tmp_path, capsys, *sets)
    assert_one_sentence(
        code,
        err,
        "data.prompts is conversational (lists of messages) but the tokenizer of model.base (model) has no chat "
        "template; set model.chat_template",
        tmp_path,
    )
    cfg = load_config(SMOKE, [*sets, 'model.chat_template="{{ messages[0].content }}"'])
    assert not [p for p in preflight_problems(cfg) if "chat template" in p]
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert not [p for p in preflight_problems(load_config(SMOKE, list(sets))) if "chat template" in p]


def test_an_unreachable_tracking_server_is_refused(tmp_path, capsys):
    port = free_port()
    code, err = cli("validate", tmp_path, capsys, f"tracking.uri=http://user:hunter2@127.0.0.1:{port}")
    assert_one_sentence(code, err, "tracking.uri: the tracking server http://", tmp_path)
    assert f"127.0.0.1:{port} does not answer (GET /health, 10 s timeout: " in err
    assert "hunter2" not in err


def test_a_tracking_server_that_answers_passes(tmp_path, capsys):
    seen = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code, err = cli("validate", tmp_path, capsys, f"tracking.uri=http://127.0.0.1:{server.server_port}/")
    finally:
        server.shutdown()
    assert code == 0, err
    assert seen == ["/health"]


def test_a_sqlite_store_in_a_missing_directory_is_refused(tmp_path, capsys):
    code, err = cli("validate", tmp_path, capsys, f"tracking.uri=sqlite:///{tmp_path}/no/dir/mlflow.db")
    assert_one_sentence(code, err, f"tracking.uri: the directory {tmp_path}/no/dir of the SQLite store", tmp_path)


@pytest.mark.parametrize(
    "sets, expected",
    [
        (["registry.policy_model_name=team/policy"], "registry.policy_model_name 'team/policy' contains '/'"),
        (["registry.reward_model_name='rm:1'"], "registry.reward_model_name 'rm:1' contains ':'"),
        (["registry.reward_model_name=' '"], "registry.reward_model_name is empty"),
        (["registry.reward_model_name="], "config field `registry.reward_model_name` got ''"),
        (["registry.reward_model_name=same", "registry.policy_model_name=same"], "are both 'same'"),
    ],
)
def test_registry_names(tmp_path, capsys, sets, expected):
    code, err = cli("validate", tmp_path, capsys, *sets)
    assert_one_sentence(code, err, expected, tmp_path)


def test_several_problems_are_counted_in_the_one_sentence(tmp_path, capsys):
    code, err = cli("validate", tmp_path, capsys, "registry.policy_model_name=a/b", "rl.response_length=60")
    assert_one_sentence(code, err, "(and 1 more problem; `rlhf validate` checks them all)", tmp_path)


def test_a_bool_for_an_integer_is_one_sentence(tmp_path, capsys):
    code, err = cli("validate", tmp_path, capsys, "rl.total_steps=true")
    assert_one_sentence(
        code, err, "error: config field `rl.total_steps` must be an integer, but got true (a boolean)", tmp_path
    )


def test_run_checks_before_any_work(tmp_path, capsys, monkeypatch):
    import flows.rlhf_pipeline

    monkeypatch.setattr(flows.rlhf_pipeline, "rlhf_pipeline", lambda **kw: pytest.fail("the flow must not start"))
    code, err = cli("run", tmp_path, capsys, f"data.prompts.path={tmp_path / 'missing.jsonl'}")
    assert_one_sentence(code, err, "data.prompts.path:", tmp_path)


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLHF_DEBUG", "1")
    code, err = cli("validate", tmp_path, capsys, "registry.policy_model_name=a/b")
    assert code == 2 and "Traceback" in err and "tasks.checks.preflight.PreflightError" in err
    assert err.splitlines()[-1].startswith("error: registry.policy_model_name 'a/b'")
    monkeypatch.delenv("RLHF_DEBUG")
    assert main(["--debug", "validate", "--config", SMOKE, "--set", "rl.total_steps=1.5"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err
    assert (
        err.strip().splitlines()[-1] == "error: config field `rl.total_steps` must be an integer, but got 1.5 (a float)"
    )


def test_a_user_error_inside_the_flow_exits_2_and_a_bug_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    import flows.rlhf_pipeline

    def bad_data(**kwargs):
        raise DataValidationError("prefs.jsonl row 1: `chosen` is identical to `rejected`")

    monkeypatch.setattr(flows.rlhf_pipeline, "rlhf_pipeline", bad_data)
    code, err = cli("run", tmp_path, capsys)
    assert code == 2 and err == "error: prefs.jsonl row 1: `chosen` is identical to `rejected`"

    def bug(**kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(flows.rlhf_pipeline, "rlhf_pipeline", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        cli("run", tmp_path, capsys)


def test_check_preflight_raises_what_the_stage_would_have_raised(tmp_path):
    from rlhf_core.models.loading import ModelSourceError
    from rlhf_core.rewards.functions import RewardFunctionError
    from tasks.checks.preflight import PreflightError, check_preflight

    cases = [
        (["eval.metrics=['no_such_module:f']"], RewardFunctionError),
        ([f"data.prompts.path={tmp_path / 'x.jsonl'}"], DataValidationError),
        (["model.tokenizer=/no/such/dir"], ModelSourceError),
        (["rl.response_length=60"], PreflightError),
    ]
    for overrides, kind in cases:
        with pytest.raises(kind) as err:
            check_preflight(load_config(SMOKE, overrides))
        assert type(err.value) is kind


def test_only_user_errors_count_as_user_errors():
    from rlhf_core.rewards.functions import vader_compound

    with pytest.raises(ValueError) as ours:
        vader_compound(prompts=["p"])
    assert not is_user_error(ours.value)  # a bare ValueError of our own code is a bug: exit 1, not 2
    with pytest.raises(ValueError) as theirs:
        int("not a number")
    assert not is_user_error(theirs.value)
    assert not is_user_error(KeyError("x"))
    from rlhf_core.evaluation.guard import GuardStopError

    assert is_user_error(GuardStopError("the guard stopped ppo at step 20 before any checkpoint was saved"))
    assert flows.cli.one_sentence(ValueError("two\nlines")) == "two lines"


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            ("rollout.vllm.python=/nonexistent/vllm-venv/bin/python",),
            "rollout.vllm.python /nonexistent/vllm-venv/bin/python does not exist: build the vLLM environment with "
            "`make vllm-venv` (or name a running server with rollout.vllm.url)",
        ),
        (
            (),  # the smoke model's heads are 32 / 2 = 16 wide
            "rollout engine vllm: the demo model (model.demo) has attention heads of size 16, which vLLM's CPU "
            "attention does not support",
        ),
    ],
)
def test_a_vllm_engine_that_cannot_start_is_refused_before_any_work(tmp_path, capsys, sets, expected):
    code, err = cli("validate", tmp_path, capsys, "rollout.engine=vllm", *sets)
    assert_one_sentence(code, err, expected, tmp_path)


def test_a_vllm_engine_on_a_port_in_use_is_refused_and_a_running_server_is_not_checked(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        wide = ("model.demo.hidden_size=64", "rollout.engine=vllm")
        code, err = cli("validate", tmp_path, capsys, *wide, f"rollout.vllm.port={port}")
        assert_one_sentence(code, err, f"rollout.vllm.port {port} on 127.0.0.1 is in use", tmp_path)
        assert cli("validate", tmp_path, capsys, *wide, "rollout.vllm.url=http://127.0.0.1:1")[0] == 0


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            ("grpo.tools=['preflight_funcs:nope']",),
            "grpo.tools[0]: module 'preflight_funcs' has no function 'nope'",
        ),
        (
            ("grpo.environment=preflight_funcs:fine",),
            "grpo.environment: 'preflight_funcs:fine' has no reset method; an environment must define reset(**row)",
        ),
        (
            ("grpo.tools=['preflight_funcs:fine']", "data.demo.world=arithmetic"),
            "data.prompts holds plain-text prompts, and grpo.tools needs conversational ones (lists of messages) for "
            "the chat template to write the tool turns after",
        ),
        (
            ("grpo.tools=['preflight_funcs:fine']", "rl.algorithm=ppo"),
            "grpo.tools and grpo.environment give the group algorithms' rollouts tools; rl.algorithm 'ppo' samples "
            "without them: use one of grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline",
        ),
    ],
)
def test_tools_that_cannot_run_are_refused_before_any_work(funcs, tmp_path, capsys, sets, expected):
    code, err = cli("validate", tmp_path, capsys, "rl.algorithm=grpo", *sets)
    assert_one_sentence(code, err, expected, tmp_path)
