"""Reward model on the demo world: held-out accuracy, wall time, and seconds per step against TRL.

Same SFT-initialized tiny Llama, same VADER-labelled pairs, batch size, learning rate, schedule,
max length and steps; each side trains, evaluates once and saves one checkpoint with its optimizer
state at the end. TRL 1.16's RewardTrainer runs with gradient checkpointing off (ours is off by
default; TRL's default is on) and on the CPU. Each run in its own process (so the peak RSS reported
beside the time is that side's own); order TRL, ours, ours, TRL, TRL, ours; best of three. Both sides
are timed from the same rows of pairs to the saved checkpoint: tokenization included (TRL's happens when
the RewardTrainer is made, ours inside train_reward_model), as the SFT benchmark times it on both sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bench.helpers.anchors import interleaved, side_process_main
from rlhf_core.config import RewardConfig, RunConfig
from rlhf_core.demo.world import DemoWorld, world_rows
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.rewards.reward_model import PreferencePairs, evaluate_reward_model, load_reward_model, train_reward_model
from rlhf_core.training.loop import Hooks

STEPS, BATCH, MAX_LEN, LR, SEED = 200, 32, 48, 1e-3, 42
TRL_VERSION = "1.16.0"
CARD = {"title": "bench", "metadata": {}, "body": "bench"}


def run_ours(sft_dir: Path, train, test, out: Path) -> tuple[float, dict]:
    tok = load_tokenizer(str(sft_dir))
    model = load_reward_model(str(sft_dir), tok, seed=SEED)
    cfg = RewardConfig(
        max_steps=STEPS, batch_size=BATCH, learning_rate=LR, eval_steps=STEPS, save_steps=STEPS, log_steps=STEPS
    )
    start = time.perf_counter()
    result = train_reward_model(
        model,
        tok,
        PreferencePairs(train, test, MAX_LEN),
        cfg,
        RunConfig(device="cpu", seed=SEED),
        output_dir=out,
        card=CARD,
        hooks=Hooks(show_progress=False),
    )
    return time.perf_counter() - start, result.metrics


def run_trl(sft_dir: Path, train, test, out: Path) -> tuple[float, dict]:
    import datasets
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig as TRLRewardConfig
    from trl import RewardTrainer

    tok = load_tokenizer(str(sft_dir))
    model = AutoModelForSequenceClassification.from_pretrained(sft_dir, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    args = TRLRewardConfig(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        learning_rate=LR,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        max_length=MAX_LEN,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        eval_strategy="steps",
        eval_steps=STEPS,
        save_strategy="steps",
        save_steps=STEPS,
        logging_steps=STEPS,
        report_to=[],
        disable_tqdm=True,
        seed=SEED,
        dataloader_drop_last=True,
    )
    # timed from the same rows as ours: RewardTrainer tokenizes its datasets when it is made, train_reward_model
    # inside its call
    start = time.perf_counter()
    trainer = RewardTrainer(
        model=model,
        args=args,
        processing_class=tok,
        train_dataset=datasets.Dataset.from_list(train),
        eval_dataset=datasets.Dataset.from_list(test),
    )
    trainer.train()
    seconds = time.perf_counter() - start
    # TRL appends eos to every completion it trains on; score its model the same way
    with_eos = [dict(r, chosen=r["chosen"] + tok.eos_token, rejected=r["rejected"] + tok.eos_token) for r in test]
    metrics = evaluate_reward_model(trainer.model, tok, with_eos, max_length=MAX_LEN, batch_size=BATCH)
    return seconds, metrics


def prepare(root: Path) -> None:
    """The world and the SFT model every side starts from."""
    from rlhf_core.config import DemoModelConfig, DemoWorldConfig, RunConfig, SFTConfig
    from rlhf_core.demo.world import build_demo_world
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.training.sft import train_sft

    world = build_demo_world(root / "world", SEED, DemoWorldConfig(), DemoModelConfig())
    model, tok = load_causal_lm(str(world.base_model)), load_tokenizer(str(world.tokenizer))
    train_sft(
        model,
        tok,
        [r["text"] for r in world_rows(world, "text")],
        SFTConfig(max_steps=300, learning_rate=3e-3),
        RunConfig(device="cpu", seed=SEED),
        max_length=MAX_LEN,
        output_dir=root / "sft",
        hooks=Hooks(show_progress=False),
    )


def _side(run) -> Callable[[Path], dict]:
    def side(root: Path) -> dict:
        world = DemoWorld(root / "world")
        train, test = world_rows(world, "preference", "train"), world_rows(world, "preference", "test")
        seconds, metrics = run(root / "sft", train, test, root / f"out-{time.time_ns()}")
        return {"seconds": seconds, "eval": metrics}

    return side


def measure(run_side) -> dict:
    anchor, ours = interleaved(run_side)
    best_ours, best_anchor = min(r["seconds"] for r in ours), min(r["seconds"] for r in anchor)
    ours_rss, anchor_rss = max(r["peak_rss_mb"] for r in ours), max(r["peak_rss_mb"] for r in anchor)
    return {
        "metric": "seconds per reward-model optimizer step",
        "unit": "s/step",
        "ours": best_ours / STEPS,
        "anchor": best_anchor / STEPS,
        "anchor_name": f"trl {TRL_VERSION} RewardTrainer",
        "ratio": best_ours / best_anchor,
        "ours_wall_s": best_ours,
        "anchor_wall_s": best_anchor,
        "ours_peak_rss_mb": ours_rss,
        "anchor_peak_rss_mb": anchor_rss,
        "all_ours": [r["seconds"] / STEPS for r in ours],
        "all_anchor": [r["seconds"] / STEPS for r in anchor],
        "ours_eval": ours[0]["eval"],
        "anchor_eval": anchor[0]["eval"],
        "notes": (
            f"peak RSS ours {ours_rss:.0f} MB vs TRL {anchor_rss:.0f} MB; held-out accuracy ours "
            f"{ours[0]['eval']['eval_accuracy']:.3f} vs TRL {anchor[0]['eval']['eval_accuracy']:.3f}; "
            f"{STEPS} steps, batch {BATCH} pairs, length {MAX_LEN}, demo world, CPU, best of 3, each side in its own process, tokenization timed on both sides"
        ),
    }


if __name__ == "__main__":
    side_process_main(
        __file__,
        {"prepare": prepare, "ours": _side(run_ours), "trl": _side(run_trl)},
        ("trl", TRL_VERSION),
        measure,
    )
