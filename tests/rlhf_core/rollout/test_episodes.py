"""Tool episodes in token ids (`run_episodes`) on the calculator world's tokenizer: the model's turns and the tools'
turns laid end to end, the mask that tells them apart, and where an episode ends (no call, the round limit, the
budget, a turn out of tokens). TRL's own loop is compared in tests/parity/test_trl_tool_loop.py."""

from __future__ import annotations

import torch

from rlhf_core.config import DemoModelConfig
from rlhf_core.demo.arithmetic import build_arithmetic_model
from rlhf_core.demo.calculator import build_calculator_tokenizer, multiply, question
from rlhf_core.rollout.engines import LoopEngine
from rlhf_core.rollout.episodes import EpisodeRecord, ToolRollout, episode_prompts, run_episodes
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.tools import Toolbox, ToolUse
from tests.fixtures.episodes import ScriptedTurns

TOK = build_calculator_tokenizer(64)
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": %d, "b": %d}}</tool_call>'


def turn(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]


def play(script, budget=40, max_calls=None, **kwargs):
    rows = [{"prompt": "", "prompt_messages": question(100 + i, 200 + i)} for i in range(len(script))]
    boxes = [Toolbox({"multiply": multiply}) for _ in rows]
    prompts = episode_prompts(TOK, rows, boxes, 12)
    engine = ScriptedTurns(prompts, [[turn(text) for text in episode] for episode in script])
    played = run_episodes(
        engine,
        None,
        ToolRollout(ToolUse([multiply], max_calls=max_calls), TOK, [], max_prompt_length=12),
        prompts=prompts,
        toolboxes=boxes,
        settings=SamplingSettings(response_length=budget),
        pad_token_id=TOK.pad_token_id,
        stop_token_ids=[TOK.eos_token_id],
        **kwargs,
    )
    return played, engine


def tokens(row_ids, mask=None):
    ids = row_ids.tolist() if mask is None else [t for t, m in zip(row_ids.tolist(), mask.tolist()) if m]
    return "".join(TOK.convert_ids_to_tokens(ids))


def test_an_episode_is_call_answer_reply_with_the_answer_masked():
    played, engine = play([[CALL % (100, 200), "20000"], ["123"]], seed=1000)
    n = int(played.resp_mask[0].sum())
    assert tokens(played.responses[0, :n]) == (CALL % (100, 200)) + "<eos><tool>20000<eos><assistant>20000<eos>"
    # the tool's turn (<tool>20000<eos><assistant>: 8 tokens) is read but not the model's
    assert tokens(played.responses[0], played.model_tokens[0]) == (CALL % (100, 200)) + "<eos>20000<eos>"
    assert int((played.resp_mask[0] - played.model_tokens[0]).sum()) == 8
    assert played.record.transcripts[0][1] == {"role": "tool", "name": "multiply", "content": "20000"}
    assert played.record.transcripts[1] == [{"role": "assistant", "content": "123"}]
    assert (played.record.calls, played.record.turns, played.record.failures) == ([1, 0], [2, 1], [0, 0])
    # a scorer reads the episode a line per event; a table shows it on one line
    assert played.record.texts()[0] == '-> multiply {"a": 100, "b": 200}\n<- multiply: 20000\n20000'
    assert played.record.lines() == ['-> multiply {"a": 100, "b": 200} ⏎ <- multiply: 20000 ⏎ 20000', "123"]
    assert played.has_stop.tolist() == [True, True]
    # the first turn is one request for both rows; the second only the calling row's, at a seed of its own
    assert [(rows, repeats) for rows, _, repeats, _ in engine.calls] == [(2, 1), (1, 1)]
    assert engine.calls[0][3] != engine.calls[1][3]


def test_the_round_limit_leaves_the_last_calls_unanswered():
    played, _ = play([[CALL % (1, 2), CALL % (3, 4), "12"]], max_calls=1)
    assert played.record.hit_limit == [True] and played.record.calls == [1] and played.record.turns == [2]
    assert [m["role"] for m in played.record.transcripts[0]] == ["assistant", "tool", "assistant"]


def test_answers_that_would_not_fit_the_budget_are_dropped():
    call = CALL % (100, 200)
    budget = len(turn(call)) + 5  # the tool's turn is 9 tokens: no room left
    played, _ = play([[call, "20000"]], budget=budget)
    assert played.record.transcripts[0] == [
        {"role": "assistant", "content": "", "tool_calls": played.record.transcripts[0][0]["tool_calls"]}
    ]
    assert int(played.resp_mask[0].sum()) == len(turn(call)) and bool(played.model_tokens[0].sum() == len(turn(call)))


def test_a_turn_out_of_tokens_ends_the_episode_without_a_stop():
    played, _ = play([[CALL % (100, 200), "1234567890123"]], budget=24)
    assert played.has_stop.tolist() == [False] and int(played.resp_mask[0].sum()) == 24


def test_records_select_and_join_by_row():
    played, _ = play([[CALL % (1, 2), "2"], ["5"], ["6"]])
    record = played.record
    assert record.select([2, 0]).transcripts == [record.transcripts[2], record.transcripts[0]]
    joined = EpisodeRecord.join([record.select([0]), record.select([1, 2])])
    assert joined.calls == record.calls and joined.texts() == record.texts()


def test_the_loop_engine_plays_episodes_on_a_model():
    model = build_arithmetic_model(
        TOK, DemoModelConfig(hidden_size=16, num_attention_heads=2, intermediate_size=32, max_position_embeddings=64), 0
    )
    rows = [{"prompt": "", "prompt_messages": question(123, 456)}] * 4
    boxes = [Toolbox({"multiply": multiply}) for _ in rows]
    torch.manual_seed(0)
    played = run_episodes(
        LoopEngine(),
        model,
        ToolRollout(ToolUse([multiply]), TOK, [], max_prompt_length=12),
        prompts=episode_prompts(TOK, rows, boxes, 12),
        toolboxes=boxes,
        settings=SamplingSettings(response_length=20),
        pad_token_id=TOK.pad_token_id,
        stop_token_ids=[TOK.eos_token_id],
        prompt_repeats=4,
    )
    assert played.responses.shape == (4, 20) and bool((played.model_tokens <= played.resp_mask).all())
    assert all(len(t) >= 1 for t in played.record.transcripts)
