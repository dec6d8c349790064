"""The one training-loop skeleton every stage runs on: SFT, reward-model training, PPO and GRPO.

A stage builds a `TrainingLoop` over the module it trains and calls `run(step, batches)`. The loop
owns what every stage shares: the Accelerator, seeding (seed + rank under data parallelism), AdamW
and the learning-rate schedule, gradient accumulation and clipping, one non-finite policy (a step
whose gradient norm is NaN or inf is skipped and counted; N in a row stop the run), dropout,
resume from the newest complete checkpoint, the cadence of logs, evaluations and checkpoints, the
progress bar, and metrics averaged over processes. The stage's `step(batch)` does its forward and
backward passes through `micro_batch()` / `backward()`, calls `optimizer_step()`, and returns its
metrics; nothing else.

A checkpoint is `checkpoint-N/`: one Hugging Face directory per saved model (`models`, "" for the
checkpoint directory itself), `metrics.json` and `training_state/` (no pickle).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from rlhf_core.config import OptimSettings, RunConfig
from rlhf_core.storage.checkpoints import (
    latest_checkpoint,
    load_training_state,
    prune_checkpoints,
    restore_process_rng,
    rng_state,
    save_training_state,
)
from rlhf_core.storage.ownership import remove_orphan_temps
from rlhf_core.storage.saving import assert_finite, atomic_dir, restore_weights, save_hf_dir
from rlhf_core.training.determinism import disable_dropout, seed_everything
from rlhf_core.training.optimization import build_optimizer
from rlhf_core.training.parallel import (
    all_gather_objects,
    from_main,
    full_parameters,
    gathered_state_dicts,
    make_accelerator,
    portable_error,
    reduce_metrics,
    shards_optimizer,
)
from rlhf_core.training.timing import PhaseTimer


class OnLog(Protocol):
    def __call__(self, metrics: dict[str, float], step: int) -> None: ...


class OnStep(Protocol):
    """Called on every process after each optimizer step (the others are called on the main one only)."""

    def __call__(self, step: int) -> None: ...


class OnCheckpoint(Protocol):
    """Called with each saved checkpoint. It returns None when it is done with the checkpoint's files, or a
    Future that completes when it is (a registration running in the background): the loop prunes old
    checkpoints (run.keep_last_checkpoints) only then, and not at all when the Future fails, so a
    checkpoint is never deleted before it was registered."""

    def __call__(self, path: Path, step: int) -> Future | None: ...


@dataclass(frozen=True)
class LoopSettings:
    """How a stage's loop runs; each stage fills it from its config section."""

    name: str  # the progress bar's and the messages' name of the stage ("sft", "reward", "ppo", "grpo")
    section: str  # the config section named in errors ("sft", "reward", "rl")
    total_steps: int
    optim: OptimSettings  # learning rate, schedule, clipping, the non-finite patience
    micro_batches: int = 1  # backward passes per optimizer step (what counts, not optim.gradient_accumulation_steps)
    micro_batch_size: int | None = None  # DeepSpeed's "auto" micro-batch size
    log_every: int = 1
    eval_every: int | None = None  # None: no evaluation
    save_every: int | None = None  # None: no checkpoints, and so no resume (the stage saves its result itself)
    disable_dropout: bool = False
    keep_last: int | None = None  # checkpoints kept: the newest N and the best by `best_metric`
    best_metric: tuple[str, ...] = ()
    # "last": every step's metrics are averaged over processes and the latest is logged (RL, whose
    # checkpoints record the step's metrics); "mean": the steps since the last log are averaged at log time
    # (every step returns the same keys; the timing covers the last step only)
    log_window: Literal["last", "mean"] = "last"
    checkpoint_metrics: Literal["train", "eval"] = "train"  # what a checkpoint's metrics.json records
    registered: str = ""  # which saved model `on_checkpoint` receives ("" : the checkpoint directory)
    lr_key: str = "lr"
    grad_norm_key: str | None = None
    epoch_key: str | None = None
    timing: bool = False  # perf/step_seconds and perf/tokens_per_second (from a "_tokens" metric)
    shown: tuple[str, ...] = ()  # metrics shown beside the progress bar


