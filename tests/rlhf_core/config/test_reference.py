"""rlhf_core/config/reference.py: docs/configuration.md's reference is generated from the schema, `rlhf fields`
prints the same table, and every field explains itself."""

from __future__ import annotations

import re
from pathlib import Path

from rlhf_core.config import (
    PipelineConfig,
)
from rlhf_core.config.reference import (
    DOC,
    END,
    START,
    WRITE_COMMAND,
    current_block,
    describe_fields,
    main,
    render_reference,
    with_block,
)

REPO = Path(__file__).resolve().parents[3]


def test_docs_reference_block_is_current():
    assert DOC == REPO / "docs" / "configuration.md"
    page = DOC.read_text()
    assert START in page and END in page, f"docs/configuration.md lacks the {START} ... {END} markers"
    assert current_block(page) == render_reference(), (
        f"docs/configuration.md's configuration reference is stale: run {WRITE_COMMAND}"
    )
    assert main(["--check"]) == 0  # the default file is docs/configuration.md


def test_readme_keeps_no_copy_of_the_table():
    readme = (REPO / "README.md").read_text()
    assert START not in readme and "| field | default | meaning |" not in readme


def test_every_field_rlhf_fields_prints_is_named_in_docs():
    from flows.console import fields_markdown

    printed = re.findall(r"^\| `([^`]+)` \|", fields_markdown(), re.MULTILINE)
    assert len(printed) == len(describe_fields())
    docs = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    unnamed = [field for field in printed if f"`{field}`" not in docs]
    assert not unnamed, f"fields `rlhf fields` prints that docs/ does not name: {unnamed}"


def test_nested_defaults_are_the_parents():
    # a parent's default_factory sets these leaves, not the leaf section's own defaults
    defaults = {path: default for path, default, _ in describe_fields()}
    assert defaults["guard.min_distinct_ratio.limit"] == "0.5"
    assert defaults["guard.kl_budget.limit"] == "null"
    assert defaults["data.eval_prompts.split"] == '"test"'


def test_every_leaf_field_has_a_description():
    missing = [path for path, _default, text in describe_fields() if not text.strip()]
    assert not missing, f"fields without a description: {', '.join(missing)}"


def test_every_section_field_has_a_description_too():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert (field.description or "").strip(), f"{prefix}{name} ({model.__name__}) has no description"
            for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
                    walk(candidate, f"{prefix}{name}.")

    walk(PipelineConfig)


def test_rendered_table_has_one_row_per_leaf_and_escapes_pipes():
    table = render_reference().splitlines()
    assert table[:2] == ["| field | default | meaning |", "|---|---|---|"]
    assert len(table) == 2 + len(describe_fields())
    row = next(line for line in table if line.startswith("| `rl.stop_tokens`"))
    assert "'<\\|im_end\\|>'" in row and row.count(" | ") == 2  # a bare | would split the cell
    row = next(line for line in table if line.startswith("| `eval.samples_per_prompt`"))
    assert "pass_at_\\<k>" in row  # a bare <k> would be read as an HTML tag and hidden


def test_write_rewrites_only_the_block(tmp_path, capsys):
    doc = tmp_path / "README.md"
    doc.write_text(f"# Title\n\nbefore\n\n{START}\n| old | table |\n{END}\n\nafter\n")
    assert main(["--check", str(doc)]) == 1
    assert WRITE_COMMAND in capsys.readouterr().err
    assert main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert current_block(text) == render_reference()
    assert main(["--check", str(doc)]) == 0
    assert with_block(text, render_reference()) == text  # writing again changes nothing
