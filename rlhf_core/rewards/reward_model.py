"""Reward-model training: a one-output sequence classifier fit with the Bradley-Terry loss.

Pure helpers first (loss, metrics, pair encoding, scoring at the last token, evaluation), then the
settings and the step for the shared `TrainingLoop`, and the training. Checkpoints are Hugging Face
directories `checkpoint-N/` with a model card, `metrics.json` and the training state without pickle,
so re-running after a crash resumes from the last one and reaches the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rlhf_core.config import LoraSettings, RewardConfig, RunConfig
from rlhf_core.data.batching import Grouped, ShardedBatches
from rlhf_core.data.chat import encode
from rlhf_core.models.card import write_model_card
from rlhf_core.models.forward import head_per_token
from rlhf_core.training.loop import (
    NO_HOOKS,
    Cadence,
    Hooks,
    LoopCallbacks,
    LoopMetrics,
    LoopResult,
    LoopSettings,
    TrainingLoop,
)

EVAL_METRICS = (
    "eval_loss",
    "eval_accuracy",
    "eval_margin",
    "eval_min_reward",
    "eval_mean_reward",
    "eval_max_reward",
    "eval_length_correlation",
)


def bradley_terry_loss(
    r_chosen: torch.Tensor,
    r_rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """Mean of -logsigmoid(r_chosen - r_rejected - margin), plus coef * mean((r_chosen + r_rejected)^2).

    r_chosen, r_rejected, margin: (B,). The centering term (Eisenstein et al., as in TRL) pulls the
    rewards toward zero mean, so the reward model's scale stays put.
    """
    diff = r_chosen - r_rejected  # (B,)
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((r_chosen + r_rejected) ** 2).mean()
    return loss


def pearson(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The Pearson correlation of x and y (N,), differentiable; 0 when either is constant."""
    x, y = x - x.mean(), y - y.mean()
    denominator = (x.square().sum() * y.square().sum()).sqrt()
    return (x * y).sum() / denominator if denominator > 0 else x.new_zeros(())


def length_correlation(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, len_chosen: torch.Tensor, len_rejected: torch.Tensor
) -> torch.Tensor:
    """The correlation, over pairs, of the reward difference chosen - rejected with the length difference
    (tokens). Where length predicts no preference, a reward model that scores quality alone has about 0;
    negative: the shorter answer is scored up for being short."""
    return pearson(r_chosen - r_rejected, (len_chosen - len_rejected).to(r_chosen.dtype))


