"""rlhf_core/config/reference.py: README.md's configuration reference is generated from the schema, and every field
explains itself."""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import (
    PipelineConfig,
)
from rlhf_core.config.reference import (
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


def test_readme_reference_block_is_current():
    readme = (REPO / "README.md").read_text()
    assert START in readme and END in readme, f"README.md lacks the {START} ... {END} markers"
    assert current_block(readme) == render_reference(), (
        f"README.md's configuration reference is stale: run {WRITE_COMMAND}"
    )


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


def test_readme_starts_with_the_two_commands():
    # the configuration reference itself: the tests above
    readme = (REPO / "README.md").read_text()
    commands = readme.split("## ", 2)[1]
    assert "make demo" in commands and "make test" in commands
