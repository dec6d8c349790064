"""SFT warm start: seconds per optimizer step of rlhf_core.sft.train_sft against transformers.Trainer.

Same tiny Llama (the demo world's), same corpus, batch size, sequence length, learning rate and
steps; both on the CPU in this process, the anchor first and ours second, then once more in the
other order, so warm-up effects do not favour either side.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rlhf_core.config import DemoModelConfig, DemoWorldConfig, RunConfig, SFTConfig
from rlhf_core.demo_world import build_demo_world, world_rows
from rlhf_core.models import load_causal_lm, load_tokenizer
from rlhf_core.sft import tokenize_corpus, train_sft

STEPS, BATCH, MAX_LEN, LR = 60, 32, 48, 3e-3


def run_ours(world, texts, out: Path) -> float:
    model, tok = load_causal_lm(str(world.base_model)), load_tokenizer(str(world.tokenizer))
    cfg = SFTConfig(max_steps=STEPS, batch_size=BATCH, learning_rate=LR, log_steps=STEPS)
    start = time.perf_counter()
    train_sft(
        model,
        tok,
        texts,
        cfg,
        RunConfig(device="cpu"),
        max_length=MAX_LEN,
        output_dir=out / "ours",
        show_progress=False,
    )
    return (time.perf_counter() - start) / STEPS


def run_trainer(world, texts, out: Path) -> float:
    from transformers import Trainer, TrainingArguments

    model, tok = load_causal_lm(str(world.base_model)), load_tokenizer(str(world.tokenizer))
    ids, mask, labels = tokenize_corpus(tok, texts, MAX_LEN).tensors
    rows = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        save_strategy="no",
        logging_steps=STEPS,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=42,
        dataloader_drop_last=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    start = time.perf_counter()
    trainer.train()
    trainer.save_model(str(out / "trainer" / "final"))
    return (time.perf_counter() - start) / STEPS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        world = build_demo_world(tmp / "world", 42, DemoWorldConfig(), DemoModelConfig())
        texts = [r["text"] for r in world_rows(world, "text")]
        anchor = [run_trainer(world, texts, tmp / "a1")]
        ours = [run_ours(world, texts, tmp / "o1")]
        ours.append(run_ours(world, texts, tmp / "o2"))
        anchor.append(run_trainer(world, texts, tmp / "a2"))
    result = {
        "metric": "seconds per SFT optimizer step",
        "unit": "s/step",
        "ours": min(ours),
        "anchor": min(anchor),
        "anchor_name": "transformers.Trainer",
        "ratio": min(ours) / min(anchor),
        "notes": f"best of 2, {STEPS} steps, batch {BATCH}, length {MAX_LEN}, demo tiny Llama, CPU",
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
