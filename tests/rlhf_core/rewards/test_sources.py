"""Reward sources: Python reward functions checked for shape and type, conversational rows, reward models."""

import math

import pytest
import torch

from rlhf_core.rewards.functions import RewardFunctionError
from rlhf_core.rewards.sources import RewardSourceFn, function_reward, score_sources


def test_bad_reward_functions_are_named():
    rollout = None
    wrong_length = function_reward("short", 1.0, lambda prompts, completions, **kw: [1.0])
    with pytest.raises(RewardFunctionError, match="reward function short returned 1 values for 2 completions"):
        wrong_length.score(["a", "b"], ["x", "y"], rollout, [{"prompt": "a"}, {"prompt": "b"}])
    not_number = function_reward("text", 1.0, lambda prompts, completions, **kw: ["good", 1.0])
    with pytest.raises(RewardFunctionError, match=r"reward function text returned 'good' \(a str\) for completion 0"):
        not_number.score(["a", "b"], ["x", "y"], rollout, [{"prompt": "a"}, {"prompt": "b"}])
    columns = function_reward(
        "cols", 1.0, lambda prompts, completions, answer, **kw: [float(a == c) for a, c in zip(answer, completions)]
    )
    assert columns.score(
        ["a", "b"], ["x", "y"], rollout, [{"prompt": "a", "answer": "x"}, {"prompt": "b", "answer": "z"}]
    ) == [1.0, 0.0]


def test_function_rewards_receive_conversational_prompts_and_completions_as_message_lists():
    seen = {}

    def fn(prompts, completions, answer, **kw):
        seen.update(prompts=prompts, completions=completions, answer=answer, extra=sorted(kw))
        return [1.0] * len(completions)

    user = [{"role": "user", "content": "Hi"}]
    rows = [{"prompt": "<templated>", "prompt_messages": user, "answer": "x"}] * 2
    assert function_reward("chat", 1.0, fn).score(["<templated>"] * 2, ["Hello", "Bye"], None, rows) == [1.0, 1.0]
    assert seen == {
        "prompts": [user, user],
        "completions": [[{"role": "assistant", "content": "Hello"}], [{"role": "assistant", "content": "Bye"}]],
        "answer": ["x", "x"],
        "extra": [],
    }


def test_every_source_scores_into_one_column_none_as_nan_and_a_non_finite_score_names_its_source():
    sources = [
        function_reward("length", 1.0, lambda prompts, completions, **kw: [float(len(c)) for c in completions]),
        function_reward("abstains", 0.5, lambda prompts, completions, **kw: [None, 1.0]),
    ]
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    scores = score_sources(sources, ["a", "b"], ["xy", "z"], None, rows)
    assert scores.shape == (2, 2) and scores.dtype == torch.float32
    assert scores[:, 0].tolist() == [2.0, 1.0] and math.isnan(scores[0, 1]) and scores[1, 1] == 1.0
    broken = RewardSourceFn("broken", 1.0, lambda prompts, completions, rollout, rows: [float("inf"), 0.0])
    with pytest.raises(RewardFunctionError, match="reward broken"):
        score_sources([broken], ["a", "b"], ["x", "y"], None, rows)


def test_functions_that_take_completion_ids_get_each_completions_ids_with_its_stop_token():
    from tests.fixtures.small_models import rollout_of

    rollout = rollout_of(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    rollout.responses = torch.tensor([[5, 2, 0], [6, 7, 8]])
    got = {}

    def lengths(prompts, completions, completion_ids):
        got["ids"] = completion_ids
        return [float(len(ids)) for ids in completion_ids]

    def plain(prompts, completions):  # takes no completion_ids: not given any
        return [0.0, 0.0]

    rows = [{"prompt": "a"}, {"prompt": "b"}]
    assert function_reward("len", 1.0, lengths).score(["a", "b"], ["x", "y"], rollout, rows) == [2.0, 3.0]
    assert got["ids"] == [[5, 2], [6, 7, 8]]
    assert function_reward("plain", 1.0, plain).score(["a", "b"], ["x", "y"], rollout, rows) == [0.0, 0.0]


def test_tool_episodes_are_scored_on_their_transcripts_and_environments_score_their_own():
    from types import SimpleNamespace

    from rlhf_core.rewards.functions import exact_match
    from rlhf_core.rewards.sources import environment_rewards
    from rlhf_core.rollout.episodes import EpisodeRecord
    from rlhf_core.rollout.tools import Toolbox, ToolUse

    class Room:
        def reset(self, **_):
            return None

        def get_reward(self):
            return 0.5

    class Other(Room):
        get_reward = None

    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}
    transcripts = [
        [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": "6"},
            {"role": "assistant", "content": "6"},
        ],
        [{"role": "assistant", "content": "5"}],
    ]
    boxes = [Toolbox({}, Room()), Toolbox({}, Other())]
    record = EpisodeRecord(transcripts, [1, 0], [0, 0], [2, 1], [False, False], boxes)
    rollout = SimpleNamespace(
        episodes=record, responses=torch.zeros(2, 3, dtype=torch.long), resp_mask=torch.ones(2, 3)
    )
    rows = [{"prompt": "p", "prompt_messages": [{"role": "user", "content": "2*3="}], "answer": "6"}] * 2
    seen = {}

    def fn(prompts, completions, environments, **_):
        seen.update(completions=completions, environments=environments)
        return [0.0, 0.0]

    function_reward("f", 1.0, fn).score(["p", "p"], ["text", "text"], rollout, rows)
    assert seen["completions"] == transcripts and seen["environments"] == [b.environment for b in boxes]
    # exact match reads the transcript's last answer, not the tool's "6" or the whole text
    assert function_reward("em", 1.0, exact_match).score(["p"] * 2, ["x", "x"], rollout, rows) == [1.0, 0.0]
    [room] = environment_rewards(ToolUse([], {"a": Room, "b": Other}))
    assert room.name == "Room" and room.score(None, None, rollout, rows) == [0.5, None]
