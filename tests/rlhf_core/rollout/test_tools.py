"""Tools answer whatever happens: a raise, a hang past the timeout (sync or async) or an invented name each comes
back as the tool's error text, counted as a failure; environments are reset per episode and pooled."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlhf_core.config import GRPOConfig
from rlhf_core.rollout.tools import Toolbox, ToolError, call_tool, load_tool_use, run_turns


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: one
        b: two
    """
    return a + b


def broken(x: int) -> int:
    raise RuntimeError(f"broken on {x}")


def hangs() -> str:
    time.sleep(30)
    return "late"


async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


async def async_hangs() -> str:
    await asyncio.sleep(30)
    return "late"


class Counter:
    """An environment: reset with the row's columns, a tool method, a reward."""

    built = 0

    def __init__(self):
        Counter.built += 1
        self.total = 0

    def reset(self, start: int = 0, **_):
        self.total = start
        return f" (start at {start})"

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much
        """
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total)

    def _private(self):
        return "not a tool"


def fn_call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


BOX = Toolbox({f.__name__: f for f in (add, broken, hangs, async_add, async_hangs)})


def test_a_tool_answers_with_its_result():
    answer = call_tool(BOX, fn_call("add", a=2, b=3), 5.0)
    assert (answer.name, answer.content, answer.failed) == ("add", "5", False)
    assert call_tool(BOX, fn_call("async_add", a=2, b=3), 5.0).content == "5"


def test_a_raising_tool_answers_its_error_and_counts_as_failed():
    answer = call_tool(BOX, fn_call("broken", x=7), 5.0)
    assert answer.failed and answer.content == "{'error': 'broken on 7'}"
    bad_arguments = call_tool(BOX, fn_call("add", a=1), 5.0)
    assert bad_arguments.failed and "missing 1 required positional argument" in bad_arguments.content


def test_an_invented_tool_is_answered_as_trl_answers_it():
    answer = call_tool(BOX, fn_call("divide", a=1, b=2), 5.0)
    assert answer.failed and answer.content == "{'error': 'Tool divide not found.'}"


@pytest.mark.parametrize("name", ["hangs", "async_hangs"])
def test_a_hanging_tool_is_answered_at_its_timeout(name):
    start = time.monotonic()
    answer = call_tool(BOX, fn_call(name), 0.3)
    assert time.monotonic() - start < 5
    assert answer.failed and answer.content == f"{{'error': 'Tool {name} timed out after 0.3 s'}}"


def test_run_turns_keeps_each_episodes_calls_in_order():
    jobs = [(BOX, [fn_call("add", a=1, b=1), fn_call("broken", x=1)]), (BOX, []), (BOX, [fn_call("add", a=5, b=5)])]
    answers = run_turns(jobs, 5.0)
    assert [[a.content for a in turn] for turn in answers] == [["2", "{'error': 'broken on 1'}"], [], ["10"]]


def test_environments_are_reset_per_episode_pooled_and_give_their_methods():
    tool_use = load_tool_use(GRPOConfig(environment=f"{__name__}:Counter", tools=[f"{__name__}:add"]))
    Counter.built = 0
    boxes = tool_use.toolboxes([{"prompt": "p", "start": 1}, {"prompt": "p", "start": 5}])
    assert Counter.built == 2 and sorted(boxes[0].tools) == ["add", "bump"]
    assert boxes[1].reset_text == " (start at 5)"
    assert call_tool(boxes[1], fn_call("bump", by=2), 5.0).content == "7"
    assert boxes[0].environment.total == 1  # each episode has its own instance
    again = tool_use.toolboxes([{"prompt": "p", "start": 3}])
    assert Counter.built == 2 and again[0].environment is boxes[0].environment  # reused, reset
    assert tool_use.reward_classes() == [Counter]


def test_multi_environment_rows_name_theirs():
    tool_use = load_tool_use(GRPOConfig(environment={"count": f"{__name__}:Counter"}))
    assert tool_use.toolboxes([{"prompt": "p", "environment": "count"}])[0].environment is not None
    with pytest.raises(ToolError, match=r"prompt row 1: its `environment` column is 'other'"):
        tool_use.toolboxes([{"prompt": "p", "environment": "count"}, {"prompt": "p", "environment": "other"}])


def test_config_mistakes_are_one_sentence():
    assert load_tool_use(GRPOConfig()) is None
    with pytest.raises(ToolError, match=r"grpo.tools\[0\]: could not import module 'no_such_module'"):
        load_tool_use(GRPOConfig(tools=["no_such_module:f"]))
    with pytest.raises(ToolError, match=r"grpo.tools\[0\]: module '.*' has no function 'nope'"):
        load_tool_use(GRPOConfig(tools=[f"{__name__}:nope"]))
    with pytest.raises(ToolError, match="is a class"):
        load_tool_use(GRPOConfig(tools=[f"{__name__}:Counter"]))
    with pytest.raises(ToolError, match="has no reset method"):
        load_tool_use(GRPOConfig(environment=f"{__name__}:Toolbox"))
    with pytest.raises(ValueError, match="must be written 'package.module:function'"):
        GRPOConfig(tools=["add"])


def test_a_template_that_cannot_carry_episodes_is_refused_naming_it():
    from rlhf_core.demo.calculator import build_calculator_tokenizer
    from rlhf_core.rollout.tools import require_tool_template

    tokenizer = build_calculator_tokenizer(64)
    require_tool_template(tokenizer)  # the calculator world's template carries them
    tokenizer.name_or_path = "org/chat-model"
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ToolError) as raised:
        require_tool_template(tokenizer)
    assert str(raised.value) == (
        "grpo.tools and grpo.environment need a chat template that writes tool turns, and the chat template of "
        "org/chat-model drops tool calls or tool answers when it renders them"
    )
