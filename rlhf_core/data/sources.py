"""Where a user's table comes from: a local file, directory or glob, a save_to_disk directory, or a hub name.

`read_source` reads any of them as a `datasets.Dataset` (local files as json/jsonl/parquet/csv, one type
per directory or glob); what it cannot read fails with one sentence naming the source, and for JSON the
first row whose value types disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_core.config import DatasetSpec
from rlhf_core.data.rows import DataValidationError

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
ACCEPTED_ALL = "standard (strings) or conversational (lists of {role, content} messages)"


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


def _locate_bad_json_row(files: list[str], columns: list[str]) -> str:
    """After arrow refused a JSON file: find the first row whose value types disagree, by hand."""
    first_kind: dict[str, type] = {}
    for name in files:
        with open(name, encoding="utf-8") as fh:
            text = fh.read()
        try:
            rows = json.loads(text)
            rows = rows if isinstance(rows, list) else [rows]
        except json.JSONDecodeError:
            rows = []
            for i, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    return f"{name} row {i} is not valid JSON"
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
        if is_glob(path) and not local.exists():
            fmt, files = _glob_files(path, field)
        elif not local.exists():
            raise DataValidationError(f"{field}.path: {local} does not exist")
        else:
            fmt, files = _local_files(local)
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
