"""The skeleton PPO and GRPO share: setup, resume, prompt order, cadence of logs, evals and checkpoints.

An algorithm supplies `iteration(query_ids, query_mask) -> metrics` (one optimizer round on one batch
of prompts) and the models to save; this module owns everything around it, so both algorithms
resume, checkpoint and report the same way. A checkpoint is `checkpoint-N/` with one Hugging Face
directory per model (`policy/` first), `metrics.json` and `training_state/` (no pickle).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rlhf_core.checkpoint import (
    latest_checkpoint, load_training_state, prune_checkpoints, remove_orphan_temps, save_training_state,
)
from rlhf_core.config import RLConfig, RunConfig
from rlhf_core.parallel import full_parameters, gathered_state_dicts, reduce_metrics, shards_optimizer
from rlhf_core.models import stop_token_ids
from rlhf_core.rollout import SamplingSettings, left_pad, tokenize_prompts
from rlhf_core.training import (
    OnCheckpoint, OnLog, OnStep, ShardedBatches, assert_finite, atomic_dir, build_optimizer, disable_dropout,
    make_accelerator, restore_weights, save_hf_dir, seed_everything,
)

OnEval = Callable[[list[dict], int], None]
Evaluate = Callable[[object, int], list[dict]]


@dataclass
class RLResult:
    checkpoint: Path
    step: int
    metrics: dict[str, float]
    resumed_from: int
    skipped_steps: int


class RLLoop:
    """Owns the accelerator, the optimizer and schedule over `trainable`, resume, and the outer loop.

    models: name -> model saved in checkpoint-N/<name>/ ("policy" is the one registered).
    state: algorithm scalars saved and restored with the training state (PPO's KL coefficient).
    micro_batches / micro_batch_size: backward passes per optimizer step and sequences in each; the
    algorithm runs each pass inside `micro_batch()` and calls `backward` on a loss already normalized
    over the whole optimizer step.
    """

    # metrics that add up over processes (the others are averaged)
    SUMMED = ("_tokens", "val/num_eos_tokens")
    MINIMA, MAXIMA = ("completions/min_length",), ("completions/max_length",)

    def __init__(self, trainable: torch.nn.Module, models: dict[str, torch.nn.Module], tokenizer, prompts: list[str],
                 rl: RLConfig, run: RunConfig, *, output_dir: str | Path, max_prompt_length: int, prompts_per_step: int,
                 name: str, micro_batches: int, micro_batch_size: int, state: dict[str, float] | None = None):
        if not prompts:
            raise ValueError(f"the prompt set is empty; {name.upper()} needs at least one prompt")
        self.rl, self.run_cfg, self.name = rl, run, name
        self.output_dir = Path(output_dir)
        self.models, self.tokenizer, self.state = models, tokenizer, dict(state or {})
        self.prompts_per_step = prompts_per_step
        seed_everything(run.seed)
        # accumulation through accelerate: no gradient all-reduce until the last micro-batch (DDP), and
        # DeepSpeed steps its engine at that boundary only
        self.accelerator = make_accelerator(run, micro_batches, micro_batch_size=micro_batch_size,
                                            max_grad_norm=rl.max_grad_norm)
        self.optimizer, self.scheduler = build_optimizer(trainable, rl, rl.total_steps)
        self.step, self.epoch, self.position, self.skipped, self.metrics = 0, 0, 0, 0, {}
        if self.accelerator.is_main_process:
            remove_orphan_temps(self.output_dir)  # a killed run's half-written saves
        resume = latest_checkpoint(self.output_dir)
        if resume is not None:
            for sub, model in models.items():
                restore_weights(model, resume / sub)
            progress = load_training_state(resume, optimizer=self.optimizer, scheduler=self.scheduler)
            self.step, self.epoch, self.position = progress["step"], progress["epoch"], progress["position"]
            self.skipped = progress.get("skipped_steps", 0)
            self.state.update(progress.get("state", {}))
            self.metrics = json.loads((resume / "metrics.json").read_text())
        self.resumed_from = self.step
        if rl.disable_dropout:  # on-policy, the first update's ratio must be exactly 1
            disable_dropout(trainable)
        # the schedule stays outside Accelerate: one step per optimizer step, whatever num_processes is
        self.trainable, self.optimizer = self.accelerator.prepare(trainable, self.optimizer)
        self.device = self.accelerator.device
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        if self.world > 1:
            # the weights are identical (loaded, then broadcast by prepare); the samples must not be: seed + rank,
            # and on resume (every process restored the main one's saved RNG) seed + rank + the step reached
            seed_everything(run.seed + self.rank + 100_003 * self.step)
        self.prompt_ids = tokenize_prompts(tokenizer, prompts, max_prompt_length)
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(tokenizer, getattr(models["policy"], "generation_config", None),
                                       stop_token=rl.stop_token, stop_tokens=rl.stop_tokens)
        self.sampling = SamplingSettings(response_length=rl.response_length, temperature=rl.temperature, top_k=rl.top_k,
                                         top_p=rl.top_p, min_tokens=rl.min_response_length)

    # -- pieces the algorithms call ------------------------------------------------------------

    def micro_batch(self):
        """Context for one micro-batch's forward and backward (gradient accumulation)."""
        return self.accelerator.accumulate(self.trainable)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch loss already normalized over the optimizer step (accelerate would
        divide it by the number of micro-batches once more)."""
        self.accelerator.backward(loss * self.accelerator.gradient_accumulation_steps)

    def optimizer_step(self) -> None:
        """Clip and step, or skip the step when the gradient norm is not finite (a NaN or inf loss on
        any process poisons the averaged gradients on all of them, so all of them skip). With
        rl.skip_nonfinite_steps false a non-finite norm stops the run instead (DeepSpeed, whose engine
        has already stepped inside backward, needs that).

        The only host-device synchronization of an optimizer step.
        """
        norm = self.accelerator.clip_grad_norm_(self.trainable.parameters(), self.rl.max_grad_norm)
        finite = norm is None or bool(torch.isfinite(torch.as_tensor(norm)))
        if not finite and not self.rl.skip_nonfinite_steps:
            raise FloatingPointError(f"{self.name}: the gradient norm is {float(norm)} at step {self.step + 1} and "
                                     "rl.skip_nonfinite_steps is false; stopping before a corrupt update is saved")
        if finite:
            self.optimizer.step()
        else:
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)

    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over data-parallel processes (itself on one process); a collective."""
        return self.accelerator.reduce(value, reduction="sum") if self.world > 1 else value

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """Every process's rows of `value`, concatenated in rank order (itself on one process); a collective."""
        return self.accelerator.gather(value) if self.world > 1 else value

    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.trainable)

    def full_parameters(self):
        """Context for generation and evaluation: parameters whole (ZeRO-3, FSDP); every process enters."""
        return full_parameters(self.accelerator, self.trainable)

    # -- the loop --------------------------------------------------------------------------------

    def _save(self, step: int, on_checkpoint: OnCheckpoint | None) -> None:
        gathered = gathered_state_dicts(self.accelerator, self.trainable, self.models)  # collective; None unsharded
        if self.accelerator.is_main_process:
            path = self.output_dir / f"checkpoint-{step}"
            for sub, model in self.models.items():
                assert_finite(model, f"the {sub} model", gathered[sub] if gathered else None)
            with atomic_dir(path) as tmp:
                for sub, model in self.models.items():
                    save_hf_dir(model, self.tokenizer, tmp / sub, gathered[sub] if gathered else None)
                (tmp / "metrics.json").write_text(json.dumps(self.metrics, indent=2))
                optimizer = None if shards_optimizer(self.accelerator) else self.optimizer
                save_training_state(tmp, optimizer=optimizer, scheduler=self.scheduler, progress={
                    "step": step, "epoch": self.epoch, "position": self.position,
                    "skipped_steps": self.skipped, "state": self.state})
            if on_checkpoint is not None:
                on_checkpoint(path / "policy", step)
            # after registering: the newest N and the best by the step's training score (PPO
            # objective/scores, GRPO reward) stay; the newest, which resume reads, always does
            prune_checkpoints(self.output_dir, self.run_cfg.keep_last_checkpoints, ("objective/scores", "reward"))
        self.accelerator.wait_for_everyone()

    def run(self, iteration: Callable[[torch.Tensor, torch.Tensor, list[int]], dict[str, float]], *, on_log: OnLog | None = None,
            on_checkpoint: OnCheckpoint | None = None, on_eval: OnEval | None = None, evaluate: Evaluate | None = None,
            eval_every: int | None = None, repeat: int = 1, on_step: OnStep | None = None,
            show_progress: bool = True) -> RLResult:
        """Call `iteration(query_ids, query_mask, prompt_indices)` once per step on the next
        `prompts_per_step` prompts, each repeated `repeat` times (GRPO's groups)."""
        from tqdm.auto import tqdm

        rl = self.rl
        main = self.accelerator.is_main_process
        # data parallel: every process rolls out its own prompts_per_step prompts per step
        order = ShardedBatches(len(self.prompt_ids), self.prompts_per_step, self.run_cfg.seed,
                               rank=self.accelerator.process_index, world=self.accelerator.num_processes,
                               epoch=self.epoch, position=self.position)
        bar = tqdm(total=rl.total_steps, initial=self.step, desc=self.name, disable=not show_progress or not main)
        while self.step < rl.total_steps:
            started = time.perf_counter()
            indices = order.next()
            self.epoch, self.position = order.epoch, order.position
            indices = [i for i in indices for _ in range(repeat)]
            query_ids, query_mask = left_pad([self.prompt_ids[i] for i in indices], self.tokenizer.pad_token_id)
            # every process's numbers, averaged (or summed) in one all-reduce, so the log is the global batch's
            metrics = reduce_metrics(self.accelerator, iteration(query_ids.to(self.device), query_mask.to(self.device), indices),
                                     sums=self.SUMMED, mins=self.MINIMA, maxes=self.MAXIMA)
            self.scheduler.step()
            self.step += 1
            elapsed = time.perf_counter() - started
            metrics.update({"lr": self.scheduler.get_last_lr()[0], "perf/step_seconds": elapsed,
                            "perf/tokens_per_second": metrics.pop("_tokens", 0.0) / elapsed,
                            "perf/skipped_steps": float(self.skipped)})
            self.metrics = metrics
            bar.update(1)
            shown = {k: metrics[k] for k in ("objective/scores", "reward", "objective/kl", "kl") if k in metrics}
            bar.set_postfix({k.split("/")[-1]: f"{v:.3f}" for k, v in shown.items()})
            if on_step is not None:
                on_step(self.step)
            if main and on_log is not None and (self.step % rl.log_steps == 0 or self.step == rl.total_steps):
                on_log({k: v for k, v in metrics.items() if math.isfinite(v)}, self.step)
            if evaluate is not None and on_eval is not None and eval_every and (
                    self.step % eval_every == 0 or self.step == rl.total_steps):
                with self.full_parameters():  # all processes gather; the main one evaluates
                    if main:
                        on_eval(evaluate(self.models["policy"], self.step), self.step)
            if self.step % rl.save_steps == 0 or self.step == rl.total_steps:
                self._save(self.step, on_checkpoint)
        bar.close()
        final = self.output_dir / f"checkpoint-{max(self.step, self.resumed_from)}"
        return RLResult(checkpoint=final, step=self.step, metrics=self.metrics, resumed_from=self.resumed_from,
                        skipped_steps=self.skipped)
