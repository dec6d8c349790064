"""rlhf_core/demo/arithmetic.py: the digit tokenizer, the tiny Llama's stop ids, and the problem splits."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import DemoModelConfig
from rlhf_core.demo.arithmetic import (
    build_arithmetic_model,
    build_digit_tokenizer,
    split_problems,
    world_splits,
)
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, stop_token_ids
from rlhf_core.rewards.functions import exact_match
from rlhf_core.rl_math import response_mask
from rlhf_core.rollout.generation import decode_responses
from rlhf_core.training.sft import tokenize_corpus

SMALL = DemoModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def test_the_tokenizer_is_15_characters_and_round_trips():
    tok = build_digit_tokenizer()
    assert len(tok) == 15 and tok.chat_template is None
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}) == 3  # pad is not eos
    ids = tok("57+38=95")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 9  # bos and one token per character
    assert tok.decode(ids, skip_special_tokens=True) == "57+38=95"
    assert tok.decode(tok("1 + 2 =")["input_ids"], skip_special_tokens=True) == "1+2="  # spaces are dropped
    assert tok.decode(tok.convert_tokens_to_ids(["5", "7"])) == "57"  # no spaces between characters


def test_the_sft_corpus_ends_each_sum_with_eos():
    tok = build_digit_tokenizer()
    ids, mask, labels = tokenize_corpus(tok, ["1+2=3", "99+99=198"], max_length=16).tensors
    assert ids[0, : int(mask[0].sum())].tolist() == tok("1+2=3")["input_ids"] + [tok.eos_token_id]
    assert ids[0, -1] == tok.pad_token_id and labels[0, -1] == -100


def test_the_model_stops_on_eos_only():
    tok = build_digit_tokenizer()
    model = build_arithmetic_model(tok, SMALL, seed=0)
    assert model.config.vocab_size == 15
    assert stop_token_ids(tok, model.generation_config) == (tok.eos_token_id,)


def test_decoded_completions_leave_the_stop_token_out_and_keep_run_on_digits():
    tok = build_digit_tokenizer()
    five, seven, eight = tok.convert_tokens_to_ids(["5", "7", "8"])
    eos, pad = tok.eos_token_id, tok.pad_token_id
    responses = torch.tensor([[five, seven, eos, pad], [five, seven, eight, eight]])
    resp_mask, _, _ = response_mask(responses, [eos])
    completions = decode_responses(tok, responses, resp_mask)
    assert completions == ["57", "5788"]
    assert exact_match(completions=completions, answer=["57", "57"]) == [1.0, 0.0]


def test_splits_are_disjoint_sized_and_deterministic():
    splits = split_problems(3, num_sft=800, num_rl=3000, num_eval=200)
    assert {k: len(v) for k, v in splits.items()} == {"sft": 800, "rl": 3000, "eval": 200}
    sets = {k: set(v) for k, v in splits.items()}
    assert all(len(s) == len(splits[k]) for k, s in sets.items())  # no repeats within a split
    assert not (sets["sft"] & sets["rl"] or sets["sft"] & sets["eval"] or sets["rl"] & sets["eval"])
    assert all(0 <= a <= 99 and 0 <= b <= 99 for s in sets.values() for a, b in s)
    assert split_problems(3, num_sft=800, num_rl=3000, num_eval=200) == splits
    assert split_problems(4, num_sft=800, num_rl=3000, num_eval=200)["eval"] != splits["eval"]
    bigger = split_problems(3, num_sft=800, num_rl=5000, num_eval=200)  # more RL prompts, same SFT and eval
    assert bigger["sft"] == splits["sft"] and bigger["eval"] == splits["eval"]
    with pytest.raises(ValueError, match="add up to at most 10000"):
        split_problems(0, num_sft=5000, num_rl=5000, num_eval=1)


def test_rows_hold_the_problem_and_its_sum():
    rows = world_splits(0, num_sft=5, num_rl=5, num_eval=5)
    for row in rows["sft"]:
        left, total = row["text"].split("=")
        a, b = left.split("+")
        assert int(a) + int(b) == int(total)
    for row in rows["rl"] + rows["eval"]:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["prompt"].endswith("=") and row["answer"] == str(int(a) + int(b))


def test_a_written_world_loads_as_the_pipeline_loads_models(tmp_path):
    from rlhf_core.config import DemoWorldConfig
    from rlhf_core.demo.world import build_demo_world, world_rows

    world = DemoWorldConfig(world="arithmetic", num_labelled=4, num_train_prompts=4, num_eval_prompts=4)
    built = build_demo_world(tmp_path / "w", 0, world, SMALL)
    assert [sorted(r) for r in world_rows(built, "prompt", "test")] == [["answer", "prompt"]] * 4
    assert len(world_rows(built, "text")) == 4 and not built.preferences("train").exists()
    tok = load_tokenizer(str(built.tokenizer))
    model = load_causal_lm(str(built.base_model))
    assert tok.pad_token == "<pad>" and tok.decode(tok("12+3=")["input_ids"], skip_special_tokens=True) == "12+3="
    assert stop_token_ids(tok, model.generation_config) == (tok.eos_token_id,)
