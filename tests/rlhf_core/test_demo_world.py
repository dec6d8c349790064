"""rlhf_core/demo_world.py: the offline demo world (data, tokenizer, tiny models) is deterministic and self-consistent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.config import DemoModelConfig, DemoWorldConfig
from rlhf_core.demo_world import NEUTRAL_WORDS, build_demo_world, load_vader_lexicon, world_rows
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
        (user,), (chosen,), (rejected,) = row["prompt"], row["chosen"], row["rejected"]
        assert (user["role"], chosen["role"], rejected["role"]) == ("user", "assistant", "assistant")
        good, bad = vader_compound(
            completions=[user["content"] + " " + chosen["content"], user["content"] + " " + rejected["content"]]
        )
        assert good > bad and chosen["content"] != rejected["content"]
    train = {r["prompt"][0]["content"] for r in read_jsonl(smoke_world.prompts("train"))}
    test = {r["prompt"][0]["content"] for r in read_jsonl(smoke_world.prompts("test"))}
    assert train and test and not train & test
    assert not test & {r["prompt"][0]["content"] for r in pairs}  # held-out prompts never appear in training pairs
    corpus = [r["messages"] for r in read_jsonl(smoke_world.corpus)]
    assert all([m["role"] for m in messages] == ["user", "assistant"] for messages in corpus)
    assert any(word in messages[1]["content"] for messages in corpus for word in NEUTRAL_WORDS)


def test_every_table_is_conversational_and_templated_as_the_pipeline_reads_it(smoke_world):
    (pair,) = world_rows(smoke_world, "preference", "test")[:1]
    assert pair["prompt"].startswith("<bos><|im_start|>user\n") and pair["prompt"].endswith("<|im_start|>assistant\n")
    assert pair["chosen"].endswith("<|im_end|>")  # ends where generation stops: no template newline after it
    prompt = world_rows(smoke_world, "prompt", "train")[0]
    assert prompt["prompt_messages"][0]["role"] == "user" and prompt["prompt"].endswith("assistant\n")
    (text,) = world_rows(smoke_world, "text")[:1]
    assert text["text"].count("<|im_end|>") == 2


def test_tokenizer_and_model_load_with_auto_classes(smoke_world):
    tokenizer = AutoTokenizer.from_pretrained(smoke_world.tokenizer)
    ids = tokenizer("the food was great .").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
    # words are decoded with spaces where they meet
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the food was great ."
    assert tokenizer.decode(ids[1:3]) + " " + tokenizer.decode(ids[3:]) == "the food was great ."
    # Qwen2.5 base's shape: pad == eos; ChatML-like turns whose end is the first of two stop ids
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and tokenizer.eos_token == "<|endoftext|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the food was"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<bos><|im_start|>user\nthe food was<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tokenizer(chat, add_special_tokens=False).input_ids
    assert chat_ids.count(tokenizer.bos_token_id) == 1 and tokenizer.unk_token_id not in chat_ids
    assert tokenizer.decode(chat_ids, skip_special_tokens=True) == "user the food was assistant"
    model = AutoModelForCausalLM.from_pretrained(smoke_world.base_model)
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == [im_end, tokenizer.eos_token_id]
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
