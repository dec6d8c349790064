"""Equivalence runs of PPO and GRPO, recorded step by step for tests/rlhf_core/test_equivalence.py.

Run under `torchrun --nproc_per_node 2 equivalence_worker.py <world_root> <out> <ppo_batch> <grpo_batch>`:
every process trains PPO (ppo_batch prompts per step) and then GRPO (grpo_batch completions per step).
The test calls `run_ppo` / `run_grpo` itself in its own single process with twice the batch and
compares: the same weights after every step.

Sampling would differ between the two (each process seeds with seed + rank), so rollouts are made
independent of the random generator: the first response token of each row and the step at which it
emits its stop token are fixed functions of the row's prompt ids (and, in GRPO, of its place in the
group, so that a group's completions differ), and every other token is the argmax. The lengths vary,
so the processes hold different numbers of tokens (what the token normalizations must get right).
Only the token choice is replaced (`rlhf_core.rollout.collect.sample_next`): generation, masks,
log-probabilities and reference log-probabilities all come from the real code and the real models.

After every optimizer step each run records the summed gradient it stepped with (before clipping);
after every loop step, the weights, those gradients and the step's responses, in
<out>/<stage>-<tag>-step<N>.safetensors ("w." weights, "g<j>." gradients of the step's j-th optimizer
step, "responses").
"""

from __future__ import annotations

import dataclasses
import os
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

import rlhf_core.rl.grpo as grpo_mod
import rlhf_core.rl.ppo as ppo_mod
import rlhf_core.rl.samplers as samplers_mod
import rlhf_core.rollout.generation as generation_mod
from rlhf_core.config import GRPOConfig, PPOConfig, RLConfig, RunConfig
from rlhf_core.rewards.sources import function_reward
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.training.loop import TrainingLoop

FIRST_FREE_ID = 5  # ids 0..4 are the demo tokenizer's unk, bos, eos (== pad), <|im_start|> and <|im_end|>


class Recorder:
    """What one training run saw: every rollout's responses and every optimizer step's gradients."""

    def __init__(self):
        self.responses: list[torch.Tensor] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.saved_grads = 0


def row_keys(query_ids: torch.Tensor, query_mask: torch.Tensor) -> list[int]:
    """A number per row from the row's real prompt ids (padding ignored)."""
    return [
        zlib.crc32(",".join(map(str, query_ids[i][query_mask[i].bool()].tolist())).encode())
        for i in range(query_ids.shape[0])
    ]


def forced_choices(
    query_ids: torch.Tensor, query_mask: torch.Tensor, vocab_size: int, group: int, response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first token (B,), step at which the row emits its stop token (B,), response_length for never), each a
    fixed function of the row's prompt and of its index in its group: the completions of a group differ,
    and so do the lengths of the rows and the token counts of the processes."""
    span = vocab_size - FIRST_FREE_ID
    keys = row_keys(query_ids, query_mask)
    first = [FIRST_FREE_ID + (key + 1343 * (i % group)) % span for i, key in enumerate(keys)]
    stop_at = [1 + (key // 7 + 3 * (i % group)) % (response_length + 1) for i, key in enumerate(keys)]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=query_ids.device)  # noqa: E731
    return as_tensor(first), as_tensor(stop_at)


def deterministic_sample(real, recorder: Recorder, vocab_size: int):
    """The step sampler's `sample` whose token choice is fixed by the prompt: a forced first token, greedy after
    it, and the stop token at a forced step (see the module docstring)."""

    def wrapper(engine, policy, query_ids, query_mask, spec, **kwargs):
        stops, settings = list(spec.stop_token_ids), spec.settings
        first, stop_at = forced_choices(
            query_ids, query_mask, vocab_size, spec.prompt_repeats, settings.response_length
        )
        t = [0]

        def choose(logits, _settings):
            token = first if t[0] == 0 else logits.argmax(-1)
            if stops:
                token = torch.where(stop_at == t[0], torch.full_like(token, stops[0]), token)
            t[0] += 1
            return token

        real_sample_next = generation_mod.sample_next
        generation_mod.sample_next = choose
        try:
            greedy = dataclasses.replace(spec, settings=dataclasses.replace(settings, greedy=True))
            sampled = real(engine, policy, query_ids, query_mask, greedy, **kwargs)
        finally:
            generation_mod.sample_next = real_sample_next
        recorder.responses.append(sampled.responses.detach().cpu().clone())
        return sampled

    return wrapper


def recording_sample(real, recorder: Recorder):
    """The real `sample`, its responses recorded."""

    def wrapper(*args, **kwargs):
        sampled = real(*args, **kwargs)
        recorder.responses.append(sampled.responses.detach().cpu().clone())
        return sampled

    return wrapper


@contextmanager
def instrumented(*, deterministic: bool, vocab_size: int = 0):
    """Patch the rollouts of both algorithms (deterministic, or only recorded) and record every optimizer
    step's gradients; everything is restored on exit. Yields the Recorder."""
    recorder = Recorder()
    real_sample, real_step = samplers_mod.sample, TrainingLoop.optimizer_step

    def optimizer_step(self):
        recorder.grads.append(
            {
                name: p.grad.detach().cpu().clone()
                for name, p in self.unwrapped().named_parameters()
                if p.grad is not None
            }
        )
        real_step(self)

    samplers_mod.sample = (
        deterministic_sample(real_sample, recorder, vocab_size)
        if deterministic
        else recording_sample(real_sample, recorder)
    )
    TrainingLoop.optimizer_step = optimizer_step
    try:
        yield recorder
    finally:
        samplers_mod.sample = real_sample
        TrainingLoop.optimizer_step = real_step