def preference_stats(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """accuracy (chosen strictly above rejected), margin, and min/mean/max over all rewards, as 0-d tensors."""
    both = torch.cat([r_chosen, r_rejected])
    return {
        "accuracy": (r_chosen > r_rejected).float().mean(),
        "margin": (r_chosen - r_rejected).mean(),
        "min_reward": both.min(),
        "mean_reward": both.mean(),
        "max_reward": both.max(),
    }


def preference_metrics(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> dict[str, float]:
    """`preference_stats` as floats."""
    return {k: v.item() for k, v in preference_stats(r_chosen, r_rejected).items()}


def tokenize_pairs(tokenizer, rows: list[dict], max_length: int, stop_ids: Sequence[int] = ()) -> list[dict]:
    """Token ids of prompt+chosen and prompt+rejected per row, each closed, at most max_length long.

    A sequence is closed when it ends with eos or one of `stop_ids` (the ids RL generation stops on:
    a chat template's end of turn, '<|im_end|>'); any other gets eos appended, as TRL does. Every
    sequence then ends on the token where RL rollouts that stop end, and the score is read there.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    closing = set(eos) | {int(i) for i in stop_ids}

    def ids(texts: list[str]) -> list[list[int]]:
        # a templated conversation (it starts with bos) gets no second bos
        encoded = encode(tokenizer, texts, max_length=max_length - len(eos), truncation=True)
        return [seq if seq and seq[-1] in closing else seq + eos for seq in encoded]

    chosen = ids([r["prompt"] + r["chosen"] for r in rows])
    rejected = ids([r["prompt"] + r["rejected"] for r in rows])
    return [{"chosen": c, "rejected": rj, "margin": r.get("margin")} for c, rj, r in zip(chosen, rejected, rows)]


def collate_pairs(items: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Chosen then rejected in one right-padded batch: input_ids, attention_mask (2B, T), margin (B,) if any."""
    from torch.nn.utils.rnn import pad_sequence

    seqs = [torch.tensor(it["chosen"]) for it in items] + [torch.tensor(it["rejected"]) for it in items]
    input_ids = pad_sequence(seqs, batch_first=True, padding_value=pad_token_id)  # (2B, T)
    lengths = torch.tensor([len(s) for s in seqs])
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()  # (2B, T)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if any(it["margin"] is not None for it in items):
        batch["margin"] = torch.tensor([float(it["margin"] or 0.0) for it in items])
    return batch


class LastTokenScore(torch.nn.Module):
    """A one-output sequence classifier read at each row's last attended token (right padding).

    The classifier's own forward pools at the last token that is not the pad id, which with pad ==
    eos (Qwen2.5 base, GPT-2) is the token before the closing eos, while RL reads the score at the
    stop token. This reads both at the same place. Trained as a module of its own, so that DDP and
    DeepSpeed see the forward.
    """

    def __init__(self, reward_model):
        super().__init__()
        self.reward_model = reward_model

    @property
    def _no_split_modules(self) -> list[str]:
        return list(getattr(self.reward_model, "_no_split_modules", None) or [])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        per_token = head_per_token(self.reward_model, input_ids, attention_mask)  # (B, T)
        last = (attention_mask.sum(1) - 1).clamp(min=0)
        return per_token[torch.arange(per_token.shape[0], device=per_token.device), last]  # (B,)


def score_pairs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over chosen and rejected together -> (r_chosen, r_rejected), each (B,).

    `model`: a reward model, or a LastTokenScore (possibly wrapped by accelerate) around one.
    """
    scorer = model if isinstance(getattr(model, "module", model), LastTokenScore) else LastTokenScore(model)
    rewards = scorer(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])  # (2B,)
    half = rewards.shape[0] // 2
    return rewards[:half], rewards[half:]


def evaluate_reward_model(
    model,
    tokenizer,
    rows: list[dict],
    *,
    max_length: int,
    batch_size: int,
    center_rewards_coefficient: float | None = None,
    stop_ids: Sequence[int] = (),
    device=None,
) -> dict[str, float]:
    """The reference's eval metrics over all `rows`: eval_loss, eval_accuracy, eval_margin, eval_*_reward."""
    return evaluate_encoded(
        model,
        tokenize_pairs(tokenizer, rows, max_length, stop_ids),
        tokenizer.pad_token_id,
        batch_size=batch_size,
        center_rewards_coefficient=center_rewards_coefficient,
        device=device,
    )


@torch.no_grad()
def encoded_scores(
    model, items: list[dict], pad_token_id: int, *, batch_size: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scores of pairs tokenized by `tokenize_pairs`: (r_chosen, r_rejected, margin), each (N,), on the CPU."""
    was_training = model.training
    model.eval()
    chosen, rejected, margins = [], [], []
    for i in range(0, len(items), batch_size):
        batch = collate_pairs(items[i : i + batch_size], pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()} if device is not None else batch
        rc, rr = score_pairs(model, batch)
        chosen.append(rc.float().cpu())
        rejected.append(rr.float().cpu())
        margins.append(batch["margin"].cpu() if "margin" in batch else torch.zeros_like(rc.cpu()))
    model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected), torch.cat(margins)


def evaluate_encoded(
    model,
    items: list[dict],
    pad_token_id: int,
    *,
    batch_size: int,
    center_rewards_coefficient: float | None = None,
    device=None,
) -> dict[str, float]:
    """`evaluate_reward_model` on pairs already tokenized by `tokenize_pairs`."""
    rc, rr, margin = encoded_scores(model, items, pad_token_id, batch_size=batch_size, device=device)
    metrics = {"eval_loss": bradley_terry_loss(rc, rr, margin, center_rewards_coefficient).item()}
    metrics.update({f"eval_{k}": v for k, v in preference_metrics(rc, rr).items()})
    lengths = [torch.tensor([len(it[k]) for it in items], dtype=torch.float) for k in ("chosen", "rejected")]
    metrics["eval_length_correlation"] = length_correlation(rc, rr, *lengths).item()
    return metrics


def length_bias(
    score_a: torch.Tensor, score_b: torch.Tensor, length_a: torch.Tensor, length_b: torch.Tensor
) -> dict[str, float]:
    """A reward model's length bias, from pairs of answers that are equally good but differ in length (N,):
    `length_correlation`, the correlation of the score difference a - b with the length difference a - b
    (0: length alone moves no score; negative: the shorter answer wins), and `longer_preferred`, the share
    of pairs where the longer answer scores higher (0.5: no preference)."""
    longer_wins = ((score_a - score_b) * (length_a - length_b).sign() > 0).double()
    decided = length_a != length_b
    return {
        "length_correlation": length_correlation(score_a.double(), score_b.double(), length_a, length_b).item(),
        "longer_preferred": float(longer_wins[decided].mean()) if decided.any() else float("nan"),
    }


def load_reward_model(
    source: str,
    tokenizer,
    *,
    lora: LoraSettings | None = None,
    torch_dtype: str = "float32",
    trust_remote_code: bool = False,
    revision: str | None = None,
    seed: int = 0,
):
    """AutoModelForSequenceClassification with one output from `source`; with `lora`, PEFT SEQ_CLS adapters.

    A causal-LM source gets a freshly initialized score head (seeded, so runs repeat).
    """
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.models.loading import MODEL_BUILDING, from_pretrained_checked

    with MODEL_BUILDING:  # the seed and the draws of the new head's initialization, with no other model built between
        torch.manual_seed(seed)
        model = from_pretrained_checked(
            AutoModelForSequenceClassification,
            source,
            "reward.base",
            num_labels=1,
            dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
            revision=revision,
        )
    model.config.pad_token_id = tokenizer.pad_token_id
    if lora is not None:
        from peft import get_peft_model

        from rlhf_core.models.loading import lora_config

        with MODEL_BUILDING:
            model = get_peft_model(model, lora_config(lora, "SEQ_CLS"))
    return model


def reward_loop_settings(cfg: RewardConfig, run: RunConfig) -> LoopSettings:
    """The shared loop's settings for reward training, from the `reward` section."""
    return LoopSettings(
        name="reward",
        section="reward",
        total_steps=cfg.max_steps,
        optim=cfg,
        micro_batches=cfg.gradient_accumulation_steps,
        micro_batch_size=cfg.batch_size,
        disable_dropout=cfg.disable_dropout,  # the same pair scores the same in every forward (TRL's default)
        cadence=Cadence(log_every=cfg.log_steps, eval_every=cfg.eval_steps, save_every=cfg.save_steps),
        log_window="mean",
        loop_metrics=LoopMetrics(lr="reward/learning_rate", grad_norm="reward/grad_norm", epoch="reward/epoch"),
        shown=("reward/loss", "reward/accuracy"),
        checkpoint_metrics="eval",
        keep_last=run.keep_last_checkpoints,
        best_metric=("eval_accuracy",),
    )


def pair_step(
    loop: TrainingLoop, items: list[dict], pad_id: int, cfg: RewardConfig
) -> Callable[[list[list[int]]], dict[str, torch.Tensor]]:
    """The loop's step: the Bradley-Terry loss of each micro-batch of `items` (lists of indices into it),
    backward, one optimizer step; returns the means of the loss and `preference_stats` as `reward/...`."""

    def step(micro_batches: list[list[int]]) -> dict[str, torch.Tensor]:
        stats = []
        for indices in micro_batches:
            batch = {k: v.to(loop.device) for k, v in collate_pairs([items[i] for i in indices], pad_id).items()}
            with loop.micro_batch():
                rc, rr = score_pairs(loop.trainable, batch)
                loss = bradley_terry_loss(rc, rr, batch.get("margin"), cfg.center_rewards_coefficient)
                loop.backward(loss / len(micro_batches))
            # statistics stay on the device until the log step: no host round trip per step
            stats.append({"loss": loss.detach(), **preference_stats(rc.detach().float(), rr.detach().float())})
        loop.optimizer_step()
        return {f"reward/{k}": torch.stack([s[k] for s in stats]).mean() for k in stats[0]}

    return step


@dataclass(frozen=True)
class PreferencePairs:
    """A reward model's training data: the train and eval rows of preference pairs, tokenized up to `max_length`,
    each response ending with one of `stop_ids` (the ids the policy stops on; see `tokenize_pairs`)."""

    train: list[dict]
    eval: list[dict]
    max_length: int
    stop_ids: Sequence[int] = ()


def train_reward_model(
    model,
    tokenizer,
    pairs: PreferencePairs,
    cfg: RewardConfig,
    run: RunConfig,
    *,
    output_dir: str | Path,
    card: dict,
    hooks: Hooks = NO_HOOKS,
) -> LoopResult:
    """Train for cfg.max_steps optimizer steps, resuming from the newest complete checkpoint in output_dir.

    Each checkpoint is a loadable Hugging Face directory (merged weights with LoRA, the adapter in `adapter/`) with
    a model card from `card` ({"title", "metadata", "body"}) and the eval metrics of its step; the result's metrics
    are the last evaluation's. hooks.on_eval receives them at every evaluation.
    """
    settings = reward_loop_settings(cfg, run)
    # the scorer reads each row's last attended token; trained as one module so that DDP and DeepSpeed see the forward
    loop = TrainingLoop(LastTokenScore(model), {"": model}, tokenizer, settings, run, output_dir=output_dir)
    loop.trainable.train()
    train_items = tokenize_pairs(tokenizer, pairs.train, pairs.max_length, pairs.stop_ids)
    eval_items = tokenize_pairs(tokenizer, pairs.eval, pairs.max_length, pairs.stop_ids)
    pad_id = tokenizer.pad_token_id
    # data parallel: every process its own batch of cfg.batch_size pairs per micro-batch
    order = ShardedBatches(
        len(pairs.train),
        cfg.batch_size,
        run.seed,
        rank=loop.rank,
        world=loop.world,
        epoch=loop.epoch,
        position=loop.position,
    )

    def evaluate(at_step: int) -> dict[str, float]:
        return evaluate_encoded(
            model,
            eval_items,
            pad_id,
            batch_size=cfg.batch_size,
            center_rewards_coefficient=cfg.center_rewards_coefficient,
            device=loop.device,
        )

    def card_file(directory: Path, metrics: dict[str, float]) -> None:
        write_model_card(
            directory, title=card["title"], metadata={**card["metadata"], "eval_metrics": metrics}, body=card["body"]
        )

    callbacks = LoopCallbacks(
        on_log=hooks.on_log,
        on_step=hooks.on_step,
        evaluate=evaluate,
        on_eval=hooks.on_eval,
        on_checkpoint=hooks.on_checkpoint,
        extra_files=card_file,
    )
    step = pair_step(loop, train_items, pad_id, cfg)
    batches = Grouped(order, cfg.gradient_accumulation_steps)
    return loop.run(step, batches, callbacks, show_progress=hooks.show_progress)
