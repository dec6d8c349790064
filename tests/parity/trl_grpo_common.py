"""Parity of `rlhf_core.rl.grpo` with TRL 1.16's `GRPOTrainer`: what the test_trl_grpo_*.py modules share.

Nothing there re-implements TRL: every expected value comes out of a real `trl.GRPOTrainer` built
offline (the `make_trainer` fixture, tests/parity/conftest.py) around a tiny seeded Llama (vocabulary 64,
one layer) and a word-level tokenizer made in memory. Our side gets the very same tensors.

- Advantages (test_trl_grpo_advantages.py): TRL's `_generate_and_score_completions` runs for real, with
  only generation (`_generate`: fixed completions) and reward calling (`_calculate_rewards`: a fixed
  rewards-per-function tensor with NaN for None) replaced (`drive_trl_scoring` below); its `advantages`
  output is compared with `grpo_advantages` on the same per-source rewards. Tolerance: atol 1e-6, rtol 1e-5
  (float32).
- Losses (test_trl_grpo_losses.py): `trainer._compute_loss(model, inputs)` (TRL's fused,
  temperature-scaled log-probability head included) against
  `reduce_loss(grpo_token_loss(response_logprobs(...)))`: the loss value, the gradient of every model
  parameter and TRL's logged statistics (entropy, kl, clip ratios). Tolerance: atol 1e-6, rtol 1e-5 on the
  loss and the statistics, atol 1e-6 on each gradient entry (gradients are O(0.1)).
- The training loop (test_trl_grpo_train_step.py): one real `train_grpo` step with fixed reward values; the
  advantages and the reward statistics it reports are compared with what TRL computes and logs for the same
  rewards.
"""

from __future__ import annotations

import torch

NAN = float("nan")
VOCAB = 64
PAD, EOS = 0, 1
MAX_COMPLETION = 6
TOL = dict(atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# offline builders: tokenizer, tiny model (the TRL trainer: make_trainer, conftest.py)
# ------------------------------------------------------------------------------------------


def build_tokenizer():
    """A word-level tokenizer: <pad> 0, </s> 1, <unk> 2, then w0..w60 (ids 3..63)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_policy(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def named_reward(name: str):
    def reward(completions, **_):  # never called: `_calculate_rewards` is replaced
        raise AssertionError("TRL's reward functions should not run in these tests")

    reward.__name__ = name
    return reward


# ------------------------------------------------------------------------------------------
# advantages: TRL's _generate_and_score_completions against grpo_advantages
# ------------------------------------------------------------------------------------------


def fake_completions(batch: int, truncated_every: int = 0) -> list[list[int]]:
    """Completion ids as TRL's generation returns them: up to and including eos, or cut at the maximum."""
    out = []
    for i in range(batch):
        if truncated_every and i % truncated_every == 0:
            out.append([3 + (i + j) % 60 for j in range(MAX_COMPLETION)])  # never stopped
        else:
            n = 1 + i % (MAX_COMPLETION - 1)
            out.append([3 + (i * 7 + j) % 60 for j in range(n)] + [EOS])
    return out


def drive_trl_scoring(
    trainer,
    per_source: torch.Tensor,
    completions: list[list[int]] | None = None,
    sampling_logps: list[list[float]] | None = None,
) -> dict:
    """Run TRL's real `_generate_and_score_completions` on fixed completions and fixed rewards (B, F); with
    `sampling_logps`, the generator's log-probs of the completion tokens (what vLLM returns) come along too."""
    batch = per_source.shape[0]
    G = trainer.num_generations
    prompt_ids = [[3 + g % 20, 4 + g % 20, 5 + g % 20] for g in range(batch // G) for _ in range(G)]
    completion_ids = completions if completions is not None else fake_completions(batch)
    texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, sampling_logps, {}, None, [])
    trainer._calculate_rewards = lambda inputs, prompts, completions, ids: per_source.clone()
    trainer._metrics["train"].clear()
    inputs = [{"prompt": f"w{3 + i // G} w{4 + i // G}"} for i in range(batch)]
    return trainer._generate_and_score_completions(inputs)
