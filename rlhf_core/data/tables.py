"""Loading and validating preference, prompt and text data through `datasets`, and the tables a run keeps.

`load_table` reads a source (`rlhf_core.data.sources`: local json/jsonl/parquet/csv files or directories
of them, save_to_disk directories, hub dataset names), maps and converts its rows to the pipeline's columns
and checks every one (`rlhf_core.data.rows`), before training, failing with one sentence naming the source,
the row (counted from 1, as lines in a JSONL file) and the column. Then the length policy, the content
fingerprint, and the JSONL files the data stage writes and the later stages read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from rlhf_core.config import DatasetSpec
from rlhf_core.data.chat import ACCEPTED, encode, has_chat_template
from rlhf_core.data.lengths import TableLengths, measure
from rlhf_core.data.rows import (
    ROWS_PER_READ,
    DataValidationError,
    Kind,
    RowConverter,
    iter_rows,
    layout,
    required_columns,
    table_format,
    validate_rows,
)
from rlhf_core.data.sources import first_rows, read_source


def read_table(spec: DatasetSpec, kind: Kind, *, field: str, resolved_path: str | None = None):
    """`spec` read as a `datasets.Dataset` in its source's columns, before any row is converted or checked.
    -> (ds, source for messages, pipeline column -> source column, 'standard' or 'conversational')

    A missing column is refused here; `spec.limit` applies. `field` and `resolved_path` as in `load_table`.
    """
    path = resolved_path or spec.path
    ds, source, file_fmt = read_source(spec, path, field)
    mapping = layout(kind, spec, ds.column_names)
    missing = [src for src in mapping.values() if src not in ds.column_names]
    if missing:
        raise DataValidationError(
            f"{source} has no column `{missing[0]}` (columns are {ds.column_names}); map it with {field}.columns "
            f"(accepted formats: {ACCEPTED[kind]})"
        )
    if spec.limit is not None and len(ds) > spec.limit:
        ds = ds.select(range(spec.limit))
    data_format = table_format(spec, ds, mapping, source, file_fmt) if len(ds) else "standard"
    return ds, source, mapping, data_format


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
    Every TRL type and format is accepted (see `rlhf_core.data.chat` and `rlhf_core.data.rows`): conversational
    rows are templated with `tokenizer` (required for them), implicit prompts extracted, prompt/completion
    joined; a conversational prompt table keeps its messages in `prompt_messages`.

    `field` is the config field the spec came from, for error messages; `resolved_path` replaces
    `spec.path` (used for 'demo', which the caller resolves to the demo world's file).
    """
    ds, source, mapping, data_format = read_table(spec, kind, field=field, resolved_path=resolved_path)
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

    convert = RowConverter(kind, mapping, data_format, source, tokenizer, chat_template_kwargs or {})
    out = datasets.Dataset.from_list([convert(i, row) for i, row in enumerate(iter_rows(ds), start=1)])
    names = {"prompt": mapping.get("prompt", mapping.get("chosen")), "text": mapping.get("messages")}
    names = {**{c: c for c in out.column_names}, **mapping, **{k: v for k, v in names.items() if v}}
    if "completion" in mapping:
        names["text"] = f"{mapping['prompt']}` + `{mapping['completion']}"
    validate_rows(out, kind, source=source, source_columns=names)
    return out


def count_checked_rows(spec: DatasetSpec, kind: Kind, *, field: str) -> int:
    """The rows of `spec`, each checked as `load_table` checks it, when no tokenizer is at hand (the demo's, which
    the data stage builds); the first bad row raises its sentence. A standard table is `load_table`'s; a
    conversational one has every row's values checked as converting it checks them (`RowConverter.check`:
    messages well formed, answers not empty, chosen not rejected), without the chat template, which only the
    tokenizer has. With a tokenizer, `load_table` itself counts and checks.
    """
    ds, source, mapping, data_format = read_table(spec, kind, field=field)
    if data_format == "standard":
        return len(load_table(spec, kind, field=field))
    if len(ds) == 0:
        raise DataValidationError(f"{source} has no rows")
    convert = RowConverter(kind, mapping, data_format, source, None, {})
    for i, row in enumerate(iter_rows(ds), start=1):
        convert.check(i, row)
    return len(ds)


def _token_lengths(tokenizer, texts: list[str]) -> list[int]:
    return [len(ids) for ids in encode(tokenizer, texts, add_special_tokens=True)]


def row_lengths(ds, kind: Kind, tokenizer) -> list[int]:
    """Each row's length in tokens, as the limits count it (`rlhf_core.data.lengths.LIMITS`): a preference pair's
    prompt + the longer of its answers, a prompt, a text; conversational rows as their chat template wrote them."""
    names = [c for c in ds.column_names if c in ("prompt", "chosen", "rejected", "text")]
    cols = {c: [] for c in names}
    for batch in ds.select_columns(names).iter(batch_size=ROWS_PER_READ):
        for c in names:
            cols[c].extend(batch[c])
    if kind == "preference":
        chosen = _token_lengths(tokenizer, [p + c for p, c in zip(cols["prompt"], cols["chosen"])])
        rejected = _token_lengths(tokenizer, [p + r for p, r in zip(cols["prompt"], cols["rejected"])])
        return [max(a, b) for a, b in zip(chosen, rejected)]
    return _token_lengths(tokenizer, cols["prompt" if kind == "prompt" else "text"])


def apply_length_policy(
    ds,
    kind: Kind,
    tokenizer,
    *,
    max_length: int,
    max_prompt_length: int,
    action: Literal["truncate", "drop"],
    table: str = "",
) -> tuple[Any, TableLengths]:
    """Measure the rows against their limit; drop those over it or keep them for truncation at collation.
    -> (ds, the table's lengths)

    Limits: preferences use prompt+chosen and prompt+rejected against `max_length`; prompts use
    `max_prompt_length`; text uses `max_length`.
    """
    lengths = row_lengths(ds, kind, tokenizer)
    limit = max_prompt_length if kind == "prompt" else max_length
    measured = measure(table, kind, lengths, limit=limit, action=action)
    if action == "drop" and measured.over:
        ds = ds.select([i for i, n in enumerate(lengths) if n <= limit])
    return ds, measured


def fingerprint_rows(ds) -> str:
    """sha256 of the rows as canonical JSON: the same data gives the same fingerprint anywhere."""
    digest = hashlib.sha256()
    for row in iter_rows(ds):
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def save_table(ds, path: str | Path) -> Path:
    """Write a validated table as JSONL (`save_rows`)."""
    return save_rows(iter_rows(ds), path)


def save_rows(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as JSONL, keys sorted (written to a temporary name first, then renamed: never half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file written by `save_table` (read by `sources.first_rows`, as every data file is)."""
    return first_rows("json", str(path), None)


def read_column(path: str | Path, column: str) -> list[Any]:
    """One column of a JSONL file written by `save_table`."""
    return [row[column] for row in read_rows(path)]
