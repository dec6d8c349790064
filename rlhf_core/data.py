"""Loading and validating preference, prompt and text data through `datasets`.

Sources are local json/jsonl/parquet/csv files (or directories of them) or hub dataset names. Every
check runs before training and fails with one sentence naming the source, the row (counted from 1,
as lines in a JSONL file) and the column.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlhf_core.chat import (
    ACCEPTED,
    PROMPT_MESSAGES,
    detect_format,
    encode,
    end_at_turn_end,
    extract_prompt,
    has_chat_template,
    message_problem,
    render_completions,
    render_messages,
    render_prompt,
)
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


ACCEPTED_ALL = "standard (strings) or conversational (lists of {role, content} messages)"


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets` save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _read_source(spec: DatasetSpec, path: str, field: str) -> tuple[Any, str, str]:
    """(dataset, source for messages, 'json'/'parquet'/'csv'/'arrow'/'hub') of a path, save_to_disk directory or hub name."""
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


def layout(kind: Kind, spec: DatasetSpec, column_names: list[str]) -> dict[str, str]:
    """TRL key -> source column of the TRL type `kind` data has: preference with an explicit or implicit
    prompt, prompt-only, or SFT text, messages or prompt/completion. Falls back to `required_columns`
    (whose missing column the caller names) when no type matches."""
    cols, present = spec.columns, set(column_names)
    if kind == "preference" and cols.prompt not in present and {cols.chosen, cols.rejected} <= present:
        out = {"chosen": cols.chosen, "rejected": cols.rejected}
        return {**out, "margin": cols.margin} if cols.margin else out
    if kind == "text" and cols.text not in present:
        if cols.messages in present:
            return {"messages": cols.messages}
        if {cols.prompt, cols.completion} <= present:
            return {"prompt": cols.prompt, "completion": cols.completion}
    return required_columns(kind, spec)


def _data_format(spec: DatasetSpec, ds, mapping: dict[str, str], source: str, file_fmt: str) -> str:
    if spec.format == "conversational" and file_fmt == "csv":
        raise DataValidationError(
            f"{source}: a csv file cannot hold lists of messages; write conversational data as json, jsonl or parquet"
        )
    if spec.format != "auto":
        return spec.format
    first = ds[0]
    return detect_format({key: first.get(src) for key, src in mapping.items()})


def is_conversational_table(rows: list[Any], kind: Kind, spec: DatasetSpec) -> bool:
    """Whether a table whose first rows are `rows` will go through the chat template (format set or detected)."""
    if spec.format != "auto" or not rows or not isinstance(rows[0], dict):
        return spec.format == "conversational"
    mapping = layout(kind, spec, list(rows[0]))
    return detect_format({key: rows[0].get(src) for key, src in mapping.items()}) == "conversational"


def check_first_rows(
    rows: list[Any], kind: Kind, spec: DatasetSpec, *, source: str, field: str, file_fmt: str
) -> str | None:
    """The first problem of a file's first rows (read without `datasets`, for preflight), TRL-aware: the
    type's columns present, each value a string (standard) or a message list (conversational); None if fine."""
    if not rows:
        return f"{field}.path: {source} has no rows"
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            return f"{source} row {i} is a {type(row).__name__}, not an object with columns"
    mapping = layout(kind, spec, list(rows[0]))
    try:
        data_format = _data_format(spec, rows, mapping, source, file_fmt)
    except DataValidationError as err:
        return str(err)
    for i, row in enumerate(rows, start=1):
        missing = [(dst, src) for dst, src in mapping.items() if src not in row]
        if missing:
            dst, src = missing[0]
            return (
                f"{source} has no column `{src}` (row {i} has {sorted(row)}); map it with {field}.columns.{dst} "
                f"(accepted formats: {ACCEPTED[kind]})"
            )
        for dst, src in mapping.items():
            value = row[src]
            if value is None:
                return f"{source} row {i} column `{src}` is missing a value"
            if dst == "margin":
                if isinstance(value, bool) or (not isinstance(value, (int, float)) and file_fmt != "csv"):
                    return f"{source} row {i} column `{src}` holds {value!r}, not a number"
            elif data_format == "conversational" and (dst != "prompt" or isinstance(value, list)):
                problem = message_problem(value)
                if problem:
                    return f"{source} row {i} column `{src}` {problem} (accepted formats: {ACCEPTED[kind]})"
            elif not isinstance(value, str):
                return f"{source} row {i} column `{src}` holds a {type(value).__name__}, not a string"
    return None


