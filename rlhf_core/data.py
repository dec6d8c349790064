"""Loading and validating preference, prompt and text data through `datasets`.

Sources are local json/jsonl/parquet/csv files (or directories of them) or hub dataset names. Every
check runs before training and fails with one sentence naming the source, the row (counted from 1,
as lines in a JSONL file) and the column.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlhf_core.config import DatasetSpec

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
Kind = Literal["preference", "prompt", "text"]


class DataValidationError(ValueError):
    """Data a user supplied that cannot be trained on; the message is one sentence."""


def required_columns(kind: Kind, spec: DatasetSpec) -> dict[str, str]:
    """Pipeline column -> source column that `kind` data must have."""
    cols = spec.columns
    if kind == "preference":
        out = {"prompt": cols.prompt, "chosen": cols.chosen, "rejected": cols.rejected}
        if cols.margin:
            out["margin"] = cols.margin
        return out
    if kind == "prompt":
        return {"prompt": cols.prompt}
    return {"text": cols.text}


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
                if col in row and row[col] is not None and not isinstance(row[col], str):
                    return f"{name} row {i} column `{col}` holds a {type(row[col]).__name__}, not a string"
    return f"{files[0]} could not be read as JSON rows with consistent column types"


def load_table(spec: DatasetSpec, kind: Kind, *, field: str, resolved_path: str | None = None):
    """Read `spec` as a `datasets.Dataset` with the pipeline's column names (see `required_columns`).

    Preference and text tables keep only their mapped columns; prompt tables keep every column.

    `field` is the config field the spec came from, for error messages; `resolved_path` replaces
    `spec.path` (used for 'demo', which the caller resolves to the demo world's file).
    """
    import datasets

    path = resolved_path or spec.path
    mapping = required_columns(kind, spec)
    if looks_local(path):
        local = Path(path).expanduser()
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
                raise DataValidationError(_locate_bad_json_row(files, list(mapping.values()))) from None
            raise DataValidationError(f"{path} could not be read as {fmt}: {str(err).splitlines()[0]}") from None
        source = str(local)
    else:
        try:
            ds = datasets.load_dataset(path, split=spec.split)
        except Exception as err:
            raise DataValidationError(
                f"{field}.path: hub dataset '{path}' (split '{spec.split}') could not be loaded: {str(err).splitlines()[0]}"
            ) from None
        source = f"{path}[{spec.split}]"

    missing = [src for src in mapping.values() if src not in ds.column_names]
    if missing:
        raise DataValidationError(
            f"{source} has no column `{missing[0]}` (columns are {ds.column_names}); map it with {field}.columns"
        )
    if kind != "prompt":  # prompt tables keep their other columns: GRPO reward functions receive them
        ds = ds.select_columns(list(mapping.values()))
    renames = {src: dst for dst, src in mapping.items() if src != dst}
    if renames:
        ds = ds.rename_columns(renames)
    if spec.limit is not None and len(ds) > spec.limit:
        ds = ds.select(range(spec.limit))
    validate_rows(ds, kind, source=source, source_columns=mapping)
    return ds


def validate_rows(ds, kind: Kind, *, source: str, source_columns: dict[str, str] | None = None) -> None:
    """Check every row: strings present and non-empty, chosen differs from rejected, margin a number."""
    names = source_columns or {c: c for c in ds.column_names}
    if len(ds) == 0:
        raise DataValidationError(f"{source} has no rows")
    text_cols = [c for c in ("prompt", "chosen", "rejected", "text") if c in ds.column_names]
    for i, row in enumerate(ds, start=1):
        for col in text_cols:
            value = row[col]
            if value is None:
                raise DataValidationError(f"{source} row {i} column `{names[col]}` is missing a value")
            if not isinstance(value, str):
                raise DataValidationError(
                    f"{source} row {i} column `{names[col]}` holds a {type(value).__name__}, not a string"
                )
            if not value.strip() and not (col == "prompt" and kind == "preference"):
                raise DataValidationError(f"{source} row {i} column `{names[col]}` is empty")
        if kind == "preference":
            if row["chosen"].strip() == row["rejected"].strip():
                raise DataValidationError(
                    f"{source} row {i}: `{names['chosen']}` is identical to `{names['rejected']}`"
                )
            margin = row.get("margin", 0.0)
            if isinstance(margin, bool) or not isinstance(margin, (int, float)):
                raise DataValidationError(
                    f"{source} row {i} column `{names['margin']}` holds {row['margin']!r}, not a number"
                )


@dataclass
class LengthReport:
    """What the length policy did to a table."""

    rows: int
    overlong: int
    action: Literal["truncate", "drop"]

    @property
    def kept(self) -> int:
        return self.rows - self.overlong if self.action == "drop" else self.rows

    def sentence(self, source: str) -> str:
        verb = "dropped" if self.action == "drop" else "will be truncated"
        return f"{source}: {self.overlong} of {self.rows} rows exceed the length limit and {verb}"


def _token_lengths(tokenizer, texts: list[str]) -> list[int]:
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]


def apply_length_policy(
    ds, kind: Kind, tokenizer, *, max_length: int, max_prompt_length: int, action: Literal["truncate", "drop"]
):
    """Count rows over the limits; drop them or keep them for truncation at collation. -> (ds, report)

    Limits: preferences use prompt+chosen and prompt+rejected against `max_length`; prompts use
    `max_prompt_length`; text uses `max_length`.
    """
    cols = {c: list(ds[c]) for c in ds.column_names if c in ("prompt", "chosen", "rejected", "text")}
    if kind == "preference":
        chosen = _token_lengths(tokenizer, [p + c for p, c in zip(cols["prompt"], cols["chosen"])])
        rejected = _token_lengths(tokenizer, [p + r for p, r in zip(cols["prompt"], cols["rejected"])])
        over = [max(a, b) > max_length for a, b in zip(chosen, rejected)]
    elif kind == "prompt":
        over = [n > max_prompt_length for n in _token_lengths(tokenizer, cols["prompt"])]
    else:
        over = [n > max_length for n in _token_lengths(tokenizer, cols["text"])]
    report = LengthReport(rows=len(ds), overlong=sum(over), action=action)
    if action == "drop" and report.overlong:
        ds = ds.select([i for i, o in enumerate(over) if not o])
    return ds, report


def fingerprint_rows(ds) -> str:
    """sha256 of the rows as canonical JSON: the same data gives the same fingerprint anywhere."""
    digest = hashlib.sha256()
    for row in ds:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def save_table(ds, path: str | Path) -> Path:
    """Write a validated table as JSONL (written to a temporary name first, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in ds:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file written by `save_table`."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_column(path: str | Path, column: str) -> list[Any]:
    """One column of a JSONL file written by `save_table`."""
    return [row[column] for row in read_rows(path)]
