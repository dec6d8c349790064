"""The configuration reference: every leaf field, its default and its description, rendered as the
Markdown table of docs/configuration.md (and of `rlhf fields`).

    python -m rlhf_core.config.reference                                # print the table
    python -m rlhf_core.config.reference --write docs/configuration.md  # rewrite the block between the markers
    python -m rlhf_core.config.reference --check docs/configuration.md  # exit 1 when that block is stale

`--write` and `--check` without a file take docs/configuration.md of this checkout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from pydantic import BaseModel

from rlhf_core.config.errors import UserError, nested_section
from rlhf_core.config.pipeline import PipelineConfig

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
# the page that holds the generated block, in this checkout
DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
WRITE_COMMAND = ".venv/bin/python -m rlhf_core.config.reference --write docs/configuration.md"


def describe_fields(
    model: type[BaseModel] = PipelineConfig, prefix: str = "", defaults: BaseModel | None = None
) -> list[tuple[str, str, str]]:
    """(dotted field, default, description) for every leaf field: the configuration reference. A list of
    sections (grpo.rewards) is a row with its default, then its entries' fields as `path[].field`.

    A section's defaults are those of the section as its parent builds it (`defaults`): a parent's
    default_factory may set a leaf other than the leaf's own default (guard.min_distinct_ratio.limit is 0.5,
    GuardRule.limit None)."""
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        default = getattr(defaults, name) if defaults is not None else field.get_default(call_default_factory=True)
        if field.annotation is nested_section(field.annotation):
            rows.extend(
                describe_fields(field.annotation, path + ".", default if isinstance(default, BaseModel) else None)
            )
            continue
        if isinstance(default, list):
            default = [d.model_dump(exclude_defaults=True) if isinstance(d, BaseModel) else d for d in default]
        shown = "(required)" if field.is_required() and defaults is None else json.dumps(default, default=str)
        rows.append((path, shown, field.description or ""))
        item = nested_section(field.annotation)
        if item is not None and getattr(field.annotation, "__origin__", None) is list:  # each entry's fields
            rows.extend(describe_fields(item, path + "[]."))
    return rows


def _cell(text: str) -> str:
    """A table cell's text: a `|` would end the cell, even inside backticks, so it is escaped."""
    return text.replace("|", "\\|")


# a placeholder such as pass_at_<k>, which Markdown would take for an HTML tag and hide
_TAG_LIKE = re.compile(r"<([A-Za-z][A-Za-z0-9-]*)>")


def _prose_cell(text: str) -> str:
    """A description's cell: as `_cell`, and a tag-like placeholder outside backticks escaped (`\\<k>`)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else _TAG_LIKE.sub(r"\\<\1>", part) for part in parts).replace(
        "|", "\\|"
    )


def render_reference(model: type[BaseModel] = PipelineConfig) -> str:
    """The Markdown table of every leaf field: `| field | default | meaning |`, one row each."""
    lines = ["| field | default | meaning |", "|---|---|---|"]
    lines += [
        f"| `{path}` | `{_cell(default)}` | {_prose_cell(text)} |" for path, default, text in describe_fields(model)
    ]
    return "\n".join(lines)


def _block_span(text: str) -> tuple[int, int]:
    """Where the generated block lies in `text`: after the start marker's line, up to the end marker."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise UserError(f"no `{START}` ... `{END}` block found")
    return text.index("\n", start) + 1, end


def current_block(text: str) -> str:
    """The table between the markers of `text`, as written there (without surrounding blank lines)."""
    begin, end = _block_span(text)
    return text[begin:end].strip("\n")


def with_block(text: str, table: str) -> str:
    """`text` with the block between the markers replaced by `table`."""
    begin, end = _block_span(text)
    return f"{text[:begin]}{table}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_core.config.reference",
        description="Render the configuration reference (Markdown) from the schema.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--write",
        metavar="FILE",
        type=Path,
        nargs="?",
        const=DOC,
        help=f"rewrite the block between {START} and {END} (default docs/configuration.md)",
    )
    group.add_argument(
        "--check",
        metavar="FILE",
        type=Path,
        nargs="?",
        const=DOC,
        help="exit 1 when that block differs from the schema (default docs/configuration.md)",
    )
    args = parser.parse_args(argv)
    table = render_reference()
    target = args.write or args.check
    if target is None:
        print(table)
        return 0
    text = target.read_text()
    try:
        stale = current_block(text) != table
    except ValueError as err:
        print(f"error: {target}: {err}", file=sys.stderr)
        return 2
    if args.check:
        if stale:
            print(f"{target}: the configuration reference is stale; run {WRITE_COMMAND}", file=sys.stderr)
        return int(stale)
    if stale:
        target.write_text(with_block(text, table))
        print(f"{target}: configuration reference rewritten")
    else:
        print(f"{target}: configuration reference already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
