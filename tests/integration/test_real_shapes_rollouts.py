"""Rollouts of four real model families, through rlhf_core's own `generate`, on offline stand-ins.

The fixtures (tests/fixtures/real_shapes.py) copy what decides how a response ends: Qwen2.5 base
(pad == eos), Qwen2.5-Instruct and Llama-3-Instruct (two stop ids in generation_config; Llama has
no pad), GPT-2 (bos == eos, no pad). Pinned here, on scripted policies: a response ends at either stop id
(the stop token is its last real token, nothing after it counts), missing_eos_penalty hits only rows without
a stop, no stop before min_tokens, and the decode loop's ready SDPA mask samples what the model's own does.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.loading import stop_token_ids
from rlhf_core.rl_math import INVALID_LOGPROB, response_mask
from rlhf_core.rollout.collect import Passes, SamplingSpec, collect_rollout, completion_metrics
from rlhf_core.rollout.generation import decode_responses, left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import SamplingSettings
from tests.fixtures.real_shapes import (
    FAMILIES,
    ScriptedPolicy,
    TokenCountReward,
    family,
    prompts_and_answers,
    render_prompt,
)
from tests.integration.real_shapes_common import load

pytestmark = pytest.mark.usefixtures("one_thread")

R = 7  # response length of the scripted rollouts

POLICY_ONLY, NEITHER = Passes(reference=False), Passes(policy=False, reference=False)


def scripted_batch(tok, model, stops, min_tokens=1):
    """Five prompts of different lengths (left padding) and a script per row:
    0: first stop id at 2 | 1: last stop id at 4 | 2: no stop | 3: first stop id on the last step |
    4: last stop id at 1, then the first one at 3 (the first stop counts)."""
    prompts = [q for q, _ in prompts_and_answers()[:5]]
    prompts[1] = "Hi."
    ids, mask = left_pad(tokenize_prompts(tok, prompts, 32), tok.pad_token_id)
    word = tok.convert_tokens_to_ids("Ġcat")
    assert word not in stops and word != tok.pad_token_id
    script = torch.full((5, R), word)
    a, b = stops[0], stops[-1]
    script[0, 2], script[1, 4], script[3, R - 1], script[4, 1], script[4, 3] = a, b, a, b, a
    return ids, mask, ScriptedPolicy(model, ids.shape[1], script)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("greedy", [True, False])
def test_rollout_ends_at_either_stop_id_and_nothing_after_it_counts(family_root, name, greedy):
    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    ids, mask, policy = scripted_batch(tok, model, stops)
    torch.manual_seed(0)
    rollout = collect_rollout(
        policy,
        None,
        ids,
        mask,
        SamplingSpec(
            SamplingSettings(response_length=R, temperature=1.0, greedy=greedy), tok.pad_token_id, tuple(stops)
        ),
        passes=POLICY_ONLY,
    )
    a, b = stops[0], stops[-1]
    lengths = [3, 5, R, R, 2]
    assert rollout.resp_mask.sum(1).tolist() == lengths
    assert rollout.has_stop.tolist() == [True, True, False, True, True]
    assert rollout.last_index.tolist() == [n - 1 for n in lengths]
    # the stop token itself is the last real token of its response
    assert [rollout.responses[i, rollout.last_index[i]].item() for i in (0, 1, 3, 4)] == [a, b, a, b]
    for i, n in enumerate(lengths):
        assert (rollout.responses[i, n:] == tok.pad_token_id).all()  # padded after the stop (pad may equal eos)
        assert (rollout.logprobs[i, n:] == INVALID_LOGPROB).all()
        assert (rollout.logprobs[i, :n] < 0).all()
    # response_mask on its own agrees (it never looks at the pad id)
    again = response_mask(rollout.responses, stops)
    assert torch.equal(again[0], rollout.resp_mask) and torch.equal(again[2], rollout.has_stop)

    metrics = completion_metrics(rollout)
    assert metrics["completions/clipped_ratio"].item() == pytest.approx(1 / 5)
    assert metrics["completions/mean_length"].item() == pytest.approx(sum(lengths) / 5)
    assert metrics["completions/mean_terminated_length"].item() == pytest.approx((3 + 5 + R + 2) / 4)

    texts = decode_responses(tok, rollout.responses, rollout.resp_mask)
    assert texts[0] == " cat cat" and texts[4] == " cat" and texts[2] == " cat" * R  # stop token not in the text


@pytest.mark.parametrize("name", FAMILIES)
def test_missing_eos_penalty_only_hits_rows_without_a_stop(family_root, name):
    from rlhf_core.rl.ppo import score_rollout

    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    ids, mask, policy = scripted_batch(tok, model, stops)
    rollout = collect_rollout(
        policy,
        None,
        ids,
        mask,
        SamplingSpec(SamplingSettings(response_length=R, greedy=True), tok.pad_token_id, tuple(stops)),
        passes=NEITHER,
    )
    counter = TokenCountReward()
    scores, values = score_rollout(rollout, counter, counter, missing_eos_penalty=10.0)
    # the score is read on the stop token: prompt + response up to and including it, padding not counted
    expected = (mask.sum(1) + rollout.resp_mask.sum(1)).float() - 10.0 * (~rollout.has_stop).float()
    torch.testing.assert_close(scores, expected)
    assert scores.tolist()[2] == pytest.approx(mask[2].sum().item() + R - 10.0)  # the one row that never stopped
    assert (values * (1 - rollout.resp_mask) == 0).all()


@pytest.mark.parametrize("name", ["qwen2.5", "llama-3-instruct"])
def test_no_stop_before_min_tokens_even_when_the_model_wants_one(family_root, name):
    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    ids, mask, _ = scripted_batch(tok, model, stops)
    script = torch.full((ids.shape[0], R), stops[-1])  # a stop at every step
    rollout = collect_rollout(
        ScriptedPolicy(model, ids.shape[1], script),
        None,
        ids,
        mask,
        SamplingSpec(SamplingSettings(response_length=R, greedy=True, min_tokens=3), tok.pad_token_id, tuple(stops)),
        passes=POLICY_ONLY,
    )
    assert rollout.has_stop.all() and rollout.last_index.tolist() == [3] * ids.shape[0]
    assert not torch.isin(rollout.responses[:, :3], torch.tensor(stops)).any()


@pytest.mark.parametrize("name", FAMILIES)
def test_the_decode_loops_ready_sdpa_mask_samples_what_the_models_own_mask_samples(family_root, name, monkeypatch):
    # the rollout hands SDPA models a ready 4-D boolean mask instead of the 2-D one: on every family's layout
    # (pad == eos, two stop ids, no pad with bos, GPT-2's learned positions) the samples must not change
    import rlhf_core.rollout.generation as generation

    tok, model = load(family_root, name)
    spec = family(name)
    assert generation._takes_ready_sdpa_mask(model)  # the path under test is the one these models take
    questions = [q for q, _ in prompts_and_answers()[:3]] + ["Hi."]
    prompts = [render_prompt(tok, spec, q) for q in questions]
    ids, mask = left_pad(tokenize_prompts(tok, prompts, 32), tok.pad_token_id)
    ids, mask = ids.repeat_interleave(2, dim=0), mask.repeat_interleave(2, dim=0)  # GRPO's groups share a prompt
    stops = stop_token_ids(tok, model.generation_config)
    settings = SamplingSettings(response_length=R, temperature=1.3, min_tokens=2)

    def sample():
        torch.manual_seed(5)
        return generation.generate(
            model, ids, mask, settings, pad_token_id=tok.pad_token_id, stop_token_ids=stops, prompt_repeats=2
        )

    ready = sample()
    monkeypatch.setattr(generation, "_takes_ready_sdpa_mask", lambda model: False)
    assert torch.equal(ready, sample())


@pytest.mark.parametrize("name", FAMILIES)
def test_the_generators_behaviour_logprobs_stop_where_the_response_stops(family_root, name):
    # generation ahead of training keeps the decode loop's log-probs as the behaviour policy: on every family's
    # layout (pad == eos, two stop ids, no pad) they are the trainer's pass of the sampled tokens, and a response's
    # stop token (either id) is scored while what follows it (a pad that may be the eos) is INVALID_LOGPROB
    from rlhf_core.models.forward import response_logprobs
    from rlhf_core.rollout.generation import generate

    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    ids, mask, policy = scripted_batch(tok, model, stops)  # rows stop at either stop id, or never
    kwargs = {"pad_token_id": tok.pad_token_id, "stop_token_ids": stops, "with_logprobs": True}
    torch.manual_seed(11)
    responses, logprobs = generate(policy, ids, mask, SamplingSettings(response_length=R), **kwargs)
    resp_mask, _, _ = response_mask(responses, stops)
    assert resp_mask.sum(1).tolist() == [3, 5, R, R, 2]
    real = resp_mask.bool()
    assert (logprobs[real] <= 0).all() and (logprobs[~real] == INVALID_LOGPROB).all()
    # the unscripted model (the script biases generation only): the trainer's log-probs of what it sampled
    torch.manual_seed(11)
    responses, logprobs = generate(model, ids, mask, SamplingSettings(response_length=R, temperature=1.3), **kwargs)
    resp_mask, _, _ = response_mask(responses, stops)
    with torch.no_grad():
        expected, _ = response_logprobs(model, ids, mask, responses, resp_mask, 1.3)
    real = resp_mask.bool()
    torch.testing.assert_close(logprobs[real], expected[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_vllms_completions_become_the_tensors_our_loop_makes(family_root, name):
    """The same tokens from either engine make the same rollout: a fake server answers what vLLM answers for the
    scripted rows (up to and including the first stop id, else response_length tokens), and the responses, masks,
    stop flags and last indices equal our loop's on pad == eos (Qwen2.5), no pad (GPT-2, Llama 3) and two stop ids."""
    from rlhf_core.rollout.engines import VllmEngine
    from rlhf_core.rollout.vllm_server import Completion

    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    ids, mask, policy = scripted_batch(tok, model, stops)
    settings = SamplingSettings(response_length=R, greedy=True)
    spec = SamplingSpec(settings, tok.pad_token_id, tuple(stops))
    ours = collect_rollout(policy, None, ids, mask, spec, passes=POLICY_ONLY)

    class ScriptServer:
        def complete(self, prompts, settings, stop_token_ids, *, n=1, seed=None):
            row = [p for p in (r[m.bool()].tolist() for r, m in zip(ids, mask))].index(list(prompts[0]))
            script = policy.script[row].tolist()
            end = next((t + 1 for t, token in enumerate(script) if token in stop_token_ids), R)
            return [Completion(script[:end], [-1.0] * end, end < R or script[end - 1] in stop_token_ids)]

    engine = VllmEngine(ScriptServer(), weights_dir=None)
    theirs = collect_rollout(policy, None, ids, mask, spec, engine=engine, seed=0, passes=POLICY_ONLY)
    for field in ("responses", "resp_mask", "last_index", "has_stop"):
        assert torch.equal(getattr(theirs, field), getattr(ours, field)), field
    torch.testing.assert_close(theirs.logprobs, ours.logprobs)  # the trainer's own, computed the same way
    assert (theirs.behaviour_logprobs[theirs.resp_mask.bool()] == -1.0).all()
    assert (theirs.behaviour_logprobs[~theirs.resp_mask.bool()] == INVALID_LOGPROB).all()
