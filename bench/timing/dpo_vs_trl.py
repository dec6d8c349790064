"""Offline DPO on the demo world: seconds per optimizer step against TRL 1.16's DPOTrainer.

Same SFT-initialized tiny Llama as the policy, a frozen copy of it as the reference (a forward of it every step on
both sides: precompute_ref_log_probs off), the same preference pairs (`world_rows(world, "preference")`: templated
prompts, completions ending with the end-of-turn token), loss sigmoid with beta 0.1, batch size, learning rate,
linear schedule without warm-up, clipping at 1.0, no weight decay, max length (no pair reaches it) and steps; each
side saves one checkpoint with its optimizer state at the end. TRL runs on the CPU with gradient checkpointing off.
Each run in its own process (so the peak RSS reported beside the time is that side's own); order TRL, ours, ours,
TRL, TRL, ours; best of three. Both sides are timed from the same rows of pairs to the saved checkpoint:
tokenization included (TRL's happens when the DPOTrainer is made, ours inside train_dpo), as the reward row.
Both tokenize a pair alike (the completion from where prompt and prompt+completion diverge, eos appended), except
that TRL's tokenizer call adds a bos before the template's own: its prompts are one token longer.

The sanity columns: each side's last logged train loss and rewards/accuracies (TRL logs the mean over its logging
window, all STEPS steps; ours the last step's), and both trained policies scored by the same code on the held-out
pairs against the SFT reference (DPO loss, rewards/accuracies, margin), so that both have learned alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bench.helpers.anchors import interleaved, side_process_main
from bench.timing.reward_model_vs_trl import prepare  # the same world and SFT start as the reward row
from rlhf_core.config import DPOConfig, RLConfig, RunConfig
from rlhf_core.demo.world import DemoWorld, world_rows
from rlhf_core.models.loading import load_causal_lm, load_tokenizer

# the longest demo pair is 25 tokens (prompt 16): MAX_LEN truncates nothing on either side
STEPS, BATCH, MAX_LEN, MAX_PROMPT, LR, BETA, SEED = 100, 32, 48, 32, 5e-4, 0.1, 42
TRL_VERSION = "1.16.0"
LOGGED = ("loss", "rewards/accuracies", "rewards/margins")


def run_ours(sft_dir: Path, rows: list[dict], out: Path) -> tuple[float, object, dict]:
    from rlhf_core.rl.dpo import train_dpo
    from rlhf_core.rl.inputs import rl_inputs

    tok = load_tokenizer(str(sft_dir))
    policy, ref = load_causal_lm(str(sft_dir)), load_causal_lm(str(sft_dir))
    # OptimSettings' defaults, set on TRL's side alike: warmup 0, linear, max_grad_norm 1.0, weight decay 0.0
    rl = RLConfig(
        algorithm="dpo", total_steps=STEPS, batch_size=BATCH, learning_rate=LR, save_steps=STEPS, log_steps=STEPS
    )
    logged: dict = {}
    start = time.perf_counter()
    inputs = rl_inputs(
        policy,
        tok,
        rows,
        out,
        reference=ref,
        rl=rl,
        dpo=DPOConfig(beta=BETA),
        run=RunConfig(device="cpu", seed=SEED),
        max_prompt_length=MAX_PROMPT,
        max_length=MAX_LEN,  # TRL's max_length
        on_log=lambda metrics, step: logged.update(metrics),
        show_progress=False,
    )
    result = train_dpo(inputs)
    seconds = time.perf_counter() - start
    assert result.checkpoint is not None and result.step == STEPS, result
    return seconds, policy, {k: float(logged[k]) for k in LOGGED}


def run_trl(sft_dir: Path, rows: list[dict], out: Path) -> tuple[float, object, dict]:
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig as TRLDPOConfig
    from trl import DPOTrainer

    tok = load_tokenizer(str(sft_dir))
    model = AutoModelForCausalLM.from_pretrained(sft_dir)
    ref = AutoModelForCausalLM.from_pretrained(sft_dir)
    args = TRLDPOConfig(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=MAX_LEN,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        precompute_ref_log_probs=False,
        save_strategy="steps",
        save_steps=STEPS,
        logging_steps=STEPS,
        report_to=[],
        disable_tqdm=True,
        seed=SEED,
        dataloader_drop_last=True,
    )
    # timed from the same rows as ours: DPOTrainer tokenizes its dataset when it is made, train_dpo inside its call
    start = time.perf_counter()
    trainer = DPOTrainer(
        model=model,
        ref_model=ref,
        args=args,
        processing_class=tok,
        train_dataset=datasets.Dataset.from_list(rows),
    )
    trainer.train()
    seconds = time.perf_counter() - start
    assert trainer.state.global_step == STEPS and (out / f"checkpoint-{STEPS}").is_dir()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return seconds, trainer.model, {k: float(logs[-1][k]) for k in LOGGED}


def heldout(policy, sft_dir: Path, rows: list[dict]) -> dict:
    """Both sides' trained policy scored alike: the DPO loss and TRL's reward metrics on the held-out pairs, against
    the SFT model as the reference, with our tokenization (TRL's) and forward."""
    import torch

    from rlhf_core.rl.dpo import PairBatch, tokenize_preferences
    from rlhf_core.rl.dpo_losses import DPOLossSpec, dpo_loss, sequence_logps

    tok = load_tokenizer(str(sft_dir))
    ref = load_causal_lm(str(sft_dir)).eval()
    policy = policy.eval()
    items = tokenize_preferences(tok, rows, max_prompt_length=MAX_PROMPT, max_length=MAX_LEN)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    totals: dict[str, float] = {}
    with torch.no_grad():
        for start in range(0, len(items), 64):
            chunk = items[start : start + 64]
            batch = PairBatch.of(chunk, pad_id)
            ref_chosen, ref_rejected = sequence_logps(batch.logps(ref), batch.resp_mask)
            out = dpo_loss(batch.logps(policy), batch.resp_mask, ref_chosen, ref_rejected, DPOLossSpec(beta=BETA))
            for k, v in {"loss": out.loss, **out.metrics}.items():
                totals[k] = totals.get(k, 0.0) + float(v) * len(chunk)
    return {k: totals[k] / len(items) for k in ("loss", "rewards/accuracies", "rewards/margins")}


def _side(run) -> Callable[[Path], dict]:
    def side(root: Path) -> dict:
        world = DemoWorld(root / "world")
        train, test = world_rows(world, "preference", "train"), world_rows(world, "preference", "test")
        seconds, policy, logged = run(root / "sft", train, root / f"out-{time.time_ns()}")
        return {"seconds": seconds, "train": logged, "heldout": heldout(policy, root / "sft", test)}

    return side


def measure(run_side) -> dict:
    anchor, ours = interleaved(run_side)
    best_ours, best_anchor = min(r["seconds"] for r in ours), min(r["seconds"] for r in anchor)
    ours_rss, anchor_rss = max(r["peak_rss_mb"] for r in ours), max(r["peak_rss_mb"] for r in anchor)
    o_train, a_train, o_held, a_held = ours[0]["train"], anchor[0]["train"], ours[0]["heldout"], anchor[0]["heldout"]
    return {
        "metric": "seconds per DPO optimizer step",
        "unit": "s/step",
        "ours": best_ours / STEPS,
        "anchor": best_anchor / STEPS,
        "anchor_name": f"trl {TRL_VERSION} DPOTrainer",
        "ratio": best_ours / best_anchor,
        "ours_wall_s": best_ours,
        "anchor_wall_s": best_anchor,
        "ours_peak_rss_mb": ours_rss,
        "anchor_peak_rss_mb": anchor_rss,
        "all_ours": [r["seconds"] / STEPS for r in ours],
        "all_anchor": [r["seconds"] / STEPS for r in anchor],
        "ours_train": o_train,
        "anchor_train": a_train,
        "ours_heldout": o_held,
        "anchor_heldout": a_held,
        "notes": (
            f"peak RSS ours {ours_rss:.0f} MB vs TRL {anchor_rss:.0f} MB; train loss ours {o_train['loss']:.3f} "
            f"(last step) vs TRL {a_train['loss']:.3f} (mean of {STEPS}), rewards/accuracies ours "
            f"{o_train['rewards/accuracies']:.3f} vs TRL {a_train['rewards/accuracies']:.3f}; held-out pairs: "
            f"loss ours {o_held['loss']:.3f} vs TRL {a_held['loss']:.3f}, accuracy ours "
            f"{o_held['rewards/accuracies']:.3f} vs TRL {a_held['rewards/accuracies']:.3f}; {STEPS} steps, batch "
            f"{BATCH} pairs, beta {BETA}, lr {LR:g}, length {MAX_LEN}, reference copy, demo world, CPU, best of 3, "
            "each side in its own process, tokenization timed on both sides"
        ),
    }


if __name__ == "__main__":
    side_process_main(
        __file__,
        {"prepare": prepare, "ours": _side(run_ours), "trl": _side(run_trl)},
        ("trl", TRL_VERSION),
        measure,
    )
