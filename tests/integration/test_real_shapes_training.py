"""SFT corpora and training runs of four real model families, on offline stand-ins of their checkouts.

The fixtures (tests/fixtures/real_shapes.py) copy what decides how a response ends: Qwen2.5 base
(pad == eos), Qwen2.5-Instruct and Llama-3-Instruct (two stop ids in generation_config; Llama has
no pad), GPT-2 (bos == eos, no pad). Pinned here: the SFT corpus ends every answer with the stop token,
right after the text (and trains on it), and an SFT warm start makes PPO's and GRPO's responses stop.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import GRPOConfig, PPOConfig, RLConfig, RunConfig, SFTConfig
from rlhf_core.models.loading import load_causal_lm, stop_token_ids
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.rollout.collect import Passes, SamplingSpec, collect_rollout, completion_metrics
from rlhf_core.rollout.generation import left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import SamplingSettings
from tests.fixtures.real_shapes import FAMILIES, family, prompts_and_answers, render_prompt, sft_texts
from tests.integration.real_shapes_common import load

pytestmark = pytest.mark.usefixtures("one_thread")


def _rollout_stats(policy, tok, prompts, stops, response_length, seed=0):
    ids, mask = left_pad(tokenize_prompts(tok, prompts, 48), tok.pad_token_id)
    torch.manual_seed(seed)
    rollout = collect_rollout(
        policy,
        None,
        ids,
        mask,
        SamplingSpec(
            SamplingSettings(response_length=response_length, temperature=1.0), tok.pad_token_id, tuple(stops)
        ),
        passes=Passes(policy=False, reference=False),
    )
    ended_on = [rollout.responses[i, rollout.last_index[i]].item() for i in range(len(prompts)) if rollout.has_stop[i]]
    return completion_metrics(rollout)["completions/clipped_ratio"].item(), ended_on


@pytest.mark.parametrize("name", FAMILIES)
def test_sft_corpus_ends_every_answer_with_the_stop_token(family_root, name):
    from rlhf_core.training.sft import tokenize_corpus

    tok, _ = load(family_root, name)
    stop = tok.convert_tokens_to_ids(family(name).sft_stop)
    assert stop == tok.eos_token_id  # <|im_end|> and <|eot_id|> for the instruct families
    ids, mask, labels = tokenize_corpus(tok, sft_texts(tok, family(name)), max_length=64).tensors
    last = mask.sum(1) - 1
    rows = torch.arange(ids.shape[0])
    assert (ids[rows, last] == stop).all()
    assert (labels[rows, last] == stop).all()  # trained on, although pad == eos for three of the families


@pytest.mark.parametrize("name", FAMILIES)
def test_sft_corpus_puts_the_stop_right_after_the_answer(family_root, name):
    """tokenize_corpus puts eos right after the text, as TRL does (and not again when the text already
    ends with it). With a byte-level BPE (every family here) a space before it would be a token of its
    own ('Ġ'), and SFT would teach a chat model "content Ġ<|im_end|>" instead of "content<|im_end|>"."""
    from rlhf_core.training.sft import tokenize_corpus

    tok, _ = load(family_root, name)
    texts = sft_texts(tok, family(name))
    ids, mask, _ = tokenize_corpus(tok, texts, max_length=64).tensors
    for row, text in enumerate(texts):
        real = ids[row, mask[row].bool()].tolist()
        assert real[:-1] == tok(text)["input_ids"], f"{tok.convert_ids_to_tokens(real[-3:])} closes {text!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_sft_warm_start_then_ppo_and_grpo_responses_stop(family_root, tmp_path, name):
    from rlhf_core.rewards.reward_model import load_reward_model
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo
    from rlhf_core.rl.ppo import train_ppo
    from rlhf_core.training.loop import Hooks
    from rlhf_core.training.sft import train_sft

    spec = family(name)
    tok, base = load(family_root, name)
    stops = stop_token_ids(tok, base.generation_config)
    prompts = [render_prompt(tok, spec, q) for q, _ in prompts_and_answers()]
    length = 16  # the longest answer is 12 tokens with its stop
    # the untrained model almost never stops: the metric below is not trivially 0
    clipped_before, _ = _rollout_stats(base, tok, prompts, stops, length)
    assert clipped_before > 0.5

    sft_dir = tmp_path / "sft"
    sft = train_sft(
        base,
        tok,
        sft_texts(tok, spec),
        SFTConfig(max_steps=100, batch_size=12, learning_rate=3e-3, lr_scheduler="constant", log_steps=100),
        RunConfig(device="cpu", seed=1),
        max_length=64,
        output_dir=sft_dir,
        hooks=Hooks(show_progress=False),
    )
    assert sft["sft/loss"] < 0.5
    warm = load_causal_lm(str(sft_dir)).eval()
    assert warm.generation_config.eos_token_id == base.generation_config.eos_token_id  # both stop ids survive the save
    clipped_after, ended_on = _rollout_stats(warm, tok, prompts, stops, length)
    assert clipped_after < 0.5
    # the instruct families stop on their turn end (<|im_end|> / <|eot_id|>), which is not generation_config's first
    # id for Llama 3: a loop that honoured one id only would clip every response
    sft_stop = tok.convert_tokens_to_ids(spec.sft_stop)
    assert ended_on.count(sft_stop) >= len(ended_on) - 1

    rl = dict(
        total_steps=2,
        batch_size=8,
        learning_rate=1e-5,
        response_length=length,
        temperature=1.0,
        save_steps=100,
        log_steps=1,
    )
    ppo_logs = []
    result = train_ppo(
        rl_inputs(
            load_causal_lm(str(sft_dir)),
            tok,
            prompts,
            tmp_path / "ppo",
            value=load_reward_model(str(sft_dir), tok, seed=0),
            reference=load_causal_lm(str(sft_dir)),
            reward_model=load_reward_model(str(sft_dir), tok, seed=1),
            rl=RLConfig(**rl),
            ppo=PPOConfig(num_ppo_epochs=1),
            run=RunConfig(device="cpu", seed=3),
            max_prompt_length=48,
            on_log=lambda m, s: ppo_logs.append(m),
            show_progress=False,
        )
    )
    assert len(ppo_logs) == 2
    for logged in ppo_logs:
        assert logged["completions/clipped_ratio"] < 0.5, logged
        assert 0 < logged["completions/mean_terminated_length"] <= length
        assert logged["val/num_eos_tokens"] >= 4
    saved = load_causal_lm(str(result.checkpoint / "policy"))
    assert saved.generation_config.eos_token_id == base.generation_config.eos_token_id

    grpo_logs = []
    has_a = function_reward("has_a", 1.0, lambda prompts, completions, **_: [float("a" in c) for c in completions])
    train_grpo(
        rl_inputs(
            load_causal_lm(str(sft_dir)),
            tok,
            [{"prompt": p} for p in prompts],
            tmp_path / "grpo",
            reference=None,
            rewards=[has_a],
            rl=RLConfig(algorithm="grpo", **rl),
            grpo=GRPOConfig(num_generations=4),
            run=RunConfig(device="cpu", seed=3),
            max_prompt_length=48,
            on_log=lambda m, s: grpo_logs.append(m),
            show_progress=False,
        )
    )
    assert len(grpo_logs) == 2
    for logged in grpo_logs:
        assert logged["completions/clipped_ratio"] < 0.5, logged
        assert 0 < logged["completions/mean_terminated_length"] <= length
    # the estimators that put a KL summed over the response mask into the reward (RLOO) or spread per-token
    # advantages over it (REINFORCE++): pad == eos, two stop ids and no pad must give finite statistics
    for algorithm in ("rloo", "reinforce_plus_plus"):
        logs = []
        train_grpo(
            rl_inputs(
                load_causal_lm(str(sft_dir)),
                tok,
                [{"prompt": p} for p in prompts],
                tmp_path / algorithm,
                reference=load_causal_lm(str(sft_dir)),
                rewards=[has_a],
                rl=RLConfig(algorithm=algorithm, **rl),
                grpo=GRPOConfig(num_generations=4, beta=0.05),
                run=RunConfig(device="cpu", seed=3),
                max_prompt_length=48,
                on_log=lambda m, s, logs=logs: logs.append(m),
                show_progress=False,
            )
        )
        assert len(logs) == 2
        for logged in logs:
            assert logged["completions/clipped_ratio"] < 0.5, (algorithm, logged)
            assert math.isfinite(logged["kl"]) and math.isfinite(logged["loss"]), (algorithm, logged)