def snapshot(path: Path, recorder: Recorder, *models: tuple[str, torch.nn.Module]) -> None:
    """Weights of `models`, the gradients since the last snapshot and the last responses, in one file."""
    tensors = {}
    for prefix, model in models:
        for name, value in model.state_dict().items():
            tensors[f"w.{prefix}.{name}"] = value.detach().cpu().clone().contiguous()
    for j, grads in enumerate(recorder.grads[recorder.saved_grads :]):
        for name, value in grads.items():
            tensors[f"g{j}.{name}"] = value.contiguous()
    recorder.saved_grads = len(recorder.grads)
    tensors["responses"] = recorder.responses[-1].contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


# the runs both sides share: only the number of rows per process differs
SEED = 11
PPO_RL = dict(total_steps=2, response_length=5, learning_rate=1e-3, temperature=0.7, save_steps=2)
PPO_ALGO = dict(num_ppo_epochs=1, num_mini_batches=1, whiten_advantages=True)
GRPO_RL = dict(algorithm="grpo", total_steps=2, response_length=5, learning_rate=1e-3, temperature=0.7, save_steps=2)
GRPO_ALGO = dict(num_generations=4, loss_type="dapo", scale_rewards="batch", beta=0.04, num_iterations=2)


def high_id_reward(tokenizer):
    """A reward that varies between completions: the share of ids in the upper half of the vocabulary,
    plus a little for length."""
    cut = len(tokenizer) // 2

    def score(prompts, completions, **_):
        out = []
        for text in completions:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(sum(i >= cut for i in ids) / max(len(ids), 1) + 0.01 * len(ids))
        return out

    return score


def run_ppo(
    world_root: str | Path,
    out: str | Path,
    batch_size: int,
    tag: str,
    *,
    rl: dict | None = None,
    ppo: dict | None = None,
    deterministic: bool = True,
    show_progress: bool = False,
) -> Recorder:
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rewards.reward_model import load_reward_model

    world_root, out = Path(world_root), Path(out)
    tok = load_tokenizer(str(world_root / "tokenizer"))
    base = str(world_root / "base_model")
    policy, ref = load_causal_lm(base), load_causal_lm(base)
    value = load_reward_model(base, tok, seed=3)
    scorer = load_reward_model(base, tok, seed=4).eval()
    prompts = train_prompts(world_root)
    with instrumented(deterministic=deterministic, vocab_size=len(tok)) as recorder:
        ppo_mod.train_ppo(
            rl_inputs(
                policy,
                tok,
                prompts,
                out / f"ppo-{tag}",
                value=value,
                reference=ref,
                reward_model=scorer,
                rl=RLConfig(batch_size=batch_size, **{**PPO_RL, **(rl or {})}),
                ppo=PPOConfig(**{**PPO_ALGO, **(ppo or {})}),
                run=RunConfig(device="cpu", seed=SEED),
                max_prompt_length=16,
                on_step=lambda step: snapshot(
                    out / f"ppo-{tag}-step{step}.safetensors", recorder, ("policy", policy), ("value", value)
                ),
                show_progress=show_progress,
            )
        )
    return recorder


def run_grpo(
    world_root: str | Path,
    out: str | Path,
    batch_size: int,
    tag: str,
    *,
    rl: dict | None = None,
    grpo: dict | None = None,
    deterministic: bool = True,
    show_progress: bool = False,
) -> Recorder:
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer

    world_root, out = Path(world_root), Path(out)
    tok = load_tokenizer(str(world_root / "tokenizer"))
    base = str(world_root / "base_model")
    cfg = GRPOConfig(**{**GRPO_ALGO, **(grpo or {})})
    policy = load_causal_lm(base)
    ref = load_causal_lm(base) if cfg.beta > 0 else None
    rows = [{"prompt": p} for p in train_prompts(world_root)]
    with instrumented(deterministic=deterministic, vocab_size=len(tok)) as recorder:
        grpo_mod.train_grpo(
            rl_inputs(
                policy,
                tok,
                rows,
                out / f"grpo-{tag}",
                reference=ref,
                rewards=[function_reward("high_ids", 1.0, high_id_reward(tok))],
                rl=RLConfig(batch_size=batch_size, **{**GRPO_RL, **(rl or {})}),
                grpo=cfg,
                run=RunConfig(device="cpu", seed=SEED),
                max_prompt_length=16,
                on_step=lambda step: snapshot(out / f"grpo-{tag}-step{step}.safetensors", recorder, ("policy", policy)),
                show_progress=show_progress,
            )
        )
    return recorder


def train_prompts(world_root: str | Path) -> list[str]:
    """The world's RL prompts as the pipeline reads them (templated)."""
    from rlhf_core.demo.world import DemoWorld, world_rows

    return [row["prompt"] for row in world_rows(DemoWorld(Path(world_root)), "prompt", "train")]


def main(world_root: str, out: str, ppo_batch: int, grpo_batch: int) -> None:
    rank = int(os.environ["RANK"])
    run_ppo(world_root, out, ppo_batch, f"rank{rank}")
    run_grpo(world_root, out, grpo_batch, f"rank{rank}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        # gloo's threads stopped before the interpreter exits: left to exit, a loaded machine saw rank 1 abort
        # ("terminate called without an active exception") after the work was done
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
