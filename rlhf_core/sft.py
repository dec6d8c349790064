"""Supervised fine-tuning warm start: next-token cross-entropy on a text corpus.

In the demo it teaches the randomly initialized tiny Llama to write template-like review sentences,
so the policy that RL starts from already writes the language the reward model judges.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import RunConfig, SFTConfig
from rlhf_core.training import OnCheckpoint, OnLog, build_optimizer, make_accelerator, save_pretrained_atomic, seed_everything


def tokenize_corpus(tokenizer, texts: list[str], max_length: int):
    """Token ids with eos appended, right-padded: (input_ids, attention_mask, labels), each (N, T)."""
    import torch

    eos = tokenizer.eos_token or ""
    # eos right after the text, as TRL does: a space before it would be a token of its own in a
    # byte-level BPE, and the model would learn to stop after a stray space
    enc = tokenizer([t if not eos or t.endswith(eos) else t + eos for t in texts], max_length=max_length, truncation=True,
                    padding="longest", return_tensors="pt", padding_side="right")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)  # (N, T) no loss on pads
    return torch.utils.data.TensorDataset(enc["input_ids"], enc["attention_mask"], labels)


def train_sft(model, tokenizer, texts: list[str], cfg: SFTConfig, run: RunConfig, *, max_length: int,
              output_dir: str | Path, on_log: OnLog | None = None, on_checkpoint: OnCheckpoint | None = None,
              show_progress: bool = True) -> dict[str, float]:
    """Train `model` on `texts` for cfg.max_steps optimizer steps and save it to `output_dir`.

    Returns the final metrics ({"sft/loss": ..., "sft/first_loss": ...}). Callbacks receive metric
    dicts with steps and the saved directory; the function itself imports no tracking code.
    """
    import torch
    from tqdm.auto import tqdm

    seed_everything(run.seed)
    accelerator = make_accelerator(run, cfg.gradient_accumulation_steps)
    data = tokenize_corpus(tokenizer, texts, max_length)
    generator = torch.Generator().manual_seed(run.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, shuffle=True, generator=generator, drop_last=len(data) > cfg.batch_size)
    optimizer, scheduler = build_optimizer(model, cfg, cfg.max_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()

    step, first_loss, window = 0, None, []
    bar = tqdm(total=cfg.max_steps, desc="sft", disable=not show_progress or not accelerator.is_main_process)
    while step < cfg.max_steps:
        for input_ids, attention_mask, labels in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
                accelerator.backward(loss)
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm) if accelerator.sync_gradients else None
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            window.append(loss.item())
            if not accelerator.sync_gradients:
                continue
            step += 1
            first_loss = window[0] if first_loss is None else first_loss
            bar.update(1)
            bar.set_postfix(loss=f"{window[-1]:.3f}")
            if on_log is not None and (step % cfg.log_steps == 0 or step == cfg.max_steps):
                on_log({"sft/loss": sum(window) / len(window), "sft/learning_rate": scheduler.get_last_lr()[0],
                        "sft/grad_norm": float(grad_norm)}, step)
                window = window[-1:]
            if step >= cfg.max_steps:
                break
    bar.close()

    final_loss = window[-1]
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    if accelerator.is_main_process:
        path = save_pretrained_atomic(unwrapped, tokenizer, output_dir)
        if on_checkpoint is not None:
            on_checkpoint(path, step)
    accelerator.wait_for_everyone()
    return {"sft/loss": final_loss, "sft/first_loss": first_loss, "sft/steps": float(step)}
