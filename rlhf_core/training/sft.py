"""Supervised fine-tuning warm start: next-token cross-entropy on a text corpus.

In the demo it teaches the randomly initialized tiny Llama to write template-like review sentences,
so the policy that RL starts from already writes the language the reward model judges. The step is
one cross-entropy update; the shared `TrainingLoop` does the rest.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_core.config import RunConfig, SFTConfig
from rlhf_core.data.batching import Grouped, LoaderCycle
from rlhf_core.data.chat import encode
from rlhf_core.models.forward import causal_lm_loss
from rlhf_core.storage.saving import save_pretrained_atomic
from rlhf_core.training.loop import NO_HOOKS, Cadence, Hooks, LoopCallbacks, LoopMetrics, LoopSettings, TrainingLoop


def tokenize_corpus(tokenizer, texts: list[str], max_length: int) -> torch.utils.data.TensorDataset:
    """Token ids with eos appended, right-padded: (input_ids, attention_mask, labels), each (N, T)."""
    eos = tokenizer.eos_token or ""
    # eos right after the text, as TRL does: a space before it would be a token of its own in a
    # byte-level BPE, and the model would learn to stop after a stray space
    texts = [t if not eos or t.endswith(eos) else t + eos for t in texts]
    bos = tokenizer.bos_token
    if bos and any(t.startswith(bos) for t in texts):  # templated conversations: no second bos
        return _pad_corpus(encode(tokenizer, texts, max_length=max_length, truncation=True), tokenizer.pad_token_id)
    enc = tokenizer(
        texts,
        max_length=max_length,
        truncation=True,
        padding="longest",
        return_tensors="pt",
        padding_side="right",
    )
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)  # (N, T) no loss on pads
    return torch.utils.data.TensorDataset(enc["input_ids"], enc["attention_mask"], labels)


def _pad_corpus(ids: list[list[int]], pad_id: int) -> torch.utils.data.TensorDataset:
    """Right-padded (input_ids, attention_mask, labels) of token id lists, as `tokenize_corpus` pads."""
    lengths = torch.tensor([len(s) for s in ids], dtype=torch.long)
    width = int(lengths.max())
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # (N, T)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    # one tensor of every token, written row by row into the attended positions (row-major order)
    input_ids[mask.bool()] = torch.tensor([t for seq in ids for t in seq], dtype=torch.long)
    labels = input_ids.masked_fill(mask == 0, -100)
    return torch.utils.data.TensorDataset(input_ids, mask, labels)


def train_sft(
    model,
    tokenizer,
    texts: list[str],
    cfg: SFTConfig,
    run: RunConfig,
    *,
    max_length: int,
    output_dir: str | Path,
    hooks: Hooks = NO_HOOKS,
) -> dict[str, float]:
    """Train `model` on `texts` for cfg.max_steps optimizer steps and save it to `output_dir`.

    Returns the final metrics ({"sft/loss": the last micro-batch's loss, "sft/first_loss": the first's,
    "sft/steps"}). hooks.on_log receives metric dicts with steps, hooks.on_checkpoint the saved directory.
    """
    settings = LoopSettings(
        name="sft",
        section="sft",
        total_steps=cfg.max_steps,
        optim=cfg,
        micro_batches=cfg.gradient_accumulation_steps,
        cadence=Cadence(log_every=cfg.log_steps),
        log_window="mean",
        loop_metrics=LoopMetrics(lr="sft/learning_rate", grad_norm="sft/grad_norm"),
        shown=("sft/loss",),
    )
    loop = TrainingLoop(model, {}, tokenizer, settings, run)
    data = tokenize_corpus(tokenizer, texts, max_length)
    generator = torch.Generator().manual_seed(run.seed)
    loader = torch.utils.data.DataLoader(
        data, batch_size=cfg.batch_size, shuffle=True, generator=generator, drop_last=len(data) > cfg.batch_size
    )
    # data parallel: accelerate shards the loader; each step takes gradient_accumulation_steps micro-batches
    batches = Grouped(LoaderCycle(loop.accelerator.prepare(loader)), cfg.gradient_accumulation_steps)
    loop.trainable.train()
    seen: dict[str, torch.Tensor] = {}  # the first and the latest micro-batch loss, for the summary

    def step(micro_batches: list) -> dict[str, torch.Tensor]:
        total = torch.zeros((), device=loop.device)
        for input_ids, attention_mask, labels in micro_batches:
            with loop.micro_batch():
                loss = causal_lm_loss(loop.trainable, input_ids, attention_mask, labels)
                loop.backward(loss / len(micro_batches))
            seen.setdefault("first", loss.detach())
            seen["last"] = loss.detach()
            total = total + loss.detach()
        loop.optimizer_step()
        return {"sft/loss": total / len(micro_batches)}

    loop.run(step, batches, LoopCallbacks(on_log=hooks.on_log), show_progress=hooks.show_progress)
    unwrapped = loop.unwrapped()
    unwrapped.eval()
    if loop.is_main:
        path = save_pretrained_atomic(unwrapped, tokenizer, output_dir)
        if hooks.on_checkpoint is not None:
            hooks.on_checkpoint(path, loop.step)
    loop.accelerator.wait_for_everyone()
    return {"sft/loss": seen["last"].item(), "sft/first_loss": seen["first"].item(), "sft/steps": float(loop.step)}