@dataclass
class LoopResult:
    checkpoint: Path | None  # the newest checkpoint (None without checkpoints)
    step: int
    metrics: dict[str, float]  # what the last checkpoint records: the last step's (train) or evaluation's (eval)
    resumed_from: int
    skipped_steps: int


class TrainingLoop:
    """The accelerator, optimizer and schedule over `trainable`, resume, and the loop around a stage's step.

    models: name -> model saved in checkpoint-N/<name>/ ("" saves into checkpoint-N/ itself).
    state: the stage's scalars saved and restored with the training state (PPO's KL coefficient).
    """

    SUMMED = ("_tokens", "val/num_eos_tokens")  # metrics that add up over processes (the others are averaged)
    MINIMA, MAXIMA = ("completions/min_length",), ("completions/max_length",)

    def __init__(
        self,
        trainable: torch.nn.Module,
        models: dict[str, torch.nn.Module],
        tokenizer,
        settings: LoopSettings,
        run: RunConfig,
        *,
        output_dir: str | Path | None = None,
        state: dict[str, float] | None = None,
    ):
        self.settings, self.run_cfg, self.tokenizer = settings, run, tokenizer
        self.models, self.state = models, dict(state or {})
        self.output_dir = Path(output_dir) if output_dir is not None else None
        seed_everything(run.seed)
        # accumulation through accelerate: no gradient all-reduce until the last micro-batch (DDP), and
        # DeepSpeed steps its engine at that boundary only
        micro, clip = settings.micro_batch_size, settings.optim.max_grad_norm
        self.accelerator = make_accelerator(run, settings.micro_batches, micro_batch_size=micro, max_grad_norm=clip)
        self.optimizer, self.scheduler = build_optimizer(trainable, settings.optim, settings.total_steps)
        self.step = self.epoch = self.position = self.skipped = self.nonfinite_in_a_row = 0
        self.metrics: dict[str, float] = {}
        self.last_grad_norm: torch.Tensor | None = None
        resume = self._resume() if settings.save_every else None
        self.resumed_from = self.step
        self.resumed = resume is not None
        if settings.disable_dropout:  # on-policy, the first update's ratio must be exactly 1
            disable_dropout(trainable)
        # the schedule stays outside Accelerate: one step per optimizer step, whatever num_processes is
        self.trainable, self.optimizer = self.accelerator.prepare(trainable, self.optimizer)
        self.device = self.accelerator.device
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.is_main = self.accelerator.is_main_process
        if self.world > 1 and not (resume is not None and restore_process_rng(resume, self.rank, self.world)):
            # the weights are identical (loaded, then broadcast by prepare); the samples must not be: seed + rank.
            # A resume restores each process's own saved RNG (the run goes on as if never stopped); from a
            # checkpoint of another process count, seed + rank + the step reached
            seed_everything(run.seed + self.rank + 100_003 * self.step)

    def _resume(self) -> Path | None:
        if self.accelerator.is_main_process:
            remove_orphan_temps(self.output_dir)  # a killed run's half-written saves
        resume = latest_checkpoint(self.output_dir)
        if resume is not None:
            for sub, model in self.models.items():
                restore_weights(model, resume / sub)
            progress = load_training_state(resume, optimizer=self.optimizer, scheduler=self.scheduler)
            self.step, self.epoch, self.position = progress["step"], progress["epoch"], progress["position"]
            self.skipped = progress.get("skipped_steps", 0)
            self.state.update(progress.get("state", {}))
            self.metrics = json.loads((resume / "metrics.json").read_text())
        return resume

    # -- what a stage's step calls --------------------------------------------------------------

    def micro_batch(self):
        """Context for one micro-batch's forward and backward (gradient accumulation)."""
        return self.accelerator.accumulate(self.trainable)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch loss already normalized over the optimizer step (accelerate would
        divide it by the number of micro-batches once more)."""
        self.accelerator.backward(loss * self.accelerator.gradient_accumulation_steps)

    def optimizer_step(self) -> None:
        """Clip and step; skip (and count) a step whose gradient norm is not finite, and stop after
        `max_nonfinite_steps_in_a_row` of them. A NaN or inf loss on any process poisons the averaged
        gradients on all of them, so all of them skip. A skipped step still counts as a step of the
        schedule and of total_steps (its data is not replayed). The only host-device synchronization of a step.
        """
        optim = self.settings.optim
        norm = self.accelerator.clip_grad_norm_(self.trainable.parameters(), optim.max_grad_norm)
        finite = norm is None or bool(torch.isfinite(torch.as_tensor(norm)))  # None: DeepSpeed clips in its engine
        if finite:
            self.optimizer.step()
            self.nonfinite_in_a_row = 0
            self.last_grad_norm = norm
        else:
            self.skipped += 1
            self.nonfinite_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.nonfinite_in_a_row > optim.max_nonfinite_steps_in_a_row:
            raise FloatingPointError(
                f"{self.settings.name}: the gradient norm was {float(norm)} in {self.nonfinite_in_a_row} optimizer step(s) "
                f"in a row (step {self.step + 1}), more than {self.settings.section}.max_nonfinite_steps_in_a_row "
                f"{optim.max_nonfinite_steps_in_a_row}; stopping before a corrupt update is saved"
            )

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

    def _reduce(self, metrics: dict[str, Any]) -> dict[str, float]:
        """Every process's numbers in one collective: averaged, or summed / min / max for the keys above."""
        keys = set(metrics)
        return reduce_metrics(
            self.accelerator,
            metrics,
            sums=[k for k in self.SUMMED if k in keys],
            mins=[k for k in self.MINIMA if k in keys],
            maxes=[k for k in self.MAXIMA if k in keys],
        )

    def _loop_metrics(self, metrics: dict[str, float], elapsed: float) -> dict[str, float]:
        s = self.settings
        metrics[s.lr_key] = self.scheduler.get_last_lr()[0]
        if s.epoch_key is not None:
            metrics[s.epoch_key] = self._batches.fraction  # epochs done, as a fraction
        if s.grad_norm_key is not None and self.last_grad_norm is not None:
            metrics[s.grad_norm_key] = float(self.last_grad_norm)
        tokens = metrics.pop("_tokens", 0.0)
        if s.timing:
            metrics.update({"perf/step_seconds": elapsed, "perf/tokens_per_second": tokens / elapsed})
        metrics["perf/skipped_steps"] = float(self.skipped)
        return metrics

    def _save(self, on_checkpoint: OnCheckpoint | None, extra_files: Callable[[Path, dict], None] | None) -> None:
        gathered = gathered_state_dicts(self.accelerator, self.trainable, self.models)  # collective; None unsharded
        process_rngs = all_gather_objects(rng_state()) if self.world > 1 else None  # collective
        if self.is_main:
            path = self.output_dir / f"checkpoint-{self.step}"
            for sub, model in self.models.items():
                assert_finite(model, f"the {sub or self.settings.name} model", gathered[sub] if gathered else None)
            with atomic_dir(path) as tmp:
                for sub, model in self.models.items():
                    save_hf_dir(model, self.tokenizer, tmp / sub, gathered[sub] if gathered else None)
                if extra_files is not None:
                    extra_files(tmp, self.metrics)
                (tmp / "metrics.json").write_text(json.dumps(self.metrics, indent=2))
                optimizer = None if shards_optimizer(self.accelerator) else self.optimizer
                save_training_state(
                    tmp,
                    optimizer=optimizer,
                    scheduler=self.scheduler,
                    progress={
                        "step": self.step,
                        "epoch": self.epoch,
                        "position": self.position,
                        "skipped_steps": self.skipped,
                        "state": self.state,
                    },
                    process_rngs=process_rngs,
                )
            pending = None
            if on_checkpoint is not None:
                pending = on_checkpoint(
                    path / self.settings.registered if self.settings.registered else path, self.step
                )
            # after registering: the newest N and the best by `best_metric` stay; the newest, which resume reads, always does
            if pending is None:
                self._prune()
            else:
                pending.add_done_callback(lambda done: None if done.cancelled() or done.exception() else self._prune())
        self.accelerator.wait_for_everyone()

    def _prune(self) -> None:
        prune_checkpoints(self.output_dir, self.settings.keep_last, self.settings.best_metric or None)

    def _due(self, every: int | None) -> bool:
        return bool(every) and (self.step % every == 0 or self.step == self.settings.total_steps)

    def run(
        self,
        step: Callable[[Any], dict[str, Any]],
        batches,
        *,
        on_log: OnLog | None = None,
        evaluate: Callable[[int], Any] | None = None,
        on_eval: Callable[[Any, int], None] | None = None,
        on_checkpoint: OnCheckpoint | None = None,
        on_step: OnStep | None = None,
        extra_files: Callable[[Path, dict], None] | None = None,
        show_progress: bool = True,
    ) -> LoopResult:
        """Call `step(batches.next())` until settings.total_steps optimizer rounds are done.

        `batches` has `next()`; its `epoch` and `position` (when it has them) are saved in checkpoints.
        `evaluate(step)` runs on the main process every settings.eval_every steps and at the end, with the
        parameters whole; its result goes to `on_eval(result, step)`. `on_log(metrics, step)` gets the
        finite metrics on the main process, `on_step(step)` runs on every process after each step.
        """
        from tqdm.auto import tqdm

        s = self.settings
        self._batches, self._window = batches, []
        bar = tqdm(total=s.total_steps, initial=self.step, desc=s.name, disable=not show_progress or not self.is_main)
        # what the loop does around the steps (logging, evaluation, checkpoints), logged at the next log step
        around = PhaseTimer(self.device, enabled=s.timing)
        try:
            while self.step < s.total_steps:
                started = time.perf_counter()
                metrics = step(batches.next())
                self.epoch, self.position = getattr(batches, "epoch", 0), getattr(batches, "position", 0)
                if s.log_window == "last":  # every process's numbers, one all-reduce per step
                    metrics = self._reduce(metrics)
                else:
                    self._window.append(metrics)
                self.scheduler.step()
                self.step += 1
                bar.update(1)
                if s.log_window == "last":
                    self.metrics = self._loop_metrics(metrics, time.perf_counter() - started)
                    self._show(bar, self.metrics)
                if on_step is not None:
                    on_step(self.step)
                if self._due(s.log_every):
                    logged = self._logged(bar, started)
                    if self.is_main and on_log is not None:
                        with around("log"):
                            on_log({**{k: v for k, v in logged.items() if math.isfinite(v)}, **around.pop()}, self.step)
                if evaluate is not None and self._due(s.eval_every):
                    with around("eval"), self.full_parameters():  # every process gathers; the main one evaluates
                        self._evaluate(evaluate, on_eval)
                if self._due(s.save_every):
                    with around("checkpoint"):
                        self._save(on_checkpoint, extra_files)
        finally:  # a callback that raises (the guard's stop or rollback) leaves no bar behind
            bar.close()
        final = self.output_dir / f"checkpoint-{self.step}" if s.save_every else None
        return LoopResult(
            checkpoint=final,
            step=self.step,
            metrics=self.metrics,
            resumed_from=self.resumed_from,
            skipped_steps=self.skipped,
        )

    def _logged(self, bar, started: float) -> dict[str, float]:
        """What a log step logs: the last step's metrics, or the means of the window's steps over the global
        batch (one all-reduce)."""
        if self.settings.log_window == "last":
            return self.metrics
        window, self._window = self._window, []
        means = {k: torch.stack([torch.as_tensor(w[k]) for w in window]).float().mean() for k in window[0]}
        logged = self._loop_metrics(self._reduce(means), time.perf_counter() - started)
        if self.settings.checkpoint_metrics == "train":
            self.metrics = logged
        self._show(bar, logged)
        return logged

    def _evaluate(self, evaluate: Callable[[int], Any], on_eval: Callable[[Any, int], None] | None) -> None:
        """`evaluate` and `on_eval` on the main process. What they raise (the guard's stop or rollback, a
        failure) is raised on every process at this same point: a decision taken where the evaluation ran
        is acted on everywhere, and no process waits in a collective for one that has left the loop."""
        error: Exception | None = None
        if self.is_main:
            try:
                result = evaluate(self.step)
                if self.settings.checkpoint_metrics == "eval":
                    self.metrics = result
                if on_eval is not None:
                    on_eval(result, self.step)
            except Exception as err:  # noqa: BLE001 (re-raised below, here and on the other processes)
                error = err
        if self.world > 1:
            shared = from_main(portable_error(error))
            if error is None and shared is not None:
                raise shared
        if error is not None:
            raise error

    def _show(self, bar, metrics: dict[str, float]) -> None:
        shown = {k.split("/")[-1]: f"{metrics[k]:.3f}" for k in self.settings.shown if k in metrics}
        if shown:
            bar.set_postfix(shown)
