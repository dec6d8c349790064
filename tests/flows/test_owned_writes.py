"""The pipeline refuses, before any work, to write into directories it must not replace or delete."""

import re
from pathlib import Path

import pytest

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.storage.ownership import MARKER, OwnershipError, read_marker
from tests.fixtures.user_files import filled, tree_hash

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def refused(overrides: list[str], field: str, what: str) -> str:
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(OwnershipError) as err:
        state.result()
    message = str(err.value)
    assert message.startswith(f"{field} ") and what in message, message
    assert "\n" not in message and not re.search(r"[.;]\s+[A-Z]", message)  # one sentence
    return message


@pytest.mark.parametrize("field", ["run.output_dir", "export.output_dir"])
def test_the_home_directory_is_refused_and_left_alone(prefect_harness, tmp_path, mlflow_uri, monkeypatch, field):
    home = filled(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    before = tree_hash(tmp_path)
    out = (
        [f"run.output_dir={home}"]
        if field == "run.output_dir"
        else [f"run.output_dir={tmp_path / 'out'}", f"export.output_dir={home}/sub/.."]
    )
    refused([*out, f"tracking.uri={mlflow_uri}"], field, "is the home directory")
    assert tree_hash(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["run.output_dir", "export.output_dir"])
def test_the_working_directory_is_refused_and_left_alone(prefect_harness, tmp_path, mlflow_uri, monkeypatch, field):
    work = filled(tmp_path / "work")
    (work / MARKER).write_text("{}")  # even a directory that looks like ours: never the working directory
    monkeypatch.chdir(work)
    before = tree_hash(tmp_path)
    out = (
        ["run.output_dir=."]
        if field == "run.output_dir"
        else [f"run.output_dir={tmp_path / 'out'}", "export.output_dir=."]
    )
    refused([*out, f"tracking.uri={mlflow_uri}"], field, "is the current working directory")
    assert tree_hash(tmp_path) == before and not (tmp_path / "out").exists()


def test_an_export_into_an_ancestor_of_the_run_directory_is_refused(prefect_harness, tmp_path, mlflow_uri):
    filled(tmp_path / "runs")
    before = tree_hash(tmp_path)
    refused(
        [
            f"run.output_dir={tmp_path / 'runs' / 'out'}",
            f"export.output_dir={tmp_path / 'runs'}",
            f"tracking.uri={mlflow_uri}",
        ],
        "export.output_dir",
        "contains run.output_dir",
    )
    assert tree_hash(tmp_path) == before and not (tmp_path / "runs" / "out").exists()


@pytest.mark.parametrize("field", ["run.output_dir", "export.output_dir"])
def test_an_ancestor_of_an_input_is_refused(prefect_harness, tmp_path, mlflow_uri, smoke_world, field):
    inputs = filled(tmp_path / "inputs")
    (inputs / "prefs").mkdir()
    (inputs / "prefs" / "train.jsonl").write_bytes(smoke_world.preferences("train").read_bytes())
    (inputs / MARKER).write_text("{}")  # marked or not, a directory holding an input is never an output
    before = tree_hash(tmp_path)
    out = [f"{field}={inputs}"] + ([f"run.output_dir={tmp_path / 'out'}"] if field == "export.output_dir" else [])
    refused(
        [*out, f"data.preference.path={inputs / 'prefs' / 'train.jsonl'}", f"tracking.uri={mlflow_uri}"],
        field,
        "contains data.preference.path",
    )
    assert tree_hash(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["run.output_dir", "export.output_dir"])
def test_a_non_empty_directory_the_pipeline_did_not_create_is_refused(prefect_harness, tmp_path, mlflow_uri, field):
    legacy = filled(tmp_path / "legacy")
    (legacy / "checkpoint-2").mkdir()
    (legacy / "checkpoint-2" / "model.safetensors").write_bytes(b"weights of an old run")
    before = tree_hash(tmp_path)
    out = [f"{field}={legacy}"] + ([f"run.output_dir={tmp_path / 'out'}"] if field == "export.output_dir" else [])
    message = refused(
        [*out, f"tracking.uri={mlflow_uri}"], field, "is a non-empty directory the pipeline did not create"
    )
    assert "choose an empty or new directory" in message
    assert tree_hash(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_new_run_directory_is_marked_and_accepted_again(prefect_harness, tmp_path, mlflow_uri, monkeypatch):
    # the first stage fails at once; the run directory was created and marked before it
    import flows.rlhf_pipeline

    def data_stage_down(*args, **kwargs):
        raise RuntimeError("injected: data stage down")

    monkeypatch.setattr(flows.rlhf_pipeline, "data_stage", data_stage_down)
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"]
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_failed() and "injected: data stage down" in state.message
    assert read_marker(tmp_path / "out")["created_by"]
    # files of the earlier attempt are there; a second attempt on the same directory is accepted
    (tmp_path / "out" / "data").mkdir()
    (tmp_path / "out" / "data" / "prompts.jsonl").write_text("{}\n")
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_failed() and "injected: data stage down" in state.message, state.message


def test_validate_refuses_an_unowned_output_directory_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from flows.cli import main

    target = tmp_path / "mine"
    target.mkdir()
    (target / "thesis.txt").write_text("years of work")
    before = sorted(p.name for p in target.iterdir())
    code = main(["validate", "-c", str(SMOKE), "--set", f"run.output_dir={target}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: run.output_dir") and "\n" not in err and "Traceback" not in err
    assert sorted(p.name for p in target.iterdir()) == before  # no marker written by validate
