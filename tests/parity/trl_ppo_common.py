"""PPO parity with TRL 1.12's PPOTrainer: what the test_trl_ppo_*.py modules share.

The same tensors go through our PPO math and through TRL's own code. TRL 1.12.0 (the last release with
PPOTrainer) lives apart from the venv's TRL 1.16, in .venv/trl-1.12.0 (`make venv`), and runs only in a
subprocess (tests/parity/trl112_ppo_side.py) whose PYTHONPATH starts with it: that script runs the real
`PPOTrainer.train()` for exactly one batch on tiny seeded Llama models built here, with the responses fixed
by the tests, and records TRL's scores, values, log-probabilities, per-token rewards, advantages (raw and
whitened) and returns. The `world` fixture (tests/parity/conftest.py) runs that side once per session.
The tests then run OUR pieces on the same inputs: `response_mask`, `score_rollout` / `sequence_scores` /
`token_values`, `response_logprobs` (test_trl_ppo_rollout.py), and the math of `train_ppo` (kl_per_token *
mask -> kl_penalized_rewards -> [masked_whiten rewards] -> compute_gae -> masked_whiten advantages * mask:
`our_math` below; test_trl_ppo_advantages.py), and compare. test_train_ppo_end_to_end
(test_trl_ppo_train_step.py) then runs our real `train_ppo` for one iteration on the same models, prompts and
responses (generation replaced, nothing else) and checks that what it computes is that math, and for
responses that never stop, TRL's tensors themselves.
Each prompt has a fixed response on both sides; rows are put in prompt order before comparing.

Runs (batch 8, response length 8, kl_coef > 0, gamma 0.99, lam 0.9, temperature 0.7):
- full_*: no response stops (all run to response_length): TRL and we must agree exactly.
- stop_*: pad != eos, responses stop early: the one documented difference is where the score goes.
  We add it on the stop token itself (the last real token); TRL adds it one past the last real token
  (sequence_lengths + 1, "padding_mask_p1"), unless that is past the end, and keeps the value there too.
  TRL's result equals ours with the score moved one position later and the values kept to last + 1.
- padeos_*: pad == eos (GPT-2 / Qwen2.5-base shape). TRL finds the end as "first pad" - 1, i.e. the token
  before the eos: see test_pad_equals_eos.
Each run in a k1 and a k3 / whiten_rewards variant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rlhf_core.rl_math import compute_gae, kl_penalized_rewards, kl_per_token, masked_whiten, response_mask
from tests.parity.max_diffs import record_max_diff

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trl112_ppo_side.py")

# float32 throughout; the math on identical inputs agrees to ~1e-7, model forwards to ~1e-6
ATOL_MATH = 1e-5
ATOL_MODEL = 1e-5

VOCAB, RESPONSE_LENGTH, BATCH = 64, 8, 8
PAD, UNK, BOS, EOS = 0, 1, 2, 3  # ids in the test vocabulary; words are 4..63
SETTINGS = dict(temperature=0.7, gamma=0.99, lam=0.9)

TRL112_CANDIDATES = tuple(
    dict.fromkeys([Path(sys.executable).parents[1] / "trl-1.12.0", REPO / ".venv" / "trl-1.12.0"])
)


def trl112_dir() -> Path | None:
    for candidate in TRL112_CANDIDATES:
        if (candidate / "trl" / "experimental" / "ppo" / "ppo_trainer.py").is_file():
            return candidate
    return None


MISSING = (
    "TRL 1.12.0 is not installed apart: expected "
    + " or ".join(str(c) for c in TRL112_CANDIDATES)
    + " to hold trl/experimental/ppo/ppo_trainer.py. Run `make venv`, or: .venv/bin/python -m pip install"
    " --no-deps --target .venv/trl-1.12.0 trl==1.12.0"
)


# ------------------------------------------------------------------------------------------ inputs


def build_tokenizer(pad_is_eos: bool):
    """A word-level fast tokenizer over the 64 ids; pad is its own token, or the eos (GPT-2 shape)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<unk>": UNK, "<bos>": BOS, "<eos>": EOS, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<eos>" if pad_is_eos else "<pad>",
        padding_side="left",
    )


def build_models() -> dict[str, torch.nn.Module]:
    """Tiny seeded Llamas; a wide init so that log-probabilities, KL, values and scores are O(0.1-1)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    def config(**extra):
        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            initializer_range=0.3,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
            **extra,
        )

    out = {}
    for seed, (name, cls) in enumerate(
        [
            ("policy", LlamaForCausalLM),
            ("value", LlamaForSequenceClassification),
            ("reward", LlamaForSequenceClassification),
        ]
    ):
        torch.manual_seed(1000 + seed)
        out[name] = cls(config(num_labels=1) if cls is LlamaForSequenceClassification else config()).float().eval()
    # the reference: the policy a little moved (per-token KL ~0.3-0.5; two independent inits give ~3-70)
    torch.manual_seed(1003)
    out["ref"] = LlamaForCausalLM(config()).float().eval()
    with torch.no_grad():
        for ref_param, param in zip(out["ref"].parameters(), out["policy"].parameters()):
            ref_param.copy_(param + 0.02 * torch.randn_like(param))
    return out


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [[BOS] + torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (1, 3, 2, 4, 2, 3, 1, 4)]


def make_responses(stops: list[int | None], pad: int, seed: int) -> list[list[int]]:
    """Word tokens; row i has the eos at stops[i] and pad after it (as HF generate pads), or no eos at all."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(4, VOCAB, (len(stops), RESPONSE_LENGTH), generator=g)
    for i, s in enumerate(stops):
        if s is not None:
            rows[i, s] = EOS
            rows[i, s + 1 :] = pad
    return rows.tolist()