ROWS_PER_READ = 1024


def iter_rows(ds) -> Iterator[dict[str, Any]]:
    """The rows of a `datasets.Dataset` as dicts, in order, as iterating it gives them, but read from Arrow
    a batch at a time (a tenth of the time of row by row) without holding the whole table as Python objects."""
    for batch in ds.iter(batch_size=ROWS_PER_READ):
        names = list(batch)
        for values in zip(*batch.values()):
            yield dict(zip(names, values))


def load_table(
    spec: DatasetSpec,
    kind: Kind,
    *,
    field: str,
    resolved_path: str | None = None,
    tokenizer=None,
    chat_template_kwargs: dict | None = None,
):
    """Read `spec` as a `datasets.Dataset` with the pipeline's column names (see `required_columns`).

    Preference and text tables keep only their pipeline columns; prompt tables keep every column.
    Every TRL type and format is accepted (see `rlhf_core.chat`): conversational rows are templated
    with `tokenizer` (required for them), implicit prompts extracted, prompt/completion joined; a
    conversational prompt table keeps its messages in `prompt_messages`.

    `field` is the config field the spec came from, for error messages; `resolved_path` replaces
    `spec.path` (used for 'demo', which the caller resolves to the demo world's file).
    """
    path = resolved_path or spec.path
    ds, source, file_fmt = _read_source(spec, path, field)
    mapping = layout(kind, spec, ds.column_names)
    missing = [src for src in mapping.values() if src not in ds.column_names]
    if missing:
        raise DataValidationError(
            f"{source} has no column `{missing[0]}` (columns are {ds.column_names}); map it with {field}.columns "
            f"(accepted formats: {ACCEPTED[kind]})"
        )
    if spec.limit is not None and len(ds) > spec.limit:
        ds = ds.select(range(spec.limit))
    data_format = _data_format(spec, ds, mapping, source, file_fmt) if len(ds) else "standard"
    if data_format == "standard" and mapping == required_columns(kind, spec):
        if kind != "prompt":  # prompt tables keep their other columns: GRPO reward functions receive them
            ds = ds.select_columns(list(mapping.values()))
        renames = {src: dst for dst, src in mapping.items() if src != dst}
        if renames:
            ds = ds.rename_columns(renames)
        validate_rows(ds, kind, source=source, source_columns=mapping)
        return ds
    if data_format == "conversational" and tokenizer is not None and not has_chat_template(tokenizer):
        raise DataValidationError(
            f"{source} is conversational (lists of messages) but the tokenizer has no chat template; "
            "set model.chat_template to a template file or string"
        )
    import datasets

    convert = _Converter(kind, mapping, data_format, source, tokenizer, chat_template_kwargs or {})
    out = datasets.Dataset.from_list([convert(i, row) for i, row in enumerate(iter_rows(ds), start=1)])
    names = {"prompt": mapping.get("prompt", mapping.get("chosen")), "text": mapping.get("messages")}
    names = {**{c: c for c in out.column_names}, **mapping, **{k: v for k, v in names.items() if v}}
    if "completion" in mapping:
        names["text"] = f"{mapping['prompt']}` + `{mapping['completion']}"
    validate_rows(out, kind, source=source, source_columns=names)
    return out


