"""The rows of a user's table: the kinds of table, their TRL types and formats, and the row checks.

`layout` maps a source's columns to the pipeline's for every TRL type (preference with an explicit or
implicit prompt, prompt-only, SFT text, messages or prompt/completion), `table_format` says whether the rows
are standard or conversational, `RowConverter` turns one source row into one pipeline row, and
`validate_rows` (every row of a loaded table) and `check_first_rows` (a file's first rows, for preflight)
check them. Every problem is one sentence naming the source, the row (counted from 1, as lines in a JSONL
file) and the column.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from rlhf_core.config import DatasetSpec
from rlhf_core.config.errors import UserError
from rlhf_core.data.chat import (
    ACCEPTED,
    PROMPT_MESSAGES,
    detect_format,
    end_at_turn_end,
    extract_prompt,
    message_problem,
    render_completions,
    render_messages,
    render_prompt,
)

Kind = Literal["preference", "prompt", "text"]


class DataValidationError(UserError):
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


def table_format(spec: DatasetSpec, ds, mapping: dict[str, str], source: str, file_fmt: str) -> str:
    """'standard' or 'conversational': `spec.format` when set, else detected from the first row of `ds` (a
    `datasets.Dataset` or a list of rows) as TRL does. A csv file cannot be conversational."""
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
        data_format = table_format(spec, rows, mapping, source, file_fmt)
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
            problem = answer_problem(dst, value)
            if problem:
                return f"{source} row {i} column `{src}` {problem}"
    return None


ANSWER_COLUMNS = ("chosen", "rejected", "completion")


def answer_problem(key: str, value: Any) -> str | None:
    """Why an answer column's value (a string, or messages ending with the answer) holds no answer, else None:
    an empty answer would train on the end-of-turn token alone."""
    if key not in ANSWER_COLUMNS:
        return None
    if isinstance(value, str):
        return None if value.strip() else "is empty"
    last = value[-1] if isinstance(value, list) and value and isinstance(value[-1], dict) else {}
    content = last.get("content")
    if isinstance(content, str) and not content.strip():
        return f"ends with an empty `{last.get('role')}` message"
    return None


ROWS_PER_READ = 1024


def iter_rows(ds) -> Iterator[dict[str, Any]]:
    """The rows of a `datasets.Dataset` as dicts, in order, as iterating it gives them, but read from Arrow
    a batch at a time (a tenth of the time of row by row) without holding the whole table as Python objects."""
    for batch in ds.iter(batch_size=ROWS_PER_READ):
        names = list(batch)
        for values in zip(*batch.values()):
            yield dict(zip(names, values))


@dataclass
class RowConverter:
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
        problem = answer_problem(key, value)
        if problem:
            self.fail(i, key, problem)
        return value

    def check(self, i: int, row: dict) -> None:
        """The row's values checked as converting it checks them, without rendering anything (no tokenizer at
        hand): each value, an implicit prompt's shared messages, and chosen against rejected."""
        values = {key: self.value(i, row, key) for key in self.mapping if key != "margin"}
        if self.kind != "preference":
            return
        chosen, rejected = values["chosen"], values["rejected"]
        if "prompt" not in self.mapping and self.data_format == "conversational":
            if not extract_prompt(chosen, rejected)[0]:
                self.fail(i, "chosen", "shares no leading message with `rejected`, so there is no prompt")
        if chosen == rejected:
            raise DataValidationError(
                f"{self.source} row {i}: `{self.mapping['chosen']}` is identical to `{self.mapping['rejected']}`"
            )

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
