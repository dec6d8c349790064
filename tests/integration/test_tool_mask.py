"""The mask of a tool episode is proven on the update itself: tool tokens given a huge fake advantage change no
gradient of the GRPO loss (its clipped term, its KL term, its token mean), while the same advantage on the
model's tokens, or the same batch without the mask, does."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import DemoModelConfig, GRPOConfig, RLConfig
from rlhf_core.demo.arithmetic import build_arithmetic_model
from rlhf_core.demo.calculator import build_calculator_tokenizer, call_transcript, question
from rlhf_core.models.forward import response_logprobs
from rlhf_core.rl.grpo_losses import LossInputs, policy_loss_for
from rlhf_core.rollout.collect import Rollout
from rlhf_core.rollout.generation import left_pad

TOK = build_calculator_tokenizer(64)
HUGE = 1.0e6


def episode_rollout(pairs) -> Rollout:
    """Each (a, b) solved with the tool, as ids: the prompt, then the call, the tool's turn and the answer; the
    model's tokens marked from the template's own tool turn."""
    prompts, responses, marks = [], [], []
    for a, b in pairs:
        prompt = TOK.apply_chat_template(question(a, b), add_generation_prompt=True, tokenize=True, return_dict=False)
        full = TOK.apply_chat_template(question(a, b) + call_transcript(a, b), tokenize=True, return_dict=False)
        response = full[len(prompt) :]
        tool_start = response.index(TOK.convert_tokens_to_ids("<tool>"))
        tool_end = response.index(TOK.convert_tokens_to_ids("<assistant>"), tool_start) + 1
        prompts.append(prompt), responses.append(response)
        marks.append([0 if tool_start <= i < tool_end else 1 for i in range(len(response))])
    query_ids, query_mask = left_pad(prompts, TOK.pad_token_id)
    width = max(map(len, responses))
    padded = torch.full((len(pairs), width), TOK.pad_token_id)
    resp_mask, model_tokens = torch.zeros_like(padded), torch.zeros_like(padded)
    for i, (r, m) in enumerate(zip(responses, marks)):
        padded[i, : len(r)], resp_mask[i, : len(r)], model_tokens[i, : len(r)] = torch.tensor(r), 1, torch.tensor(m)
    has_stop = torch.ones(len(pairs), dtype=torch.bool)
    last = resp_mask.sum(1) - 1
    return Rollout(query_ids, query_mask, padded, resp_mask, last, None, None, has_stop, model_tokens=model_tokens)


def gradient(model, rollout: Rollout, advantages: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    model.zero_grad()
    args = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.resp_mask)
    logp, entropy = response_logprobs(model, *args, 1.0, with_entropy=True)
    ref = logp.detach() - 0.3  # a reference apart, so that the KL term has a gradient too
    loss_fn = policy_loss_for(
        RLConfig(algorithm="grpo", response_length=rollout.responses.shape[1]),
        GRPOConfig(beta=0.1, loss_type=loss_type),
        mini_batch=len(advantages),
    )
    loss, _ = loss_fn(LossInputs(logp, logp.detach(), entropy, advantages, mask, ref, float(mask.sum())))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_a_huge_advantage_on_tool_tokens_changes_nothing(loss_type):
    model = build_arithmetic_model(
        TOK, DemoModelConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64), 0
    )
    pairs = [(123, 456), (789, 101), (555, 999)]
    rollout = episode_rollout(pairs)
    torch.manual_seed(0)
    advantages = torch.randn(rollout.responses.shape) * rollout.model_tokens  # per token, as REINFORCE++'s
    tool_tokens = (rollout.resp_mask - rollout.model_tokens).bool()
    assert int(tool_tokens.sum()) == sum(len(str(a * b)) + 3 for a, b in pairs)  # <tool> digits <eos> <assistant>
    fake = advantages.masked_fill(tool_tokens, HUGE)
    mask = rollout.trained_mask(False)
    base = gradient(model, rollout, advantages, mask, loss_type)
    assert torch.equal(gradient(model, rollout, fake, mask, loss_type), base)
    # the test can fail: the same advantage on the model's own tokens moves the gradient, and so does forgetting the mask
    on_model = advantages.masked_fill(rollout.model_tokens.bool() & (torch.arange(advantages.shape[1]) == 0), HUGE)
    assert not torch.allclose(gradient(model, rollout, on_model, mask, loss_type), base)
    assert not torch.allclose(gradient(model, rollout, fake, rollout.resp_mask, loss_type), base)
