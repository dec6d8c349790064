"""SFT warm start: seconds per optimizer step of rlhf_core.training.sft.train_sft against transformers.Trainer.

Same tiny Llama (the demo world's), same corpus, batch size, sequence length, learning rate and
steps; both on the CPU, each run in its own process (so the peak RSS reported beside the time is
that side's own); order Trainer, ours, ours, Trainer, Trainer, ours, so drifting load and warm-up
hit both sides alike; best of three. Each side's timing covers turning the corpus into token ids,
training and saving the model: train_sft tokenizes inside, so the Trainer's run times
`tokenize_corpus` (the same tensors) too.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.helpers.anchors import side_process_main

STEPS, BATCH, MAX_LEN, LR = 60, 32, 48, 3e-3


def prepare(root: Path) -> None:
    from rlhf_core.config import DemoModelConfig, DemoWorldConfig
    from rlhf_core.demo.world import build_demo_world

    build_demo_world(root / "world", 42, DemoWorldConfig(), DemoModelConfig())


def _world_texts(root: Path):
    from rlhf_core.demo.world import DemoWorld, world_rows

    world = DemoWorld(root / "world")
    return world, [r["text"] for r in world_rows(world, "text")]


def side_ours(root: Path) -> dict:
    from rlhf_core.config import RunConfig, SFTConfig
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.training.loop import Hooks
    from rlhf_core.training.sft import train_sft

    world, texts = _world_texts(root)
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
        output_dir=root / f"ours-{time.time_ns()}",
        hooks=Hooks(show_progress=False),
    )
    return {"seconds_per_step": (time.perf_counter() - start) / STEPS}


def side_trainer(root: Path) -> dict:
    from transformers import Trainer, TrainingArguments

    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.training.sft import tokenize_corpus

    world, texts = _world_texts(root)
    out = root / f"trainer-{time.time_ns()}"
    model, tok = load_causal_lm(str(world.base_model)), load_tokenizer(str(world.tokenizer))
    args = TrainingArguments(
        output_dir=str(out),
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
    start = time.perf_counter()
    ids, mask, labels = tokenize_corpus(tok, texts, MAX_LEN).tensors
    rows = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]
    tokenized = time.perf_counter() - start
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    start = time.perf_counter()
    trainer.train()
    trainer.save_model(str(out / "final"))
    return {"seconds_per_step": (time.perf_counter() - start + tokenized) / STEPS}


def measure(run_side) -> dict:
    anchor, ours = [], []
    for side in "TOOTTO":  # as anchors.interleaved, so drifting machine load hits both sides alike
        (anchor if side == "T" else ours).append(run_side("trainer" if side == "T" else "ours"))
    best_ours = min(r["seconds_per_step"] for r in ours)
    best_anchor = min(r["seconds_per_step"] for r in anchor)
    ours_rss, anchor_rss = max(r["peak_rss_mb"] for r in ours), max(r["peak_rss_mb"] for r in anchor)
    return {
        "metric": "seconds per SFT optimizer step",
        "unit": "s/step",
        "ours": best_ours,
        "anchor": best_anchor,
        "anchor_name": "transformers.Trainer",
        "ratio": best_ours / best_anchor,
        "ours_peak_rss_mb": ours_rss,
        "anchor_peak_rss_mb": anchor_rss,
        "all_ours": [r["seconds_per_step"] for r in ours],
        "all_anchor": [r["seconds_per_step"] for r in anchor],
        "notes": (
            f"peak RSS ours {ours_rss:.0f} MB vs Trainer {anchor_rss:.0f} MB; best of 3, each side in its own "
            f"process, {STEPS} steps, batch {BATCH}, length {MAX_LEN}, tokenization timed on both sides, "
            "demo tiny Llama, CPU"
        ),
    }


if __name__ == "__main__":
    # the anchor is transformers itself (the project's pin): no anchor package goes on sys.path
    side_process_main(
        __file__, {"prepare": prepare, "ours": side_ours, "trainer": side_trainer}, ("trl", "1.16.0"), measure
    )