FULL = [None] * BATCH
# early stops everywhere, a stop at 0 (ours and TRL agree on it when pad != eos), one on the last position
# (TRL's last + 1 is then past the end: same as ours), and two rows that never stop
STOPS = [2, None, 0, 7, 5, 1, None, 3]
STOPS_PADEOS = [2, None, 4, 7, 5, 1, None, 3]  # no stop at 0: see test_pad_equals_eos

RUNS = {
    # name: (pad is eos, stop positions, response seed, kl estimator, whiten rewards, missing_eos_penalty)
    "full_k1": (False, FULL, 11, "k1", False, None),
    "full_k3_whiten": (False, FULL, 12, "k3", True, 1.0),
    "stop_k1": (False, STOPS, 13, "k1", False, 1.0),
    "stop_k3_whiten": (False, STOPS, 14, "k3", True, None),
    "padeos_k1": (True, STOPS_PADEOS, 15, "k1", False, 1.0),
    "padeos_k3_whiten": (True, STOPS_PADEOS, 16, "k3", True, None),
}
KL_COEF = {"k1": 0.2, "k3": 0.5}

# -------------------------------------------------------------------------------------------- our side


def close(name: str, ours: torch.Tensor, theirs: torch.Tensor, atol: float = ATOL_MATH) -> None:
    ours, theirs = ours.double(), theirs.double()
    diff = (ours - theirs).abs().max().item() if ours.numel() else 0.0
    record_max_diff(name, diff)
    assert ours.shape == theirs.shape, f"{name}: shapes {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    assert diff <= atol, f"{name}: max abs diff {diff:.3g} > {atol:g}\nours:\n{ours}\nTRL 1.12:\n{theirs}"


def our_math(r: dict, logprobs, ref_logprobs, values, scores, mask, last_index):
    """train_ppo's steps 3-4 (rlhf_core/rl/ppo.py), line for line, on the given tensors."""
    ppo = r["ppo"]
    kl = kl_per_token(logprobs, ref_logprobs, ppo["kl_estimator"]) * mask
    rewards, non_score = kl_penalized_rewards(scores, kl, mask, last_index, ppo["kl_coef"])
    raw_rewards = rewards
    if ppo["whiten_rewards"]:
        rewards = masked_whiten(rewards, mask, shift_mean=False) * mask
    advantages, returns = compute_gae(rewards, values * mask, mask, ppo["gamma"], ppo["lam"])
    whitened = masked_whiten(advantages, mask) * mask
    return dict(
        kl=kl,
        non_score=non_score,
        raw_rewards=raw_rewards,
        rewards=rewards,
        raw_advantages=advantages,
        advantages=whitened,
        returns=returns,
    )


def trl_way(r: dict, logprobs, ref_logprobs, values, scores, mask, last_index):
    """Our pieces, composed as TRL 1.12 places the score: on last + 1 (last if that is past the end), with
    the values, the reward whitening and the GAE kept to last + 1, the advantages whitened over `mask`."""
    ppo = r["ppo"]
    width = mask.shape[1]
    end = torch.where(last_index + 1 < width, last_index + 1, last_index)
    mask_p1 = (torch.arange(width).view(1, -1) <= end.view(-1, 1)).long()
    kl = kl_per_token(logprobs, ref_logprobs, ppo["kl_estimator"]) * mask
    rewards, _ = kl_penalized_rewards(scores, kl, mask, end, ppo["kl_coef"])  # the score on `end`, not `last`
    raw_rewards = rewards
    if ppo["whiten_rewards"]:
        rewards = masked_whiten(rewards, mask_p1, shift_mean=False) * mask_p1
    advantages, returns = compute_gae(rewards, values * mask_p1, mask_p1, ppo["gamma"], ppo["lam"])
    whitened = masked_whiten(advantages, mask) * mask
    return dict(
        raw_rewards=raw_rewards,
        rewards=rewards,
        raw_advantages=advantages,
        advantages=whitened,
        returns=returns,
        mask_p1=mask_p1,
        end=end,
    )


def trl_outputs(r: dict) -> dict[str, torch.Tensor]:
    """TRL 1.12's tensors as recorded inside train()."""
    out = dict(
        kl=r["frame_kl"],
        non_score=r["frame_non_score_reward"],
        rewards=r["frame_rewards"],
        raw_advantages=r["whiten_advantages_in"],
        advantages=r["frame_advantages"],
        returns=r["frame_returns"],
    )
    out["raw_rewards"] = r["whiten_rewards_in"] if r["ppo"]["whiten_rewards"] else r["frame_rewards"]
    return out


def inputs(r: dict):
    """The rollout as both sides see it, and our response_mask of it."""
    queries, responses = r["frame_queries"], r["frame_responses"]
    query_mask = (queries != r["pad"]).long()  # prompts hold no pad id; left padding only
    mask, last, has_stop = response_mask(responses, [EOS])
    return queries, query_mask, responses, mask, last, has_stop
