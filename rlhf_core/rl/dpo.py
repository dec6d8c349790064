"""Offline DPO (rl.algorithm dpo): the policy trained on data.preference's pairs with the loss family of
`dpo_losses.py` (TRL 1.16 DPOTrainer's), against a frozen reference: a copy, the policy with its LoRA adapters
disabled, its log-probs computed once before training (dpo.precompute_ref_log_probs), or none at all
(dpo.reference_free). TR-DPO's reference sync (dpo.sync_ref_model) mixes the policy into the copy every
dpo.ref_model_sync_steps steps, and the copy is saved with each checkpoint so that a resumed run goes on from it.

A pair is tokenized as TRL 1.16 does (`tokenize_preferences`): the prompt, and each completion from where the
tokenized prompt and prompt+completion first differ, closed with eos (or a stop id) when it does not end on one.
One step is one optimizer step over rl.batch_size pairs in rl.gradient_accumulation_steps micro-batches; the
prompts go in left-padded and the completions right-padded, the layout every forward of the RL stage reads
(`response_logprobs`), chosen rows first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_core.config import DPOConfig
from rlhf_core.data.batching import Grouped, ShardedBatches
from rlhf_core.data.chat import encode
from rlhf_core.data.rows import DataValidationError
from rlhf_core.models.forward import response_logprobs
from rlhf_core.rl.dpo_losses import DPOLossSpec, dpo_loss, sequence_logps
from rlhf_core.rl.grpo import mix_into_reference
from rlhf_core.rl.inputs import RLInputs
from rlhf_core.rl.step import BatchSizes, loop_callbacks, rl_loop_settings
from rlhf_core.rollout.collect import reference_context
from rlhf_core.rollout.generation import left_pad
from rlhf_core.training.loop import LoopResult, TrainingLoop


def loss_spec(dpo: DPOConfig) -> DPOLossSpec:
    """The loss family's settings from the dpo section."""
    weights = tuple(dpo.loss_weights) if dpo.loss_weights is not None else None
    return DPOLossSpec(
        loss_types=tuple(dpo.loss_type),
        loss_weights=weights,
        beta=dpo.beta,
        label_smoothing=dpo.label_smoothing,
        discopop_tau=dpo.discopop_tau,
        reference_free=dpo.reference_free,
    )


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_preferences(
    tokenizer, rows: list[dict], *, max_prompt_length: int, max_length: int, stop_ids: Sequence[int] = ()
) -> list[dict]:
    """{"prompt", "chosen", "rejected"} token ids per row, as TRL 1.16's DPOTrainer tokenizes a pair: the
    completion starts where the tokenized prompt and prompt+completion diverge, and ends closed (eos appended
    unless it ends on eos or one of `stop_ids`, the ids the policy stops on). The prompt keeps its last
    max_prompt_length tokens, a completion its first max_length minus the prompt's (TRL's keep_start); a row whose
    prompt leaves no room is refused in one sentence."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    closing = set(eos) | {int(i) for i in stop_ids}
    prompts = encode(tokenizer, [r["prompt"] for r in rows])
    chosen = encode(tokenizer, [r["prompt"] + r["chosen"] for r in rows])
    rejected = encode(tokenizer, [r["prompt"] + r["rejected"] for r in rows])
    items = []
    for i, (prompt, with_chosen, with_rejected) in enumerate(zip(prompts, chosen, rejected)):
        start = min(common_prefix_length(prompt, with_chosen), common_prefix_length(prompt, with_rejected))
        kept = prompt[:start][-max_prompt_length:]
        room = max_length - len(kept)
        if room < 2:
            raise DataValidationError(
                f"data.preference row {i}: its prompt takes {len(kept)} of data.max_length {max_length} tokens, "
                "leaving no room for a completion; raise data.max_length or shorten the prompt"
            )
        sides = []
        for ids in (with_chosen[start:], with_rejected[start:]):
            ids = ids if ids and ids[-1] in closing else ids + eos
            sides.append(ids[:room])  # TRL's keep_start: a completion cut at the limit loses its end
        items.append({"prompt": kept, "chosen": sides[0], "rejected": sides[1]})
    return items


@dataclass(frozen=True)
class PairBatch:
    """Pairs as one forward's input: each prompt twice (chosen rows, then rejected rows), left-padded, and the
    completions right-padded (2B, R) with their mask."""

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    responses: torch.Tensor
    resp_mask: torch.Tensor

    @classmethod
    def of(cls, items: list[dict], pad_id: int, device=None) -> PairBatch:
        from torch.nn.utils.rnn import pad_sequence

        query_ids, query_mask = left_pad([it["prompt"] for it in items] * 2, pad_id)
        completions = [torch.tensor(it["chosen"]) for it in items] + [torch.tensor(it["rejected"]) for it in items]
        responses = pad_sequence(completions, batch_first=True, padding_value=pad_id)
        lengths = torch.tensor([len(c) for c in completions])
        resp_mask = (torch.arange(responses.shape[1])[None, :] < lengths[:, None]).long()
        return cls(*(t.to(device) if device is not None else t for t in (query_ids, query_mask, responses, resp_mask)))

    def logps(self, model) -> torch.Tensor:
        """The completion tokens' log-probabilities under `model` (2B, R)."""
        logp, _ = response_logprobs(model, self.query_ids, self.query_mask, self.responses, self.resp_mask)
        return logp


