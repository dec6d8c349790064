"""Tool episodes on the four real model families' stand-ins (tests/fixtures/real_shapes.py): Qwen2.5 base (pad ==
eos), Qwen2.5-Instruct (two stop ids, pad one of them), Llama-3-Instruct (two stop ids, no pad of its own), GPT-2
(no pad, no chat template).

The fixtures' simplified templates drop tool calls, and GPT-2 has none: each is refused in one sentence naming the
model. With the families' real tool templates (the ones TRL ships), episodes are played on a scripted model: a
call that ends at one stop id, the template's tool turn, a reply that ends at the other. Each token is where it
belongs: the model's marked, the tool turn read but not trained on, nothing after the reply's stop counted, even
where the padding is the stop token itself.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rlhf_core.data.tool_calls import tool_template_problem
from rlhf_core.models.loading import stop_token_ids
from rlhf_core.rollout.episodes import ToolRollout, episode_prompts, run_episodes
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.tools import Toolbox, ToolUse
from tests.fixtures.episodes import ScriptedTurns
from tests.fixtures.real_shapes import FAMILIES
from tests.integration.real_shapes_common import load

chat_utils = pytest.importorskip("trl.chat_template_utils")
pytestmark = pytest.mark.usefixtures("one_thread")
REAL_TEMPLATES = {"qwen2.5": "qwen2_5.jinja", "qwen2.5-instruct": "qwen2_5.jinja", "llama-3-instruct": "llama3_1.jinja"}
QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]
CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def with_tool_template(tokenizer, name: str):
    """The tokenizer with the family's real chat template (and, for Llama, the response template TRL sets)."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (Path(chat_utils.__file__).parent / "chat_templates" / REAL_TEMPLATES[name]).read_text()
    if name.startswith("llama"):  # Llama 3.1 writes bare JSON calls: only a response template reads them back
        assert "cannot read back" in tool_template_problem(tokenizer)
        chat_utils.add_response_schema(tokenizer)
    return tokenizer


def call_turn(tokenizer, stop: int) -> list[int]:
    """The call as the template writes an assistant turn, up to its end, which is made `stop`."""
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        QUESTION + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], tokenize=True, return_dict=False
    )
    turn = list(full[len(prompt) :])
    ends = [
        i for i, t in enumerate(turn) if t in (tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>"]))
    ]
    return turn[: ends[0]] + [stop] if ends else turn + [stop]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_template_that_drops_tool_turns_is_refused_naming_the_model(family_root, name):
    tokenizer, _ = load(family_root, name)
    problem = tool_template_problem(tokenizer)
    assert problem is not None and name in problem
    if name == "gpt2":
        assert problem.endswith("has no chat template to write tool turns with")
    else:
        assert problem.endswith("drops tool calls or tool answers when it renders them")


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_an_episode_on_a_real_template_puts_every_token_where_it_belongs(family_root, name):
    base, model = load(family_root, name)
    tokenizer = with_tool_template(base, name)
    assert tool_template_problem(tokenizer) is None
    stops = stop_token_ids(tokenizer, model.generation_config)
    first_stop, last_stop = (
        stops[-1],
        stops[0],
    )  # two ids for the instruct models: the call ends at one, the reply at the other
    reply = tokenizer("It is 12.", add_special_tokens=False)["input_ids"] + [last_stop]
    boxes = [Toolbox({"multiply": multiply})]
    prompts = episode_prompts(tokenizer, [{"prompt": "", "prompt_messages": QUESTION}], boxes, 256)
    call = call_turn(tokenizer, first_stop)
    engine = ScriptedTurns(prompts, [[call, reply]])
    played = run_episodes(
        engine,
        None,
        ToolRollout(ToolUse([multiply]), tokenizer, [], max_prompt_length=256),
        prompts=prompts,
        toolboxes=boxes,
        settings=SamplingSettings(response_length=200),
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=stops,
    )
    transcript = played.record.transcripts[0]
    assert transcript[0]["tool_calls"][0]["function"] == CALL["function"]
    assert transcript[1:] == [
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "It is 12."},
    ]
    n = int(played.resp_mask[0].sum())
    ids, marks = played.responses[0, :n].tolist(), played.model_tokens[0, :n].tolist()
    tool_turn = ids[len(call) : n - len(reply)]
    assert ids[: len(call)] == call and ids[n - len(reply) :] == reply
    assert marks == [1] * len(call) + [0] * len(tool_turn) + [1] * len(reply)
    assert "12" in tokenizer.decode(tool_turn)
    # after the reply's stop: padding (for Qwen2.5 base the stop token itself), never counted
    assert played.responses[0, n:].eq(tokenizer.pad_token_id).all() and played.resp_mask[0, n:].eq(0).all()
    assert bool(played.has_stop[0]) and played.record.turns == [2] and played.record.calls == [1]
