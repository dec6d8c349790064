"""rlhf_core/rewards/functions.py: callable rewards; a reward or metric function that raises is named, with the sample it
fails on and the exception."""

from __future__ import annotations

import pytest

from rlhf_core.rewards.functions import RewardFunctionError, call_scoring_function, vader_compound


def fails_on_the_third(prompts=None, completions=None, **kwargs):
    return [1.0 / (len(c) - 5) for c in completions]  # 'hello' has 5 characters


def test_vader_compound_scores_completions():
    scores = vader_compound(prompts=["a", "b", "c"], completions=["great and lovely", "awful", "the table"])
    assert scores[0] > 0.5 and scores[1] < -0.3 and scores[2] == 0.0
    with pytest.raises(ValueError):
        vader_compound(prompts=["a"])


def test_a_raising_function_names_itself_the_sample_and_the_exception():
    with pytest.raises(RewardFunctionError) as err:
        call_scoring_function(
            "brevity",
            fails_on_the_third,
            prompts=["p"] * 4,
            completions=["hi", "good day", "hello", "hey"],
            source=["a", "b", "c", "d"],
        )
    message = str(err.value)
    assert message == "reward function brevity raised ZeroDivisionError: float division by zero on completion 2 (of 4)"
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_the_columns_are_split_per_sample_too():
    seen = []

    def needs_a_column(prompts=None, completions=None, label=None, **kwargs):
        seen.append(list(label))
        if "bad" in label:
            raise KeyError("bad label")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"raised KeyError: 'bad label' on completion 1 \(of 3\)"):
        call_scoring_function(
            "labels", needs_a_column, prompts=["p"] * 3, completions=["a", "b", "c"], label=["ok", "bad", "ok"]
        )
    assert seen == [["ok", "bad", "ok"], ["ok"], ["bad"]]


def test_a_batch_only_failure_reports_the_batch():
    def batch_of_one_only(prompts=None, completions=None, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("expects one completion")
        return [0.0]

    with pytest.raises(
        RewardFunctionError, match="raised RuntimeError: expects one completion on a batch of 2 completions"
    ):
        call_scoring_function("single", batch_of_one_only, prompts=["p", "q"], completions=["a", "b"])


def test_exact_match_scores_the_whole_stripped_completion_against_the_answer():
    from rlhf_core.rewards.functions import exact_match

    completions = ["57", "56", "578", " 57\n", "5", "", "57+1", "057"]
    assert exact_match(prompts=["12+45="] * 8, completions=completions, answer=["57"] * 8) == [
        1.0,  # right
        0.0,  # wrong
        0.0,  # ran on past the answer (no stop token): extra digits are wrong
        1.0,  # surrounding whitespace does not count
        0.0,  # a prefix of the answer
        0.0,  # nothing
        0.0,  # the answer and more
        0.0,  # a leading zero is another text
    ]
    assert exact_match(completions=["10"], answer=[" 10 "]) == [1.0]  # the answer is stripped too
    assert exact_match(completions=["10"], answer=[10]) == [1.0]  # and compared as text


def test_exact_match_reads_conversational_completions():
    from rlhf_core.rewards.functions import exact_match

    prompts = [[{"role": "user", "content": "1+2="}]] * 2
    completions = [[{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "4"}]]
    assert exact_match(prompts=prompts, completions=completions, answer=["3", "3"]) == [1.0, 0.0]


def test_exact_match_without_an_answer_column_names_it():
    from rlhf_core.rewards.functions import exact_match

    with pytest.raises(ValueError, match="'answer' column"):
        exact_match(prompts=["1+2="], completions=["3"])
    with pytest.raises(ValueError, match="completions"):
        exact_match(prompts=["1+2="], answer=["3"])
    with pytest.raises(RewardFunctionError, match="exact_match raised ValueError"):
        call_scoring_function("exact_match", exact_match, prompts=["1+2="], completions=["3"])


def test_soft_overlong_punishment_by_hand_and_as_trl_computes_it():
    from trl.rewards import get_soft_overlong_punishment

    from rlhf_core.rewards.functions import soft_overlong_punishment

    ids = [[1] * n for n in (0, 3, 4, 5, 7, 8, 9, 20)]
    ours = soft_overlong_punishment(completion_ids=ids, max_completion_len=8, soft_punish_cache=4)
    assert ours == [0.0, 0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0]
    assert ours == get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)(completion_ids=ids)
    with pytest.raises(ValueError, match="needs completion_ids"):
        soft_overlong_punishment(completions=["a"])


def test_arguments_are_bound_by_name_and_an_unknown_one_is_refused():
    from rlhf_core.rewards.functions import RewardFunctionError, bind_arguments, soft_overlong_punishment

    bound = bind_arguments(soft_overlong_punishment, {"max_completion_len": 2, "soft_punish_cache": 1}, field="r")
    assert bound(completion_ids=[[1], [1, 1], [1, 1, 1]]) == [0.0, -1.0, -1.0]

    def strict(prompts, completions):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"grpo.rewards\[1\].arguments: the function takes no argument 'k'"):
        bind_arguments(strict, {"k": 1}, field="grpo.rewards[1]")


def test_a_config_naming_the_module_by_its_path_before_the_packages_still_loads():
    from rlhf_core.rewards.functions import exact_match, load_function

    assert load_function("rlhf_core.reward_functions:exact_match", field="grpo.rewards") is exact_match
    with pytest.raises(RewardFunctionError, match="module 'rlhf_core.rewards.functions' has no function 'nope'"):
        load_function("rlhf_core.reward_functions:nope")
