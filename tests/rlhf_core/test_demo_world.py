"""rlhf_core/demo_world.py: the offline demo world (data, tokenizer, tiny models) is deterministic and self-consistent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.config import DemoModelConfig, DemoWorldConfig
from rlhf_core.demo_world import NEUTRAL_WORDS, build_demo_world, load_vader_lexicon
from rlhf_core.reward_functions import vader_compound

SMALL = DemoWorldConfig(
    num_sentences=120, num_preference_pairs=40, num_eval_preference_pairs=10, num_train_prompts=30, num_eval_prompts=10
)


TINY = DemoModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64
)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


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


def test_contents(smoke_world):
    pairs = read_jsonl(smoke_world.preferences("train"))
    for row in pairs:
        chosen, rejected = vader_compound(completions=[row["prompt"] + row["chosen"], row["prompt"] + row["rejected"]])
        assert chosen > rejected
        assert row["chosen"].startswith(" ") and row["chosen"] != row["rejected"]
    train = {r["prompt"] for r in read_jsonl(smoke_world.prompts("train"))}
    test = {r["prompt"] for r in read_jsonl(smoke_world.prompts("test"))}
    assert train and test and not train & test
    assert not test & {r["prompt"] for r in pairs}  # held-out prompts never appear in training pairs
    corpus = [r["text"] for r in read_jsonl(smoke_world.corpus)]
    assert any(word in text for text in corpus for word in NEUTRAL_WORDS)


def test_tokenizer_and_model_load_with_auto_classes(smoke_world):
    tokenizer = AutoTokenizer.from_pretrained(smoke_world.tokenizer)
    ids = tokenizer("the food was great .").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the food was great ."
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    model = AutoModelForCausalLM.from_pretrained(smoke_world.base_model)
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert (smoke_world.base_model / "model.safetensors").is_file()


def test_neutral_words_are_not_in_the_lexicon():
    lexicon = load_vader_lexicon()
    assert len(lexicon) > 7000 and lexicon["great"] > 0 > lexicon["awful"]
    assert not set(NEUTRAL_WORDS) & set(lexicon)


def test_the_demo_world_follows_the_umask_too(smoke_world):
    mask = os.umask(0o022)
    os.umask(mask)
    root = Path(smoke_world.root)
    assert {p.stat().st_mode & 0o777 for p in root.rglob("*") if p.is_file()} == {0o666 & ~mask}
    assert {p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")] if p.is_dir()} == {0o777 & ~mask}
