"""The `rlhf` command: what each command prints, and how an error ends it (a user's: one sentence, exit 2;
a bug: its traceback and a hint, exit 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import (
    COMMANDS,
    Override,
    bug_hint,
    build_parser,
    credential_free_override,
    export_credentials,
    is_user_error,
    main,
)
from flows.console import memory_table, promotion_line
from rlhf_core.config.errors import UserError
from rlhf_core.data.rows import DataValidationError
from rlhf_core.evaluation.verifiable import pass_at_k

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")


def test_validate_prints_the_resolved_config(capsys):
    assert main(["validate", "--config", SMOKE, "--set", "ppo.kl_coef=0.3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["ppo"]["kl_coef"] == 0.3 and printed["run"]["name"] == "smoke"


def test_validate_prints_the_estimated_peak_memory_per_device(capsys):
    assert main(["validate", "--config", SMOKE, "--set", "run.memory_budget_gib=8"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["run"]["memory_budget_gib"] == 8  # all of it still reads as YAML
    table = out[out.index("Peak memory per device, estimated before training") :].splitlines()
    assert table[1].split() == ["part", "GiB"]
    assert any(line.split()[:2] == ["AdamW", "state"] for line in table)
    assert table[-1] == "  within run.memory_budget_gib 8" and any("total per device" in line for line in table)


def test_the_estimate_of_a_model_not_readable_offline_says_why_and_stays_yaml():
    from rlhf_core.models.memory import MemoryEstimate

    text = memory_table(MemoryEstimate("cuda", (), ("model.base x/y is not in the local cache (why: no)",)), 10)
    assert yaml.safe_load(text) == {
        "Peak memory per device, estimated before training (no weights built)": "unknown, model.base x/y is not "
        "in the local cache (why, no)"
    }


def test_a_config_over_its_memory_budget_exits_2_with_one_sentence(capsys, tmp_path):
    assert main(arguments("validate", ["run.memory_budget_gib=0.1"], tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run.memory_budget_gib 0.1 is below the estimated peak of ") and err.count("\n") == 1
    assert "GiB per device (the " in err and err.strip().endswith("or raise the budget")


def test_bad_config_exits_2_with_one_sentence_before_any_work(capsys, tmp_path):
    code = main(["run", "--config", SMOKE, "--set", "rl.algorithm=kto", "--set", f"run.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert (
        err
        == "error: config field `rl.algorithm` got 'kto': allowed values are 'ppo', 'grpo', 'rloo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'dpo' or 'online_dpo'"
    )
    assert not (tmp_path / "out").exists()


def test_promote_outside_the_demo_without_an_evaluator_exits_2_with_one_sentence(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default tracking URI would be ./mlflow.db: nothing may create it
    (tmp_path / "base").mkdir()
    config = tmp_path / "real.yaml"
    config.write_text(yaml.safe_dump({"model": {"base": str(tmp_path / "base")}, "run": {"output_dir": "out"}}))
    assert main(["promote", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: promote.evaluator must name what judges promotion outside the demo: ")
    assert err.endswith("promote.allow_training_reward: true judges by the candidate's own reward model instead")
    assert "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "real.yaml"]


def test_every_command_the_parser_knows_has_its_function():
    usage = build_parser().format_usage()  # usage: rlhf [-h] [--debug] {run,validate,...} ...
    assert set(usage.split("{", 1)[1].split("}", 1)[0].split(",")) == set(COMMANDS)


def test_a_user_error_exits_2_with_one_sentence(capsys, monkeypatch):
    def wrong(args, overrides):
        raise DataValidationError("prompts.jsonl row 3: column `prompt`\n  is empty")

    monkeypatch.setitem(COMMANDS, "fields", wrong)
    monkeypatch.delenv("RLHF_DEBUG", raising=False)
    assert main(["fields"]) == 2
    assert capsys.readouterr().err == "error: prompts.jsonl row 3: column `prompt` is empty\n"
    assert main(["--debug", "fields"]) == 2  # the traceback too, the sentence last
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "error: prompts.jsonl row 3: column `prompt` is empty"


def test_a_bare_value_error_of_our_own_code_is_a_bug_not_the_users(capsys, monkeypatch):
    # pass_at_k's precondition: a plain ValueError raised inside rlhf_core is a bug, whatever file raised it
    monkeypatch.setitem(COMMANDS, "fields", lambda args, overrides: pass_at_k(1, 2, 1))
    with pytest.raises(ValueError, match="pass@k needs") as err:
        main(["fields"])
    assert type(err.value) is ValueError and not is_user_error(err.value)
    assert err.value.__notes__ == [bug_hint(err.value)]
    assert "error:" not in capsys.readouterr().err


def python_script(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """`script` run by this interpreter in a process of its own, this repository importable; its output captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.slow  # a Python process of its own
def test_a_bug_exits_1_with_its_traceback_and_a_hint(tmp_path):
    script = (
        "import sys, flows.cli as cli\n"
        "from rlhf_core.evaluation.verifiable import pass_at_k\n"
        "cli.COMMANDS['fields'] = lambda args, overrides: pass_at_k(1, 2, 1)\n"
        "sys.exit(cli.main(['fields']))\n"
    )
    done = python_script(script, tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("Traceback") and any("rlhf_core/evaluation/verifiable.py" in line for line in lines)
    assert lines[-2].startswith("ValueError: pass@k needs")
    assert lines[-1] == bug_hint(ValueError())


def test_every_user_caused_exception_is_a_user_error():
    from rlhf_core.config import ConfigError
    from rlhf_core.evaluation.guard import GuardStopError
    from rlhf_core.models.loading import ModelSourceError
    from rlhf_core.rewards.functions import RewardFunctionError
    from rlhf_core.storage.ownership import OwnershipError
    from rlhf_core.storage.shared import SharedStorageError
    from tasks.checks.preflight import PreflightError
    from tasks.runtime.run_lock import RunLockedError

    family = (ConfigError, DataValidationError, ModelSourceError, RewardFunctionError, OwnershipError)
    family += (RunLockedError, GuardStopError, PreflightError, SharedStorageError)
    for kind in family:
        assert issubclass(kind, UserError) and issubclass(kind, ValueError), kind
    assert not is_user_error(ValueError("a check of our own that failed")) and not is_user_error(KeyError("x"))


@pytest.fixture
def no_mlflow_credentials(monkeypatch):
    """MLflow's credential variables unset, and restored after the test whatever it set."""
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_parsing_a_credentialed_tracking_uri_leaves_the_environment_alone(no_mlflow_credentials):
    before = dict(os.environ)
    args = build_parser().parse_args(
        ["run", "--set", "tracking.uri=https://u:p@host", "--set", "tracking.uri=http://tok@host?token=s"]
    )
    assert dict(os.environ) == before
    assert args.overrides == [
        Override("tracking.uri=https://host", {"MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_PASSWORD": "p"}),
        Override("tracking.uri=null", {"MLFLOW_TRACKING_URI": "http://tok@host?token=s"}),
    ]
    # the command sets them when it runs, in command-line order
    assert export_credentials(args.overrides) == ["tracking.uri=https://host", "tracking.uri=null"]
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "u" and os.environ["MLFLOW_TRACKING_PASSWORD"] == "p"
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://tok@host?token=s"


def test_an_override_without_credentials_passes_unchanged(no_mlflow_credentials):
    assert credential_free_override("tracking.uri=http://host:5000") == Override("tracking.uri=http://host:5000", {})
    assert credential_free_override("ppo.kl_coef=0.1") == Override("ppo.kl_coef=0.1", {})


def test_the_promotion_verdict_is_one_line():
    result = {"model": "rlhf-policy", "candidate": "3", "champion": "2", "decision": "promoted", "changed": True}
    assert promotion_line({**result, "reason": "score 0.5 > 0.4"}) == (
        "rlhf-policy version 3 vs champion 2: promoted; score 0.5 > 0.4"
    )
    assert promotion_line({**result, "changed": False, "reason": "r"}).endswith("promoted (nothing changed); r")


def three_mistakes(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """A config typo, an empty answer in row 8 of a preference file, and a PPO batch larger than the prompt set:
    each as `--set` arguments and the sentence it is refused with."""
    rows = [{"prompt": f"p{i}", "chosen": "" if i == 8 else f"good {i}", "rejected": f"bad {i}"} for i in range(1, 11)]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "typo": (["rl.batchsize=4"], "error: unknown config field `rl.batchsize` (did you mean `rl.batch_size`?)"),
        "empty answer": ([f"data.preference.path={prefs}"], f"error: {prefs} row 8 column `chosen` is empty"),
        "batch": (
            ["rl.batch_size=64"],
            "error: data.prompts: the demo world (data.demo.num_train_prompts) has 32 usable prompts, fewer than "
            "the 64 one RL step takes (rl.batch_size); lower rl.batch_size or add prompts",
        ),
    }


def arguments(command: str, sets: list[str], out: Path) -> list[str]:
    return [command, "--config", SMOKE, "--set", f"run.output_dir={out}", *(a for s in sets for a in ("--set", s))]


@pytest.mark.parametrize("mistake", ["typo", "empty answer", "batch"])
def test_validate_refuses_the_three_mistakes_in_one_sentence_with_nothing_written(capsys, tmp_path, mistake):
    sets, sentence = three_mistakes(tmp_path)[mistake]
    assert main(arguments("validate", sets, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.startswith(sentence) and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefs.jsonl"]


@pytest.mark.slow  # a process of its own: the imports it counts are the command's, not the test session's
def test_run_refuses_the_three_mistakes_as_validate_does_before_importing_the_pipeline(tmp_path):
    """`rlhf run` checks the config and every data row before it imports Prefect, MLflow, torch or the pipeline
    (so before any server starts): the same sentences as `rlhf validate`, exit 2, nothing written."""
    mistakes = three_mistakes(tmp_path)
    calls = {name: arguments("run", sets, tmp_path / "out") for name, (sets, _) in mistakes.items()}
    script = (
        "import contextlib, io, json, sys\n"
        "from flows.cli import main\n"
        "done = {}\n"
        f"for name, argv in {calls!r}.items():\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        done[name] = (main(argv), err.getvalue())\n"
        "heavy = ('prefect', 'mlflow', 'torch', 'transformers', 'flows.rlhf_pipeline', 'matplotlib')\n"
        "print(json.dumps({'done': done, 'imported': [m for m in heavy if m in sys.modules]}))\n"
    )
    ran = python_script(script, tmp_path)
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["imported"] == []
    for name, (_, sentence) in mistakes.items():
        code, err = report["done"][name]
        assert code == 2 and err.startswith(sentence) and err.count("\n") == 1, (name, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefs.jsonl"]
