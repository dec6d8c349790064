"""rlhf_core/data/sources.py: local files, directories, globs, save_to_disk directories and hub names are read, or
refused in one sentence."""

import json

import pandas as pd
import pytest

from rlhf_core.config import DatasetSpec
from rlhf_core.data.rows import DataValidationError
from rlhf_core.data.tables import load_table
from tests.fixtures.tables import GOOD, load, write_jsonl


def test_loads_jsonl_parquet_csv_and_directories(tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", GOOD)
    pd.DataFrame(GOOD).to_parquet(tmp_path / "p.parquet")
    pd.DataFrame(GOOD).to_csv(tmp_path / "p.csv", index=False)
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "a.jsonl", GOOD[:2])
    write_jsonl(tmp_path / "dir" / "b.jsonl", GOOD[2:])
    for source in (jsonl, tmp_path / "p.parquet", tmp_path / "p.csv", tmp_path / "dir"):
        ds = load(source)
        assert ds.column_names == ["prompt", "chosen", "rejected"]
        assert ds[0] == GOOD[0]
        assert len(ds) == 3


def test_a_glob_reads_every_matching_file_in_name_order(tmp_path):
    (tmp_path / "drops").mkdir()
    write_jsonl(tmp_path / "drops" / "2026-11-02.jsonl", GOOD[2:])
    write_jsonl(tmp_path / "drops" / "2026-11-01.jsonl", GOOD[:2])
    (tmp_path / "drops" / "notes.txt").write_text("not data")
    ds = load(f"{tmp_path}/drops/*.jsonl")
    assert [r["prompt"] for r in ds] == [r["prompt"] for r in GOOD]
    with pytest.raises(DataValidationError, match=r"data.preference.path: the glob .*/none-\*.jsonl matches no"):
        load(f"{tmp_path}/drops/none-*.jsonl")
    pd.DataFrame(GOOD).to_csv(tmp_path / "drops" / "2026-11-03.csv", index=False)
    with pytest.raises(DataValidationError, match="mixes file types"):
        load(f"{tmp_path}/drops/2026-*")


def test_missing_files_and_formats(tmp_path):
    with pytest.raises(DataValidationError, match=r"data.preference.path: .*nope.jsonl does not exist"):
        load(tmp_path / "nope.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataValidationError, match="unsupported file type '.txt'"):
        load(tmp_path / "x.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataValidationError, match="directory holds no"):
        load(tmp_path / "empty")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataValidationError):
        load(tmp_path / "e.jsonl")


def test_broken_json_line_is_located(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n{not json\n")
    with pytest.raises(DataValidationError, match="row 2 is not valid JSON"):
        load(path)


def test_hub_dataset_names_go_to_the_hub_and_fail_in_one_sentence_offline():
    with pytest.raises(DataValidationError) as err:
        load_table(
            DatasetSpec(path="no-such-org/no-such-dataset", split="train"), "preference", field="data.preference"
        )
    message = str(err.value)
    assert message.startswith(
        "data.preference.path: hub dataset 'no-such-org/no-such-dataset' (split 'train') could not be loaded"
    )
    assert "\n" not in message


def test_a_save_to_disk_dataset_dict_reads_its_split(tmp_path):
    import datasets

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GOOD), "test": datasets.Dataset.from_list(GOOD[:1])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(load(tmp_path / "dd", split="test")) == 1
    with pytest.raises(DataValidationError, match=r"data.preference.split: .* has no split 'dev'"):
        load(tmp_path / "dd", split="dev")


def test_hub_names_pass_split_and_revision(monkeypatch):
    import datasets

    seen = {}

    def fake_load_dataset(path, **kwargs):
        seen.update(path=path, **kwargs)
        return datasets.Dataset.from_list(GOOD)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_table(
        DatasetSpec(path="org/prefs", split="train_prefs", revision="abc123"), "preference", field="data.preference"
    )
    assert seen == {"path": "org/prefs", "split": "train_prefs", "revision": "abc123"} and len(ds) == 3


def test_files_of_finds_a_file_a_directory_or_a_glob_in_name_order(tmp_path):
    from rlhf_core.data.sources import files_of

    (tmp_path / "drops").mkdir()
    b = write_jsonl(tmp_path / "drops" / "b.jsonl", GOOD[2:])
    a = write_jsonl(tmp_path / "drops" / "a.jsonl", GOOD[:2])
    assert files_of(str(a), "data.preference") == ("json", [str(a)])
    assert files_of(str(tmp_path / "drops"), "data.preference") == ("json", [str(a), str(b)])
    assert files_of(f"{tmp_path}/drops/*.jsonl", "data.preference") == ("json", [str(a), str(b)])
    with pytest.raises(DataValidationError, match=r"^data.prompts.path: .*nope.jsonl does not exist$"):
        files_of(str(tmp_path / "nope.jsonl"), "data.prompts")


def test_first_rows_reads_the_first_n_rows_of_every_file_type(tmp_path):
    from rlhf_core.data.sources import first_rows

    jsonl = write_jsonl(tmp_path / "p.jsonl", GOOD)
    (tmp_path / "array.json").write_text(json.dumps(GOOD, indent=2))
    (tmp_path / "object.json").write_text(json.dumps(GOOD[0], indent=2))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n\n" for r in GOOD))
    pd.DataFrame(GOOD).to_parquet(tmp_path / "p.parquet")
    pd.DataFrame(GOOD).to_csv(tmp_path / "p.csv", index=False)
    for fmt, name in [("json", jsonl), ("json", tmp_path / "array.json"), ("json", tmp_path / "lines.json")]:
        assert first_rows(fmt, str(name), 2) == GOOD[:2]
        assert first_rows(fmt, str(name), None) == GOOD
    assert first_rows("json", str(tmp_path / "object.json"), 2) == [GOOD[0]]
    for fmt in ("parquet", "csv"):
        assert first_rows(fmt, str(tmp_path / f"p.{fmt}"), 2) == GOOD[:2]
        assert first_rows(fmt, str(tmp_path / f"p.{fmt}"), None) == GOOD
    (tmp_path / "broken.jsonl").write_text(json.dumps(GOOD[0]) + "\n\n{not json\n")
    assert first_rows("json", str(tmp_path / "broken.jsonl"), 1) == [GOOD[0]]  # stops before the broken line
    with pytest.raises(DataValidationError, match=r"broken.jsonl row 3 is not valid JSON$"):
        first_rows("json", str(tmp_path / "broken.jsonl"), 5)


def test_a_json_array_arrow_refuses_is_named_in_one_sentence(tmp_path):
    (tmp_path / "bad.json").write_text('[\n{"prompt": "p", "chosen": "a", "rejected": "b"},\n{oops}\n]\n')
    with pytest.raises(DataValidationError, match=r"bad.json is not valid JSON \(line 3: "):
        load(tmp_path / "bad.json")
