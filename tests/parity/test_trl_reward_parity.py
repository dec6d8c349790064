"""Parity of `rlhf_core.rewards.reward_model` with TRL 1.16's `RewardTrainer`, driven through TRL's own code.

A real `trl.RewardTrainer` is built offline around a tiny seeded `LlamaForSequenceClassification`
(one output, pad_token_id set) and a word-level tokenizer made in memory. Compared, on the same
rows and the same model:

- tokenization: TRL's dataset preparation (eos appended, prompt + chosen / rejected tokenized)
  == `tokenize_pairs` (exact);
- batching: TRL's `DataCollatorForPreference` == `collate_pairs` (exact);
- the Bradley-Terry loss with and without margin and center_rewards_coefficient: TRL's
  `compute_loss` == `bradley_terry_loss(*score_pairs(model, batch), ...)`, value and every
  parameter's gradient (atol 1e-6, rtol 1e-5), and TRL's logged accuracy / margin / min / mean /
  max reward == `preference_stats` (atol 1e-6, rtol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.rewards.reward_model import (
    bradley_terry_loss,
    collate_pairs,
    preference_stats,
    score_pairs,
    tokenize_pairs,
)
from tests.parity.trl_grpo_common import EOS, PAD, VOCAB

MAX_LENGTH = 32
TOL = dict(atol=1e-6, rtol=1e-5)

ROWS = [
    {"prompt": "w3 w4", "chosen": " w5 w6 w7", "rejected": " w8", "margin": 0.5},
    {"prompt": "w9", "chosen": " w10", "rejected": " w11 w12 w13 w14", "margin": -0.25},
    {"prompt": "w15 w16 w17", "chosen": " w18 w19", "rejected": " w20 w21", "margin": 1.0},
    {"prompt": "w22 w23 w24 w25", "chosen": " w26 w27 w28 w29 w30 w31</s>", "rejected": " w32</s>", "margin": 0.0},
]


def build_reward_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

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
        num_labels=1,
    )
    return LlamaForSequenceClassification(config)


@pytest.fixture(scope="module")
def make_reward_trainer(tokenizer, tmp_path_factory):
    """make_reward_trainer(rows, center_rewards_coefficient) -> a real trl.RewardTrainer on `rows` (untokenized);
    `tokenizer` is conftest.py's (the GRPO tests' word-level tokenizer)."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    def make(rows, center_rewards_coefficient=None):
        args = RewardConfig(
            output_dir=str(tmp_path_factory.mktemp("trl_reward")),
            use_cpu=True,
            bf16=False,
            report_to=[],
            per_device_train_batch_size=len(rows),
            gradient_checkpointing=False,
            max_length=MAX_LENGTH,
            center_rewards_coefficient=center_rewards_coefficient,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = RewardTrainer(
            model=build_reward_model(), args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
        )
        trainer.model.train()
        return trainer

    return make


def trl_items(trainer, with_margin: bool) -> list[dict]:
    keys = ("chosen_ids", "rejected_ids", "margin") if with_margin else ("chosen_ids", "rejected_ids")
    return [{k: trainer.train_dataset[i][k] for k in keys} for i in range(len(trainer.train_dataset))]


@pytest.mark.parametrize("with_margin", [True, False])
def test_tokenized_pairs_and_batches_match_trl(make_reward_trainer, tokenizer, with_margin):
    """TRL's prepared dataset (chosen_ids / rejected_ids: prompt + response + eos, eos not doubled)
    == `tokenize_pairs`, and TRL's `DataCollatorForPreference` batch (chosen rows then rejected
    rows, right-padded; margin) == `collate_pairs` (exact equality)."""
    rows = ROWS if with_margin else [{k: v for k, v in r.items() if k != "margin"} for r in ROWS]
    trainer = make_reward_trainer(rows)
    assert len(trainer.train_dataset) == len(rows)
    ours = tokenize_pairs(tokenizer, rows, MAX_LENGTH)
    theirs = trl_items(trainer, with_margin)
    assert [(o["chosen"], o["rejected"]) for o in ours] == [(t["chosen_ids"], t["rejected_ids"]) for t in theirs]
    assert all(o["chosen"].count(EOS) == 1 and o["chosen"][-1] == EOS for o in ours)

    trl_batch = trainer.data_collator(theirs)
    our_batch = collate_pairs(ours, tokenizer.pad_token_id)
    assert (
        set(our_batch) == set(trl_batch) == ({"input_ids", "attention_mask"} | ({"margin"} if with_margin else set()))
    )
    for key in trl_batch:
        assert torch.equal(our_batch[key], trl_batch[key]), key


@pytest.mark.parametrize("center_rewards_coefficient", [None, 0.01, 0.5])
@pytest.mark.parametrize("with_margin", [True, False])
def test_bradley_terry_loss_gradient_and_metrics_match_trl(
    make_reward_trainer, tokenizer, with_margin, center_rewards_coefficient
):
    """TRL's `RewardTrainer.compute_loss` (chosen/rejected split of one forward, -logsigmoid of the
    difference minus the margin, + coef x mean((r_c + r_r)^2)) == `bradley_terry_loss` on
    `score_pairs` of the same batch: loss and every parameter's gradient (atol 1e-6, rtol 1e-5),
    and TRL's logged accuracy / margin / min / mean / max reward == `preference_stats`."""
    rows = ROWS if with_margin else [{k: v for k, v in r.items() if k != "margin"} for r in ROWS]
    trainer = make_reward_trainer(rows, center_rewards_coefficient)
    model = trainer.model
    batch = trainer.data_collator(trl_items(trainer, with_margin))

    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss_trl = trainer.compute_loss(model, dict(batch))
    loss_trl.backward()
    grads_trl = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    model.zero_grad(set_to_none=True)
    r_chosen, r_rejected = score_pairs(model, batch)
    loss_ours = bradley_terry_loss(r_chosen, r_rejected, batch.get("margin"), center_rewards_coefficient)
    loss_ours.backward()
    grads_ours = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    torch.testing.assert_close(loss_ours.detach(), loss_trl.detach(), **TOL)
    assert grads_ours.keys() == grads_trl.keys() and len(grads_ours) == len(list(model.parameters()))
    for name in grads_trl:
        torch.testing.assert_close(grads_ours[name], grads_trl[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    assert max(g.abs().max() for g in grads_trl.values()) > 1e-3

    stats = preference_stats(r_chosen.detach(), r_rejected.detach())
    for key in ("accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        torch.testing.assert_close(stats[key].item(), metrics[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
    assert 0 < stats["accuracy"] < 1  # both orders occur: the comparison is not one-sided
