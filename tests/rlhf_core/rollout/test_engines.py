"""The rollout engines without a server: vLLM's completions turned into our loop's padded tensors, the requests a
batch becomes (one per prompt, a group's samples in one request, seeds n apart), when weights are pushed and who
pushes them, and the weights pushed (LoRA merged without touching the policy, a tied output layer left out).
The real server: test_vllm_server.py; the four tokenizer families through both engines:
tests/integration/test_real_shapes_rollouts.py."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import RolloutConfig
from rlhf_core.rl_math import INVALID_LOGPROB
from rlhf_core.rollout.engines import (
    WEIGHTS_FILE,
    LoopEngine,
    VllmEngine,
    completions_to_tensors,
    engine_weights,
    grouped,
    make_engine,
    prompt_lists,
    rollout_seed,
    write_engine_weights,
)
from rlhf_core.rollout.generation import left_pad
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.vllm_server import Completion, VllmError


class FakeClient:
    """Answers as a vLLM server would: each prompt's `answers` (token ids; stopped when it ends on a stop id), their
    log-probs -0.5, -1.5, ...; records every request and every weight push."""

    def __init__(self, answers: dict[tuple[int, ...], list[list[int]]], stops=(0,)):
        self.answers, self.stops = answers, set(stops)
        self.requests: list[dict] = []
        self.pushed: list[dict[str, torch.Tensor]] = []

    def complete(self, prompts, settings, stop_token_ids, *, n=1, seed=None):
        self.requests.append({"prompts": [list(p) for p in prompts], "n": n, "seed": seed})
        out = []
        for p in prompts:
            for tokens in self.answers[tuple(p)][:n]:
                out.append(Completion(tokens, [-0.5 - i for i in range(len(tokens))], tokens[-1] in self.stops))
        return out

    def load_weights(self, directory):
        self.pushed.append(load_file(str(directory / WEIGHTS_FILE)))


def test_completions_become_our_loops_padded_tensors():
    completions = [Completion([5, 6, 0], [-1.0, -2.0, -3.0], True), Completion([7, 8, 9, 9], [-0.5] * 4, False)]
    responses, logprobs = completions_to_tensors(completions, width=4, pad_token_id=0)
    assert responses.tolist() == [[5, 6, 0, 0], [7, 8, 9, 9]]
    assert logprobs.tolist() == [[-1.0, -2.0, -3.0, INVALID_LOGPROB], [-0.5] * 4]
    with pytest.raises(VllmError, match="sampled 4 tokens where at most 3 were asked for"):
        completions_to_tensors(completions, width=3, pad_token_id=0)


def test_prompts_lose_their_left_padding_and_groups_are_found():
    ids, mask = left_pad([[3, 4], [3, 4], [5], [5]], pad_token_id=0)
    prompts = prompt_lists(ids, mask)
    assert prompts == [[3, 4], [3, 4], [5], [5]]
    assert grouped(prompts, 2) and not grouped(prompts, 4) and not grouped(prompts, 1)
    assert not grouped([[3], [4], [3], [4]], 2)


def test_rollout_seeds_are_a_function_of_run_process_step_and_call():
    base = rollout_seed(42, rank=0, step=7)
    assert base == rollout_seed(42, rank=0, step=7, call=0)  # a resumed run sends the same seeds
    others = {
        rollout_seed(42, rank=1, step=7),
        rollout_seed(42, rank=0, step=8),
        rollout_seed(42, rank=0, step=7, call=1),
    }
    others.add(rollout_seed(43, rank=0, step=7))
    assert base not in others and len(others) == 4
    assert 0 <= base < 2**30


def test_a_group_is_one_request_with_n_samples_and_requests_are_seeded_n_apart():
    ids, mask = left_pad([[3, 4]] * 3 + [[5]] * 3, pad_token_id=0)
    client = FakeClient({(3, 4): [[7, 0], [8, 0], [9, 9]], (5,): [[6, 0], [6, 6], [0]]})
    engine = VllmEngine(client, weights_dir=None)
    settings = SamplingSettings(response_length=2)
    out = engine.generate(None, ids, mask, settings, pad_token_id=1, stop_token_ids=[0], prompt_repeats=3, seed=100)
    assert sorted((r["prompts"][0], r["n"], r["seed"]) for r in client.requests) == [([3, 4], 3, 100), ([5], 3, 103)]
    assert out.responses.tolist() == [[7, 0], [8, 0], [9, 9], [6, 0], [6, 6], [0, 1]]
    assert out.behaviour_logprobs[5].tolist() == [-0.5, INVALID_LOGPROB]
    # rows that are not groups: one request each, n = 1
    client.requests.clear()
    ids, mask = left_pad([[3, 4], [5]], pad_token_id=0)
    engine.generate(None, ids, mask, settings, pad_token_id=1, stop_token_ids=[0], prompt_repeats=2, seed=7)
    assert sorted((r["n"], r["seed"]) for r in client.requests) == [(1, 7), (1, 8)]


def test_weights_are_pushed_at_the_first_step_then_every_n_steps_by_the_main_process_only(tmp_path, smoke_world):
    from rlhf_core.models.loading import load_causal_lm

    policy = load_causal_lm(smoke_world.base_model)
    waits = []
    main = VllmEngine(FakeClient({}), tmp_path / "w", sync_every=2, pushes=True, barrier=lambda: waits.append("main"))
    other = VllmEngine(FakeClient({}), tmp_path / "w", sync_every=2, pushes=False, barrier=lambda: waits.append("2"))
    for step in (5, 6, 7, 8):  # a run resumed at step 5 pushes at once: the server holds the start weights
        main.sync(policy, step)
        other.sync(policy, step)
    assert len(main.client.pushed) == 2 and not other.client.pushed
    assert waits == ["main", "2", "main", "2"]  # both wait at each push, the others until the push is done
    assert LoopEngine().sync(policy, 0) is None


def test_pushed_weights_leave_the_tied_output_layer_out_and_are_whole_files(tmp_path, smoke_world):
    from rlhf_core.models.loading import load_causal_lm

    policy = load_causal_lm(smoke_world.base_model)
    assert policy.config.tie_word_embeddings
    state = engine_weights(policy)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    write_engine_weights(policy, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHTS_FILE]  # no partial file left
    saved = load_file(str(tmp_path / WEIGHTS_FILE))
    for name, value in policy.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(saved[name], value)


def test_a_lora_policy_is_pushed_merged_and_left_unmerged(smoke_world):
    from peft import LoraConfig, get_peft_model

    from rlhf_core.models.loading import load_causal_lm

    base = load_causal_lm(smoke_world.base_model)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    policy = get_peft_model(base, config)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    pushed = engine_weights(policy)
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    merged.pop("lm_head.weight")
    assert pushed.keys() == merged.keys()
    for name, value in merged.items():
        torch.testing.assert_close(pushed[name], value, rtol=0, atol=1e-6)
    assert not torch.equal(
        pushed["model.layers.0.self_attn.q_proj.weight"],
        before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
    )  # the delta is in
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # the policy untouched


def test_the_loop_engine_is_the_default_and_vllm_needs_a_server():
    class Loop:
        world, is_main = 1, True

    assert isinstance(make_engine(RolloutConfig(), None, Loop()), LoopEngine)
    with pytest.raises(VllmError, match="rollout.engine vllm needs a server"):
        make_engine(RolloutConfig(engine="vllm"), None, Loop())
