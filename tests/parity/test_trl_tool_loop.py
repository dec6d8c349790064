"""Tool episodes against TRL 1.16's own tool loop (`GRPOTrainer._tool_call_loop` and `_get_tool_suffix_ids`).

Both loops get the same scripted model turns (token ids) and the same tools, on a Qwen2.5-Instruct-shaped
tokenizer (byte-level BPE, eos <|im_end|>, pad <|endoftext|>, `<tool_call>` tokens) with the real Qwen2.5 chat
template that TRL ships; TRL parses turns with the response template it sets for Qwen (transformers' parser), we
with ours. The transcripts, the episodes' token ids, the masks of tool tokens and the call and failure counts must
be the same: a call answered, a turn with two calls, a tool that raises, a tool the model invented, a turn with no
call, and a second round stopped by the iteration limit.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_core.rollout.episodes import ToolRollout, run_episodes
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.tools import Toolbox, ToolUse
from tests.fixtures.episodes import ScriptedTurns
from tests.fixtures.real_shapes import build_tokenizer, family

trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
chat_utils = pytest.importorskip("trl.chat_template_utils")


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def shout(text: str) -> str:
    """Upper-case a text; raises on an empty one.

    Args:
        text: What to upper-case.
    """
    if not text:
        raise ValueError("nothing to shout")
    return text.upper()


TOOLS = [multiply, shout]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import AddedToken

    tok = build_tokenizer(family("qwen2.5-instruct"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    template = Path(chat_utils.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    tok.chat_template = template.read_text(encoding="utf-8")
    return tok


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# each episode's model turns, in order (the text before <|im_end|>)
SCRIPT = [
    [call("multiply", a=3, b=4), "It is 12."],  # a call answered, then the answer
    [call("multiply", a=2, b=5) + "\n" + call("shout", text="hi"), "10 and HI."],  # two calls in one turn
    [call("shout", text=""), "Sorry."],  # the tool raises
    [call("divide", a=1, b=2), "I cannot divide."],  # a tool that does not exist
    ["The answer is 7."],  # no call at all
    [call("multiply", a=1, b=1), call("multiply", a=2, b=2), "never reached"],  # the second round hits the limit
]
MAX_ITERATIONS = 1
BUDGET = 200


def turn_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def script_ids(tokenizer) -> list[list[list[int]]]:
    return [[turn_ids(tokenizer, text) for text in episode] for episode in SCRIPT]


def prompts_of(tokenizer):
    questions = [[{"role": "user", "content": f"Question {i}: what is it?"}] for i in range(len(SCRIPT))]
    ids = [
        tokenizer.apply_chat_template(q, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
        for q in questions
    ]
    return questions, [list(x) for x in ids]


def ours(tokenizer, native_parser: bool = False):
    """Our episodes: calls read from Hermes blocks, or with `native_parser` by the tokenizer's own response template
    (the one TRL sets for Qwen, read by transformers' parse_response)."""
    if native_parser:
        tokenizer = chat_utils.add_response_schema(copy.deepcopy(tokenizer))
    questions, prompt_ids = prompts_of(tokenizer)
    engine = ScriptedTurns(prompt_ids, script_ids(tokenizer))
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return run_episodes(
        engine,
        None,
        ToolRollout(ToolUse(TOOLS, max_calls=MAX_ITERATIONS), tokenizer, [], max_prompt_length=BUDGET),
        prompts=prompt_ids,
        toolboxes=[Toolbox({fn.__name__: fn for fn in TOOLS}) for _ in prompt_ids],
        settings=SamplingSettings(response_length=BUDGET),
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=stops,
    )


def trls(tokenizer):
    tokenizer = chat_utils.add_response_schema(copy.deepcopy(tokenizer))
    questions, prompt_ids = prompts_of(tokenizer)
    script = ScriptedTurns(prompt_ids, script_ids(tokenizer))
    first = [script.next_turn(p) for p in prompt_ids]

    def generate_single_turn(contexts, images, multimodal_fields, num_generations, has_tool_images=False):
        return [script.next_turn(c) for c in contexts], None

    trainer = SimpleNamespace(
        processing_class=tokenizer,
        _tokenizer=tokenizer,
        _is_vlm=False,
        chat_template=None,
        chat_template_kwargs={},
        tools=TOOLS,
        environment_factories=None,
        _sync_tool_dicts=[{fn.__name__: fn for fn in TOOLS} for _ in prompt_ids],
        _async_tool_dicts=[{} for _ in prompt_ids],
        max_tool_calling_iterations=MAX_ITERATIONS,
        max_completion_length=BUDGET,
        use_vllm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=10_000)),
        _generate_single_turn=generate_single_turn,
    )
    trainer._get_tool_suffix_ids = trl_trainer.GRPOTrainer._get_tool_suffix_ids.__get__(trainer)
    completions = [
        [chat_utils.parse_response(tokenizer, ids, prefix=prompt_ids[i], tools=TOOLS)] for i, ids in enumerate(first)
    ]
    return trl_trainer.GRPOTrainer._tool_call_loop(
        trainer, copy.deepcopy(questions), prompt_ids, [list(f) for f in first], completions, None, None, {}
    )


@pytest.mark.skipif(sys.version_info < (3, 10), reason="TRL 1.16 needs Python 3.10")
@pytest.mark.parametrize("native_parser", [False, True], ids=["hermes-blocks", "response-template"])
def test_tool_episodes_match_trls_tool_loop(tokenizer, native_parser):
    tool_mask, completions, completion_ids, _, calls, failures, _ = trls(tokenizer)
    played = ours(tokenizer, native_parser)
    lengths = played.resp_mask.sum(1).tolist()
    assert [played.responses[i, :n].tolist() for i, n in enumerate(lengths)] == completion_ids
    assert [played.model_tokens[i, :n].tolist() for i, n in enumerate(lengths)] == tool_mask
    assert played.record.transcripts == completions
    assert sum(played.record.calls) == calls == 6
    assert sum(played.record.failures) == failures == 2
    # what the episodes are: two calls answered in one turn; the invented tool's and the raising tool's error texts
    assert [m["content"] for m in played.record.transcripts[1] if m["role"] == "tool"] == ["10", "HI"]
    assert played.record.transcripts[3][1]["content"] == "{'error': 'Tool divide not found.'}"
    assert played.record.transcripts[2][1]["content"] == "{'error': 'nothing to shout'}"
    assert played.record.hit_limit == [False, False, False, False, False, True]
    assert played.record.turns == [2, 2, 2, 2, 1, 2]
    assert bool(played.has_stop.all())
