"""Where a user's table comes from: a local file, directory or glob, a save_to_disk directory, or a hub name.

`read_source` reads any of them as a `datasets.Dataset` (local files as json/jsonl/parquet/csv, one type
per directory or glob); what it cannot read fails with one sentence naming the source, and for JSON the
first row whose value types disagree. `files_of` finds a local source's files and `first_rows` reads a file's
first rows without `datasets` (preflight's check, the diagnosis of a JSON file arrow refused, the run's own
JSONL tables): this module is the one place that finds and reads data files.
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path
from typing import Any

from rlhf_core.config import DatasetSpec
from rlhf_core.data.rows import DataValidationError

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
ACCEPTED_ALL = "standard (strings) or conversational (lists of {role, content} messages)"
# what reading a local file can raise besides DataValidationError: missing or unreadable, not UTF-8, not
# the format its name says (pyarrow's errors are ValueErrors), a malformed csv
FILE_READ_ERRORS = (OSError, UnicodeDecodeError, ValueError, csv.Error)


def is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def looks_local(path: str) -> bool:
    """A path rather than a hub name: it exists, starts like a path, is a glob, or ends in a data extension."""
    return (
        Path(path).exists()
        or path.startswith(("/", "./", "../", "~"))
        or is_glob(path)
        or Path(path).suffix.lower() in LOCAL_FORMATS
    )


def _same_format(where: str, files: list[Path]) -> tuple[str, list[str]]:
    formats = {LOCAL_FORMATS[p.suffix.lower()] for p in files}
    if len(formats) > 1:
        raise DataValidationError(f"{where}: mixes file types {sorted(formats)}; keep one per directory or glob")
    return formats.pop(), [str(p) for p in files]


def _glob_files(pattern: str, field: str) -> tuple[str, list[str]]:
    """The data files a glob such as data/prefs/*.jsonl matches, sorted (the order is part of the fingerprint)."""
    import glob

    files = sorted(
        Path(p)
        for p in glob.glob(str(Path(pattern).expanduser()), recursive=True)
        if Path(p).is_file() and Path(p).suffix.lower() in LOCAL_FORMATS
    )
    if not files:
        raise DataValidationError(
            f"{field}.path: the glob {pattern} matches no {'/'.join(sorted(LOCAL_FORMATS))} files"
        )
    return _same_format(f"the glob {pattern}", files)


def _local_files(path: Path) -> tuple[str, list[str]]:
    if path.is_file():
        fmt = LOCAL_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DataValidationError(
                f"{path}: unsupported file type '{path.suffix}', use one of {sorted(LOCAL_FORMATS)}"
            )
        return fmt, [str(path)]
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in LOCAL_FORMATS)
    if not files:
        raise DataValidationError(f"{path}: directory holds no {'/'.join(sorted(LOCAL_FORMATS))} files")
    return _same_format(f"{path}: directory", files)


def files_of(path: str, field: str) -> tuple[str, list[str]]:
    """(file type, files) of a local file, directory or glob: one type, the files sorted by name (the order
    is part of the fingerprint). What is missing or mixed is a DataValidationError naming `field`."""
    local = Path(path).expanduser()
    if is_glob(path) and not local.exists():
        return _glob_files(path, field)
    if not local.exists():
        raise DataValidationError(f"{field}.path: {local} does not exist")
    return _local_files(local)


def first_rows(fmt: str, file: str, n: int | None) -> list[Any]:
    """The first `n` rows (every row when n is None) of a local json/jsonl/csv/parquet file, read without
    `datasets` and without loading more of the table than needed; a line that is not JSON is a
    DataValidationError naming the file and the row (counted from 1, as lines)."""
    if fmt == "csv":
        with open(file, newline="", encoding="utf-8") as fh:
            return list(itertools.islice(csv.DictReader(fh), n))
    if fmt == "parquet":
        import pyarrow.parquet as pq

        if n is None:
            return pq.read_table(file).to_pylist()
        batch = next(pq.ParquetFile(file).iter_batches(batch_size=n), None)
        return batch.to_pylist() if batch is not None else []
    with open(file, encoding="utf-8") as fh:
        return _json_rows(fh, file, n)


def _json_rows(fh, file: str, n: int | None) -> list[Any]:
    """The first `n` rows of an open JSON file: one array, one object, or JSON lines."""
    head = fh.read(1)
    while head.isspace():
        head = fh.read(1)
    fh.seek(0)
    if head == "[":  # one JSON array
        rows = json.load(fh)
        return rows[:n] if isinstance(rows, list) else [rows]
    if head == "{" and file.endswith(".json"):
        try:  # a single JSON object over several lines, or JSON lines in a .json file
            return [json.loads(fh.read())]
        except json.JSONDecodeError:
            fh.seek(0)
    rows = []
    for line_no, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise DataValidationError(f"{file} row {line_no} is not valid JSON") from None
        if len(rows) == n:
            break
    return rows


def _locate_bad_json_row(files: list[str], columns: list[str]) -> str:
    """After arrow refused a JSON file: find the first row whose value types disagree, by hand."""
    first_kind: dict[str, type] = {}
    for name in files:
        try:
            rows = first_rows("json", name, None)
        except DataValidationError as err:  # a line that is not JSON
            return str(err)
        except json.JSONDecodeError as err:  # a JSON array (or .json object) that does not parse
            return f"{name} is not valid JSON (line {err.lineno}: {err.msg})"
        for i, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                return f"{name} row {i} is a {type(row).__name__}, not an object with columns"
            for col in columns:
                if col not in row or row[col] is None:
                    continue
                kind = first_kind.setdefault(col, list if isinstance(row[col], list) else str)
                if kind is str and not isinstance(row[col], str):
                    return f"{name} row {i} column `{col}` holds a {type(row[col]).__name__}, not a string"
                if kind is list and not isinstance(row[col], list):
                    return (
                        f"{name} row {i} column `{col}` holds a {type(row[col]).__name__}, not a list of messages "
                        f"as the rows before it; accepted formats: one per file, {ACCEPTED_ALL}"
                    )
    return f"{files[0]} could not be read as JSON rows with consistent column types"


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets` save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def read_source(spec: DatasetSpec, path: str, field: str) -> tuple[Any, str, str]:
    """(dataset, source for messages, 'json'/'parquet'/'csv'/'arrow'/'hub') of a path, glob, save_to_disk
    directory or hub name."""
    import datasets

    columns = [c for c in spec.columns.model_dump().values() if c]
    if looks_local(path):
        local = Path(path).expanduser()
        if is_saved_dataset(local):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if spec.split not in ds:
                    raise DataValidationError(
                        f"{field}.split: {local} has no split '{spec.split}' (splits are {sorted(ds)})"
                    )
                ds = ds[spec.split]
            return ds, str(local), "arrow"
        fmt, files = files_of(path, field)
        try:
            ds = datasets.load_dataset(fmt, data_files=files, split="train")
        except Exception as err:  # arrow refuses mixed types or broken JSON
            if fmt == "json":
                raise DataValidationError(_locate_bad_json_row(files, columns)) from None
            raise DataValidationError(f"{path} could not be read as {fmt}: {str(err).splitlines()[0]}") from None
        return ds, str(local), fmt
    try:
        ds = datasets.load_dataset(path, split=spec.split, revision=spec.revision)
    except Exception as err:
        raise DataValidationError(
            f"{field}.path: hub dataset '{path}' (split '{spec.split}') could not be loaded: {str(err).splitlines()[0]}"
        ) from None
    return ds, f"{path}[{spec.split}]", "hub"