@dataclass
class _Converter:
    """One source row -> one pipeline row (prompt/chosen/rejected/margin, prompt + extras, or text)."""

    kind: Kind
    mapping: dict[str, str]
    data_format: str
    source: str
    tokenizer: Any
    kwargs: dict

    def fail(self, i: int, key: str, problem: str):
        raise DataValidationError(
            f"{self.source} row {i} column `{self.mapping.get(key, key)}` {problem} "
            f"(read as {self.data_format}; accepted formats: {ACCEPTED[self.kind]})"
        )

    def value(self, i: int, row: dict, key: str):
        value = row[self.mapping[key]]
        if self.data_format == "conversational":
            problem = message_problem(value)
            if problem:
                self.fail(i, key, problem)
        elif value is None:
            self.fail(i, key, "is missing a value")
        elif not isinstance(value, str):
            self.fail(i, key, f"holds a {type(value).__name__}, not a string")
        return value

    def __call__(self, i: int, row: dict) -> dict:
        if self.data_format == "conversational" and self.tokenizer is None:
            raise DataValidationError(f"{self.source} is conversational and needs a tokenizer with a chat template")
        try:
            return self._convert(i, row)
        except DataValidationError:
            raise
        except Exception as err:  # the template refused the row (a role it does not know, ...)
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataValidationError(f"{self.source} row {i}: the chat template failed ({first})") from None

    def _convert(self, i: int, row: dict) -> dict:
        conv, tok, kw = self.data_format == "conversational", self.tokenizer, self.kwargs
        if self.kind == "prompt":
            prompt = self.value(i, row, "prompt")
            extras = {k: v for k, v in row.items() if k != self.mapping["prompt"]}
            if not conv:
                return {"prompt": prompt, **extras}
            return {"prompt": render_prompt(tok, prompt, kw), PROMPT_MESSAGES: prompt, **extras}
        if self.kind == "preference":
            chosen, rejected = self.value(i, row, "chosen"), self.value(i, row, "rejected")
            if "prompt" in self.mapping:
                prompt = self.value(i, row, "prompt")
            else:
                prompt, chosen, rejected = extract_prompt(chosen, rejected)
                if conv and not prompt:
                    self.fail(i, "chosen", "shares no leading message with `rejected`, so there is no prompt")
            if conv:
                prompt, completions = render_completions(tok, prompt, [chosen, rejected], kw)
                chosen, rejected = (end_at_turn_end(c) for c in completions)
            out = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            if "margin" in self.mapping:
                out["margin"] = row[self.mapping["margin"]]
            return out
        if "messages" in self.mapping:
            messages = self.value(i, row, "messages")
            if not conv:
                self.fail(i, "messages", "is not a list of messages")
            return {"text": end_at_turn_end(render_messages(tok, messages, kw))}
        prompt, completion = self.value(i, row, "prompt"), self.value(i, row, "completion")
        if not conv:
            return {"text": prompt + completion}
        text, (completion,) = render_completions(tok, prompt, [completion], kw)
        return {"text": end_at_turn_end(text + completion)}


def validate_rows(ds, kind: Kind, *, source: str, source_columns: dict[str, str] | None = None) -> None:
    """Check every row: strings present and non-empty, chosen differs from rejected, margin a number."""
    names = source_columns or {c: c for c in ds.column_names}
    if len(ds) == 0:
        raise DataValidationError(f"{source} has no rows")
    text_cols = [c for c in ("prompt", "chosen", "rejected", "text") if c in ds.column_names]
    for i, row in enumerate(iter_rows(ds), start=1):
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
    return [len(ids) for ids in encode(tokenizer, texts, add_special_tokens=True)]


def apply_length_policy(
    ds, kind: Kind, tokenizer, *, max_length: int, max_prompt_length: int, action: Literal["truncate", "drop"]
):
    """Count rows over the limits; drop them or keep them for truncation at collation. -> (ds, report)

    Limits: preferences use prompt+chosen and prompt+rejected against `max_length`; prompts use
    `max_prompt_length`; text uses `max_length`.
    """
    names = [c for c in ds.column_names if c in ("prompt", "chosen", "rejected", "text")]
    cols = {c: [] for c in names}
    for batch in ds.select_columns(names).iter(batch_size=ROWS_PER_READ):
        for c in names:
            cols[c].extend(batch[c])
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
    for row in iter_rows(ds):
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def save_table(ds, path: str | Path) -> Path:
    """Write a validated table as JSONL (written to a temporary name first, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in iter_rows(ds):
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
