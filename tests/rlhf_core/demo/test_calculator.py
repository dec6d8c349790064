"""The calculator world: disjoint problem sets, the call shown on its share of the SFT chats, and chats that the
tokenizer writes in a handful of tokens and reads back as the same calls."""

from __future__ import annotations

from rlhf_core.data.tool_calls import parse_turn, tool_template_problem
from rlhf_core.demo.calculator import build_calculator_tokenizer, call_transcript, multiply, question, world_splits


def test_splits_are_disjoint_and_show_the_call_on_its_share():
    splits = world_splits(0, num_sft=200, num_rl=100, num_eval=50, tool_call_fraction=0.25)
    problems = {
        k: {r["messages"][0]["content"] if k == "sft" else r["prompt"][0]["content"] for r in v}
        for k, v in splits.items()
    }
    assert not (problems["sft"] & problems["rl"]) and not (problems["eval"] & (problems["sft"] | problems["rl"]))
    assert sum(len(r["messages"]) == 4 for r in splits["sft"]) == 50
    row = splits["eval"][0]
    a, b = map(int, row["prompt"][0]["content"].rstrip("=").split("*"))
    assert row["answer"] == str(a * b) and 100 <= a <= 999 and 100 <= b <= 999
    assert world_splits(0, 200, 100, 50, 0.25) == splits


def test_a_solved_chat_is_forty_tokens_and_its_call_reads_back():
    tok = build_calculator_tokenizer(64)
    assert tool_template_problem(tok) is None
    chat = question(456, 789) + call_transcript(456, 789)
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert len(ids) == 40 and tok.unk_token_id not in ids
    start = ids.index(tok.convert_tokens_to_ids("<tool_call>"))
    end = ids.index(tok.eos_token_id, start) + 1
    assert parse_turn(tok, ids[start:end])["tool_calls"] == chat[1]["tool_calls"]
    assert multiply(456, 789) == 359784
