"""TRL's side of the speed benchmarks, built in one place: a GRPOTrainer or RLOOTrainer (timing/grpo_vs_trl.py,
timing/rloo_vs_trl.py, scaling_sides.py) and a PPOTrainer (timing/ppo_vs_trl.py, scaling_sides.py) from a
policy directory on the demo world's training prompts, with what each run records. TRL is imported inside the
calls, after the side's process has put its anchor (bench/.anchors/trl-<version>) on sys.path."""

from __future__ import annotations

import time
from pathlib import Path

from rlhf_core.demo.world import DemoWorld, world_rows


def train_prompts(root: Path) -> list[str]:
    """The prompts of the demo world in `root`/world, train split."""
    return [r["prompt"] for r in world_rows(DemoWorld(root / "world"), "prompt", "train")]


def vader_reward(prompts, completions, **kwargs):
    """The VADER compound score of each completion: the one reward function of both sides."""
    from rlhf_core.rewards.functions import vader_compound

    return vader_compound(completions=completions)


def left_padded_tokenizer(model_dir: Path):
    """The tokenizer saved with the model, padding on the left: TRL generates from left-padded prompts."""
    from rlhf_core.models.loading import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    tok.padding_side = "left"
    return tok


def group_args(root: Path, *, batch: int, generations: int, tokens: int, steps: int, lr: float, beta: float, seed: int):
    """The GRPOConfig / RLOOConfig fields every group-trainer side shares: CPU and fp32, exactly `tokens` new
    tokens per completion (eos suppressed before that, as ours with min_response_length), temperature 1.0, a
    log line per step, no reporting. A side adds its own (checkpointing, loss, KL) to the dict."""
    return dict(
        output_dir=str(root / f"trl-{time.time_ns()}"),
        per_device_train_batch_size=batch,
        num_generations=generations,
        max_completion_length=tokens,
        max_steps=steps,
        learning_rate=lr,
        beta=beta,
        temperature=1.0,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to=[],
        seed=seed,
        disable_tqdm=True,
        generation_kwargs={"min_new_tokens": tokens},
    )


def run_group_trainer(trainer: str, root: Path, policy_dir: Path, args: dict) -> dict:
    """TRL's `trainer` ("GRPOTrainer" or "RLOOTrainer", with its config class) trained from `policy_dir` on
    `root`'s prompts with `vader_reward`; returns the wall time of train(), the time each optimizer step ended
    (perf_counter), and the rewards and mean completion lengths it logged."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback

    tok = left_padded_tokenizer(policy_dir)
    prompts = train_prompts(root)
    stamps, rewards, lengths = [], [], []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    config = getattr(trl, trainer.replace("Trainer", "Config"))(**args)
    built = getattr(trl, trainer)(
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        reward_funcs=[vader_reward],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        callbacks=[Record()],
    )
    start = time.perf_counter()
    built.train()
    return {"train_s": time.perf_counter() - start, "stamps": stamps, "rewards": rewards, "lengths": lengths}


def ppo_args(
    root: Path, *, batch: int, steps: int, length: int, epochs: int, stop_token, logging_steps: int, seed: int
):
    """The PPOConfig fields (TRL 1.12) both PPO sides share: one mini-batch, temperature 0.7, kl_coef 0.05,
    learning rate 1e-4, CPU and fp32, no checkpoint, no sample generations, no reporting."""
    return dict(
        output_dir=str(root / f"trl-{time.time_ns()}"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=epochs,
        total_episodes=batch * steps,
        response_length=length,
        temperature=0.7,
        stop_token=stop_token,
        kl_coef=0.05,
        learning_rate=1e-4,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        num_sample_generations=0,
        report_to=[],
        logging_steps=logging_steps,
        local_rollout_forward_batch_size=batch,
        seed=seed,
        disable_tqdm=True,
    )


def run_ppo_trainer(root: Path, policy_dir: Path, reward_dir: Path, max_prompt: int, args: dict) -> dict:
    """TRL 1.12's PPOTrainer trained from `policy_dir` (policy and reference) and `reward_dir` (reward and value
    model) on `root`'s prompts cut to their last `max_prompt` tokens; returns the wall time of train(), the time
    each optimizer step ended (perf_counter) and the new tokens of every rollout."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tok = left_padded_tokenizer(policy_dir)
    ids = [seq[-max_prompt:] for seq in tok(train_prompts(root))["input_ids"]]
    stamps, new_tokens = [], []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    config = PPOConfig(**args)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    generate = policy.generate

    def counted(*a, **kw):  # records the new tokens of every rollout (the length check)
        out = generate(*a, **kw)
        new_tokens.append(out.sequences.shape[1] - kw["input_ids"].shape[1])
        return out

    policy.generate = counted
    trainer = PPOTrainer(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=AutoModelForCausalLM.from_pretrained(policy_dir),
        reward_model=AutoModelForSequenceClassification.from_pretrained(reward_dir),
        value_model=AutoModelForSequenceClassification.from_pretrained(reward_dir),
        train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
        callbacks=[Stamps()],
    )
    start = time.perf_counter()
    trainer.train()
    return {"train_s": time.perf_counter() - start, "stamps": stamps, "new_tokens": new_tokens}
