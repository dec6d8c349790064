"""rlhf_core/models/card.py: README.md with YAML front matter, as the Hugging Face hub reads it."""

from __future__ import annotations

import pytest

from rlhf_core.models.card import read_front_matter, render_model_card, write_model_card


def test_the_front_matter_round_trips_and_the_body_follows_the_title(tmp_path):
    metadata = {"base_model": "tiny", "tags": ["rlhf", "ppo"], "datasets": ["démo"]}
    path = write_model_card(tmp_path, title="A policy", metadata=metadata, body="\ntrained in a test\n\n")
    assert path == tmp_path / "README.md"
    assert read_front_matter(path) == metadata
    text = path.read_text(encoding="utf-8")
    assert text.startswith("---\nbase_model: tiny\n") and text.endswith("---\n\n# A policy\n\ntrained in a test\n")
    assert render_model_card(title="A policy", metadata=metadata, body="trained in a test") == text


def test_a_card_without_front_matter_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("# no metadata\n")
    with pytest.raises(ValueError, match="has no YAML front matter"):
        read_front_matter(tmp_path / "README.md")
    (tmp_path / "empty.md").write_text("---\n---\n\n# t\n")
    assert read_front_matter(tmp_path / "empty.md") == {}


def test_a_base_card_license_is_read_and_absent_when_unnamed(tmp_path):
    from rlhf_core.models.card import card_field, card_license

    assert card_license(tmp_path) is None  # no README.md
    write_model_card(tmp_path, title="base", metadata={"license": "mit", "base_model": "org/root"}, body="b")
    assert card_license(tmp_path) == "mit" and card_field(tmp_path, "base_model") == "org/root"
    (tmp_path / "README.md").write_text("---\ntags: [x]\n---\n# no license\n")
    assert card_license(tmp_path) is None
    (tmp_path / "README.md").write_text("# no front matter\n")
    assert card_license(tmp_path) is None


def test_sources_are_named_by_hub_id_demo_or_file_name_never_a_local_path(tmp_path):
    from rlhf_core.models.card import source_name

    (tmp_path / "prefs").mkdir()
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    assert source_name("demo") == "demo"
    assert source_name("stanfordnlp/imdb") == "stanfordnlp/imdb" and source_name("gpt2") == "gpt2"
    assert source_name(str(tmp_path / "prompts.jsonl")) == "prompts.jsonl"
    assert (
        source_name(str(tmp_path / "prefs")) == "prefs" and source_name(str(tmp_path / "prefs" / "*.jsonl")) == "prefs"
    )
    assert source_name("data/missing.jsonl") == "missing.jsonl"
    assert source_name(f"{tmp_path}/base/") == "base"