class Reference:
    """The reference's summed log-probs of a batch's chosen and rejected completions: zeros (reference_free),
    precomputed once for every pair, or a forward under no_grad of the copy (or of the policy with its adapters
    disabled)."""

    def __init__(self, dpo: DPOConfig, model, policy):
        self.dpo, self.model, self.policy = dpo, model, policy
        self.precomputed: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def of(self, batch: PairBatch, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dpo.reference_free:
            zeros = batch.responses.new_zeros(len(indices), dtype=torch.float32)
            return zeros, zeros
        if self.precomputed is not None:
            chosen, rejected = self.precomputed
            return chosen[indices].to(batch.responses.device), rejected[indices].to(batch.responses.device)
        with reference_context(self.policy, self.model):  # no copy: the policy, its adapters disabled
            logp = batch.logps(self.model if self.model is not None else self.policy)
        return sequence_logps(logp, batch.resp_mask)

    def precompute(self, items: list[dict], pad_id: int, batch_size: int, device) -> None:
        """Every pair's reference log-probs, once (dpo.precompute_ref_log_probs); the copy is not needed after."""
        chosen, rejected = [], []
        for start in range(0, len(items), batch_size):
            indices = list(range(start, min(start + batch_size, len(items))))
            c, r = self.of(PairBatch.of([items[i] for i in indices], pad_id, device), indices)
            chosen.append(c.cpu())
            rejected.append(r.cpu())
        self.precomputed, self.model = (torch.cat(chosen), torch.cat(rejected)), None


class PairUpdate:
    """What offline and online DPO share in a step: the DPO loss of each micro-batch of pairs and its backward
    (`micro_batch`), then the optimizer step, TR-DPO's reference sync every dpo.ref_model_sync_steps steps and the
    micro-batches' mean statistics (`finish`)."""

    def __init__(self, loop: TrainingLoop, reference: Reference, dpo: DPOConfig):
        self.loop, self.reference, self.dpo, self.spec = loop, reference, dpo, loss_spec(dpo)

    def micro_batch(self, batch: PairBatch, indices: list[int], count: int) -> dict[str, torch.Tensor]:
        """The loss of `batch` (pairs `indices`, one of `count` micro-batches), backward; its statistics."""
        ref_chosen, ref_rejected = self.reference.of(batch, indices)
        with self.loop.micro_batch():
            out = dpo_loss(batch.logps(self.loop.trainable), batch.resp_mask, ref_chosen, ref_rejected, self.spec)
            self.loop.backward(out.loss / count)
        return {"loss": out.loss.detach(), **out.metrics}

    def finish(self, stats: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        loop = self.loop
        loop.optimizer_step()
        if self.dpo.sync_ref_model and (loop.step + 1) % self.dpo.ref_model_sync_steps == 0:
            mix_into_reference(self.reference.model, loop.unwrapped(), self.dpo.ref_model_mixup_alpha)
        return {k: torch.stack([s[k] for s in stats]).float().mean() for k in stats[0]}


def scaled_dpo(settings) -> DPOConfig:
    """The dpo section with beta times the guard's kl_scale (its rollbacks)."""
    return settings.dpo.model_copy(update={"beta": settings.dpo.beta * settings.kl_scale})


def saved_models(policy, reference, dpo: DPOConfig) -> dict:
    """What a checkpoint holds: the policy, and the reference copy when TR-DPO changes it during training."""
    return {"policy": policy, **({"ref": reference} if dpo.sync_ref_model and reference is not None else {})}


def frozen_reference(models, dpo: DPOConfig, loop: TrainingLoop) -> Reference:
    """The run's `Reference`: the copy on the loop's device, frozen (none when dpo.reference_free; the policy with
    its adapters disabled when models.reference is None)."""
    model = None if dpo.reference_free else models.reference
    if model is not None:
        model.to(loop.device).eval().requires_grad_(False)
    return Reference(dpo, model, loop.unwrapped())


class DPOStep:
    """The loop's step: the DPO loss of each micro-batch of pairs (their indices into `items`), then `PairUpdate`'s
    finish: the means of the loss and TRL's metrics over the micro-batches."""

    def __init__(self, update: PairUpdate, items: list[dict], pad_id: int):
        self.update, self.items, self.pad_id = update, items, pad_id

    def __call__(self, micro_batches: list[list[int]]) -> dict[str, torch.Tensor]:
        device = self.update.loop.device
        stats = [
            self.update.micro_batch(
                PairBatch.of([self.items[i] for i in ix], self.pad_id, device), ix, len(micro_batches)
            )
            for ix in micro_batches
        ]
        return self.update.finish(stats)


def train_dpo(inputs: RLInputs) -> LoopResult:
    """Train inputs.models.policy with DPO for rl.total_steps optimizer steps on the pairs of inputs.prompts (rows
    with prompt, chosen and rejected; inputs.prompts.max_length bounds a pair), resuming from inputs.output_dir.
    models.reference None: the policy with its adapters disabled (LoRA) is the reference."""
    models, settings, hooks, out = inputs.models, inputs.settings, inputs.hooks, Path(inputs.output_dir)
    rl, run, policy, tokenizer = settings.rl, settings.run, models.policy, models.tokenizer
    dpo = scaled_dpo(settings)
    micro = rl.batch_size // rl.gradient_accumulation_steps
    sizes = BatchSizes(
        prompts_per_step=rl.batch_size, generations_per_prompt=1, mini_batch=rl.batch_size, micro_batch=micro
    )
    saved = saved_models(policy, models.reference, dpo)
    loop_settings = rl_loop_settings(rl, run, sizes, eval_every=hooks.eval_cadence)
    loop = TrainingLoop(policy, saved, tokenizer, loop_settings, run, output_dir=out)
    items = tokenize_preferences(
        tokenizer,
        inputs.prompts.rows,
        max_prompt_length=inputs.prompts.max_prompt_length,
        max_length=inputs.prompts.max_length or inputs.prompts.max_prompt_length + rl.response_length,
        stop_ids=settings.stop_token_ids or (),
    )
    reference = frozen_reference(models, dpo, loop)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if dpo.precompute_ref_log_probs and not dpo.reference_free:
        reference.precompute(items, pad_id, micro, loop.device)
    order = ShardedBatches(
        len(items), micro, run.seed, rank=loop.rank, world=loop.world, epoch=loop.epoch, position=loop.position
    )
    callbacks = loop_callbacks(hooks, loop, policy, None)
    step = DPOStep(PairUpdate(loop, reference, dpo), items, pad_id)
    return loop.run(step, Grouped(order, rl.gradient_accumulation_steps), callbacks, show_progress=hooks.show_progress)
