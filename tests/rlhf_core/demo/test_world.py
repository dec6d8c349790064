"""rlhf_core/demo/world.py: the offline demo world is built deterministically, cached, never left half-written, and
read as the pipeline reads it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhf_core.config import DemoModelConfig, DemoWorldConfig
from rlhf_core.demo.world import build_demo_world, world_rows

SMALL = DemoWorldConfig(
    num_sentences=120, num_preference_pairs=40, num_eval_preference_pairs=10, num_train_prompts=30, num_eval_prompts=10
)


TINY = DemoModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64
)


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    a = build_demo_world(tmp_path / "a", 3, SMALL, TINY)
    b = build_demo_world(tmp_path / "b", 3, SMALL, TINY)
    c = build_demo_world(tmp_path / "c", 4, SMALL, TINY)
    files_a = json.loads(a.manifest.read_text())["files"]
    assert files_a == json.loads(b.manifest.read_text())["files"]
    assert {
        "corpus.jsonl",
        "tokenizer/tokenizer.json",
        "base_model/model.safetensors",
        "preferences/train.jsonl",
        "prompts/test.jsonl",
    } <= set(files_a)
    assert files_a["corpus.jsonl"] != json.loads(c.manifest.read_text())["files"]["corpus.jsonl"]


def test_cached_world_is_reused_and_a_changed_file_rebuilds(tmp_path):
    world = build_demo_world(tmp_path / "w", 3, SMALL, TINY)
    stamp = world.corpus.stat().st_mtime_ns
    assert build_demo_world(tmp_path / "w", 3, SMALL, TINY).corpus.stat().st_mtime_ns == stamp
    world.corpus.write_text("tampered\n")
    rebuilt = build_demo_world(tmp_path / "w", 3, SMALL, TINY)
    assert rebuilt.corpus.read_text() != "tampered\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary build left behind


def test_failed_build_leaves_nothing(tmp_path):
    def explode(done, total, what):
        if what == "tokenizer":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_demo_world(tmp_path / "w", 3, SMALL, TINY, progress=explode)
    assert list(tmp_path.iterdir()) == []


def test_every_table_is_conversational_and_templated_as_the_pipeline_reads_it(smoke_world):
    (pair,) = world_rows(smoke_world, "preference", "test")[:1]
    assert pair["prompt"].startswith("<bos><|im_start|>user\n") and pair["prompt"].endswith("<|im_start|>assistant\n")
    assert pair["chosen"].endswith("<|im_end|>")  # ends where generation stops: no template newline after it
    prompt = world_rows(smoke_world, "prompt", "train")[0]
    assert prompt["prompt_messages"][0]["role"] == "user" and prompt["prompt"].endswith("assistant\n")
    (text,) = world_rows(smoke_world, "text")[:1]
    assert text["text"].count("<|im_end|>") == 2


def test_the_demo_world_follows_the_umask_too(smoke_world):
    mask = os.umask(0o022)
    os.umask(mask)
    root = Path(smoke_world.root)
    assert {p.stat().st_mode & 0o777 for p in root.rglob("*") if p.is_file()} == {0o666 & ~mask}
    assert {p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")] if p.is_dir()} == {0o777 & ~mask}
