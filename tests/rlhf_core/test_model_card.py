"""rlhf_core/model_card.py: README.md with YAML front matter, as the Hugging Face hub reads it."""

from __future__ import annotations

import pytest

from rlhf_core.model_card import read_front_matter, render_model_card, write_model_card


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
