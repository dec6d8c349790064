"""rlhf_core/storage/ownership.py: which output directories a run may write, its marker, and the orphan temporaries of a killed run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.config import load_config
from rlhf_core.storage.ownership import (
    ATOMIC_CREATOR,
    MARKER,
    OwnershipError,
    check_output_dir,
    check_pipeline_outputs,
    host_id,
    read_marker,
    remove_orphan_temps,
)
from rlhf_core.storage.saving import atomic_dir
from tests.fixtures.user_files import filled, tree_hash

SMOKE = Path(__file__).resolve().parents[3] / "configs" / "smoke.yaml"


def one_sentence(message: str) -> bool:
    return "\n" not in message and not re.search(r"[.;]\s+[A-Z]", message)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_filesystem_root_is_refused():
    with pytest.raises(OwnershipError, match=r"^run.output_dir / is the filesystem root") as err:
        check_output_dir("/", field="run.output_dir")
    assert one_sentence(str(err.value))


def test_the_home_directory_is_refused(tmp_path, monkeypatch):
    home = filled(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    for spelling in (str(home), f"{home}/sub/..", home / "sub" / ".." / "."):
        with pytest.raises(OwnershipError, match=r"^export.output_dir .* is the home directory") as err:
            check_output_dir(spelling, field="export.output_dir")
        assert one_sentence(str(err.value))


def test_the_working_directory_is_refused_even_when_empty(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(OwnershipError, match=r"^run.output_dir \. is the current working directory"):
        check_output_dir(".", field="run.output_dir")


def test_an_input_or_a_directory_holding_one_is_refused(tmp_path):
    data = filled(tmp_path / "data")
    inputs = {"data.preference.path": data / "precious.txt"}
    with pytest.raises(
        OwnershipError, match=r"^run.output_dir .*data contains data.preference.path .*precious.txt"
    ) as err:
        check_output_dir(data, field="run.output_dir", inputs=inputs)
    assert one_sentence(str(err.value))
    with pytest.raises(OwnershipError, match=r"^export.output_dir .* is run.output_dir "):
        check_output_dir(tmp_path / "out", field="export.output_dir", inputs={"run.output_dir": tmp_path / "out"})
    with pytest.raises(OwnershipError, match=r"^export.output_dir .* contains run.output_dir "):
        check_output_dir(tmp_path, field="export.output_dir", inputs={"run.output_dir": tmp_path / "out"})


def test_a_non_empty_directory_without_the_marker_is_refused_and_a_marked_or_empty_one_accepted(tmp_path):
    legacy = filled(tmp_path / "legacy")
    with pytest.raises(
        OwnershipError,
        match=rf"^run.output_dir .*legacy is a non-empty directory the pipeline did "
        rf"not create \(it has no \{MARKER} marker\)",
    ) as err:
        check_output_dir(legacy, field="run.output_dir")
    assert one_sentence(str(err.value))
    (legacy / MARKER).write_text("{}")
    assert check_output_dir(legacy, field="run.output_dir") == legacy.resolve()
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty", field="run.output_dir") == (tmp_path / "empty").resolve()
    assert check_output_dir(tmp_path / "new" / "dir", field="run.output_dir") == (tmp_path / "new" / "dir").resolve()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OwnershipError, match="is an existing file"):
        check_output_dir(tmp_path / "file", field="run.output_dir")


def test_pipeline_check_names_inputs_from_the_config_and_marks_the_run_dir(tmp_path):
    prefs = filled(tmp_path / "prefs")
    (prefs / "a.jsonl").write_text("{}\n")
    cfg = load_config(
        SMOKE,
        [f"run.output_dir={tmp_path / 'out'}", f"data.preference.path={prefs}/*.jsonl", f"export.output_dir={prefs}"],
    )
    before = tree_hash(tmp_path)
    with pytest.raises(OwnershipError, match=r"^export.output_dir .*prefs is data.preference.path .*prefs, which"):
        check_pipeline_outputs(cfg, config_path=SMOKE)
    assert tree_hash(tmp_path) == before and not (tmp_path / "out").exists()

    cfg = load_config(SMOKE, [f"run.output_dir={tmp_path / 'out'}", f"data.preference.path={prefs}/*.jsonl"])
    check_pipeline_outputs(cfg, config_path=SMOKE)
    marker = read_marker(tmp_path / "out")
    assert marker["created_by"] and marker["created_at"] and marker["pid"] == os.getpid()
    check_pipeline_outputs(cfg, config_path=SMOKE)  # the second run is ours: accepted, marker kept
    assert read_marker(tmp_path / "out") == marker


@pytest.mark.slow  # a process, killed
def test_orphan_temporaries_of_a_killed_run_are_removed_and_nothing_else(tmp_path):
    orphan = tmp_path / ".checkpoint-4-abc123"
    (orphan / "policy").mkdir(parents=True)
    (orphan / "policy" / "model.safetensors").write_bytes(b"half")
    (orphan / MARKER).write_text(
        json.dumps({"created_by": ATOMIC_CREATOR, "host": host_id(), "pid": dead_pid(), "created_at": "x"})
    )
    live = tmp_path / ".checkpoint-6-def456"  # being written by a process that is still running (this one)
    live.mkdir()
    (live / MARKER).write_text(json.dumps({"created_by": ATOMIC_CREATOR, "host": host_id(), "pid": os.getpid()}))
    foreign = filled(tmp_path / ".checkpoint-8-unmarked")  # hidden but not ours
    hidden_file = tmp_path / ".checkpoint-9-file"
    hidden_file.write_text("x")
    kept = tree_hash(foreign)

    assert remove_orphan_temps(tmp_path) == [orphan]
    assert not orphan.exists() and live.is_dir() and hidden_file.is_file() and tree_hash(foreign) == kept


@pytest.mark.slow  # a process, killed
def test_a_save_killed_between_its_two_renames_gets_the_previous_directory_back(tmp_path):
    # atomic_dir moved the previous export aside, then the run died before the new one was renamed in
    previous = tmp_path / "export"
    with atomic_dir(previous) as tmp:
        (tmp / "model.safetensors").write_bytes(b"the good weights")
    kept = tree_hash(previous)
    holder = tmp_path / ".export-old-k1ll3d"
    holder.mkdir()
    previous.rename(holder / "export")
    pid = dead_pid()
    (holder / MARKER).write_text(
        json.dumps({"created_by": ATOMIC_CREATOR, "host": host_id(), "pid": pid, "aside_of": "export"})
    )
    new = tmp_path / ".export-n3w"
    new.mkdir()
    (new / MARKER).write_text(json.dumps({"created_by": ATOMIC_CREATOR, "host": host_id(), "pid": pid}))

    assert sorted(remove_orphan_temps(tmp_path)) == sorted([holder, new])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and tree_hash(previous) == kept


def test_a_temporary_killed_before_its_marker_was_written_is_removed_but_unmarked_data_is_not(tmp_path):
    import tempfile

    bare = Path(tempfile.mkdtemp(prefix=".checkpoint-2-", dir=tmp_path))  # killed right after mkdtemp
    cut = Path(tempfile.mkdtemp(prefix=".checkpoint-3-", dir=tmp_path))
    (cut / MARKER).write_text('{"created_by": "rlhf_co')  # killed while writing the marker
    user = Path(tempfile.mkdtemp(prefix=".checkpoint-4-", dir=tmp_path))
    (user / "notes.txt").write_text("a user's file")  # same shape of name, but it holds data and no marker
    hidden = tmp_path / ".cache"
    hidden.mkdir()  # an empty hidden directory not named like a temporary
    assert sorted(remove_orphan_temps(tmp_path)) == sorted([bare, cut])
    assert user.is_dir() and (user / "notes.txt").read_text() == "a user's file" and hidden.is_dir()
