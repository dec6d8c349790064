"""The one training-loop skeleton every stage runs on: SFT, reward-model training, PPO and GRPO.

A stage builds a `TrainingLoop` over the module it trains and calls `run(step, batches, callbacks)`. The
loop owns what every stage shares: through its `TrainEngine`, the Accelerator, seeding (seed + rank under
data parallelism), AdamW and the learning-rate schedule, gradient accumulation and clipping, one
non-finite policy (a step whose gradient norm is NaN or inf is skipped and counted; N in a row stop the
run) and dropout; itself, resume from the newest complete checkpoint, the cadence of logs, evaluations
and checkpoints, the progress bar, and metrics averaged over processes. The stage's `step(batch)` does
its forward and backward passes through `micro_batch()` / `backward()`, calls `optimizer_step()`, and
returns its metrics; nothing else. What a checkpoint holds and when old ones go is the `Checkpointer`'s
(checkpointing.py); what a log step logs is the `MetricWindow`'s (metric_window.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from rlhf_core.config import OptimSettings, RunConfig
from rlhf_core.storage.checkpoints import restore_process_rng
from rlhf_core.training.checkpointing import (
    Checkpointer,
    OnCheckpoint,
    Progress,
    Restored,
    checkpoint_path,
    restore_latest,
)
from rlhf_core.training.determinism import seed_everything
from rlhf_core.training.engine import TrainEngine
from rlhf_core.training.metric_window import LoopMetrics, MetricWindow, metric_window, reduce_over_processes
from rlhf_core.training.parallel import from_main, portable_error
from rlhf_core.training.timing import PhaseTimer

Step = Callable[[Any], dict[str, Any]]  # a stage's step: one batch in, that optimizer step's metrics out


class OnLog(Protocol):
    def __call__(self, metrics: dict[str, float], step: int) -> None: ...


class OnStep(Protocol):
    """Called on every process after each optimizer step (the others are called on the main one only)."""

    def __call__(self, step: int) -> None: ...


@dataclass(frozen=True)
class Cadence:
    """Every how many optimizer steps the loop logs, evaluates and saves; each also at the last step."""

    log_every: int = 1
    eval_every: int | None = None  # None: no evaluation
    save_every: int | None = None  # None: no checkpoints, and so no resume (the stage saves its result itself)


@dataclass(frozen=True)
class LoopSettings:
    """How a stage's loop runs; each stage fills it from its config section."""

    name: str  # the progress bar's and the messages' name of the stage ("sft", "reward", "ppo", "grpo")
    section: str  # the config section named in errors ("sft", "reward", "rl")
    total_steps: int
    optim: OptimSettings  # learning rate, schedule, clipping, the non-finite patience
    micro_batches: int = 1  # backward passes per optimizer step (what counts, not optim.gradient_accumulation_steps)
    micro_batch_size: int | None = None  # DeepSpeed's "auto" micro-batch size
    disable_dropout: bool = False
    cadence: Cadence = field(default_factory=Cadence)
    log_window: Literal["last", "mean"] = "last"  # the latest step's metrics, or their means (see metric_window)
    loop_metrics: LoopMetrics = field(default_factory=LoopMetrics)
    shown: tuple[str, ...] = ()  # metrics shown beside the progress bar
    checkpoint_metrics: Literal["train", "eval"] = "train"  # what a checkpoint's metrics.json records
    keep_last: int | None = None  # checkpoints kept: the newest N and the best by `best_metric`
    best_metric: tuple[str, ...] = ()
    registered: str = ""  # which saved model `on_checkpoint` receives ("" : the checkpoint directory)


@dataclass(frozen=True)
class LoopCallbacks:
    """What a stage's caller receives along the loop; all optional."""

    on_log: OnLog | None = None  # the finite metrics of each log step, on the main process
    on_step: OnStep | None = None
    evaluate: Callable[[int], Any] | None = None  # evaluate(step) on the main process, the parameters whole
    on_eval: Callable[[Any, int], None] | None = None  # on_eval(evaluate's result, step)
    on_checkpoint: OnCheckpoint | None = None
    extra_files: Callable[[Path, dict], None] | None = None  # extra_files(directory, metrics) adds to a checkpoint


@dataclass(frozen=True)
class Hooks:
    """What the caller of a stage's trainer receives along the way (all optional: see `LoopCallbacks`), and whether
    the stage shows a progress bar."""

    on_log: OnLog | None = None
    on_checkpoint: OnCheckpoint | None = None
    on_step: OnStep | None = None
    on_eval: Callable[[Any, int], None] | None = None
    show_progress: bool = True


NO_HOOKS = Hooks()


@dataclass
class LoopResult:
    checkpoint: Path | None  # the newest checkpoint (None without checkpoints)
    step: int
    metrics: dict[str, float]  # what the last checkpoint records: the last step's (train) or evaluation's (eval)
    resumed_from: int
    skipped_steps: int


def show_metrics(bar, shown: tuple[str, ...], metrics: dict[str, float]) -> None:
    """`shown` of `metrics` beside the progress bar, by their last name part."""
    postfix = {k.split("/")[-1]: f"{metrics[k]:.3f}" for k in shown if k in metrics}
    if postfix:
        bar.set_postfix(postfix)


def raise_everywhere(on_main: Callable[[], None], is_main: bool, world: int) -> None:
    """`on_main()` on the main process. What it raises (the guard's stop or rollback, a failure) is raised on
    every process at this same point: a decision taken where it ran is acted on everywhere, and no process
    waits in a collective for one that has left the loop."""
    error: Exception | None = None
    if is_main:
        try:
            on_main()
        except Exception as err:  # noqa: BLE001 (re-raised below, here and on the other processes)
            error = err
    if world > 1:
        shared = from_main(portable_error(error))
        if error is None and shared is not None:
            raise shared
    if error is not None:
        raise error


class TrainingLoop(TrainEngine):
    """The engine over `trainable`, resume, and the loop around a stage's step.

    models: name -> model saved in checkpoint-N/<name>/ ("" saves into checkpoint-N/ itself).
    state: the stage's scalars saved and restored with the training state (PPO's KL coefficient).
    """

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
        super().__init__(trainable, settings, run)
        self.models, self.state, self.tokenizer = models, dict(state or {}), tokenizer
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.epoch = self.position = 0
        self.metrics: dict[str, float] = {}  # what the next checkpoint records
        resume = self._resume() if settings.cadence.save_every else None
        self.resumed_from, self.resumed = self.step, resume is not None
        self.prepare(trainable)
        if self.world > 1 and not (resume is not None and restore_process_rng(resume.path, self.rank, self.world)):
            # the weights are identical (loaded, then broadcast by prepare); the samples must not be: seed + rank.
            # A resume restores each process's own saved RNG (the run goes on as if never stopped); from a
            # checkpoint of another process count, seed + rank + the step reached
            seed_everything(run.seed + self.rank + 100_003 * self.step)
        self.checkpointer = self._checkpointer() if settings.cadence.save_every else None

    def _resume(self) -> Restored | None:
        is_main = self.accelerator.is_main_process
        restored = restore_latest(self.output_dir, self.models, self.optimizer, self.scheduler, is_main=is_main)
        if restored is not None:
            saved = restored.progress
            self.step, self.epoch, self.position = saved.step, saved.epoch, saved.position
            self.skipped = saved.skipped_steps
            self.state.update(saved.state)
            self.metrics = restored.metrics
        return restored

    def _checkpointer(self) -> Checkpointer:
        s = self.settings
        return Checkpointer(
            self.output_dir,
            self,
            self.models,
            self.tokenizer,
            label=s.name,
            keep_last=s.keep_last,
            best_metric=s.best_metric,
            registered=s.registered,
        )

    def run(
        self, step: Step, batches, callbacks: LoopCallbacks | None = None, *, show_progress: bool = True
    ) -> LoopResult:
        """Call `step(batches.next())` until settings.total_steps optimizer rounds are done.

        `batches` has `next()`; its `epoch` and `position` (when it has them) are saved in checkpoints. Logs,
        evaluations and checkpoints come every settings.cadence steps and at the last one (see LoopCallbacks).
        """
        from tqdm.auto import tqdm

        s, callbacks = self.settings, callbacks or LoopCallbacks()
        bar = tqdm(total=s.total_steps, initial=self.step, desc=s.name, disable=not show_progress or not self.is_main)
        window = self._window(batches, bar)
        # what the loop does around the steps (logging, evaluation, checkpoints), logged at the next log step
        around = PhaseTimer(self.device, enabled=s.loop_metrics.timing)
        try:
            while self.step < s.total_steps:
                started = time.perf_counter()
                metrics = step(batches.next())
                self.epoch, self.position = getattr(batches, "epoch", 0), getattr(batches, "position", 0)
                window.record(metrics)
                self.scheduler.step()
                self.step += 1
                bar.update(1)
                latest = window.stepped(started)
                if latest is not None:  # the "last" window's: a checkpoint records the step's metrics
                    self.metrics = latest
                if callbacks.on_step is not None:
                    callbacks.on_step(self.step)
                self._log_evaluate_save(window, started, callbacks, around)
        finally:  # a callback that raises (the guard's stop or rollback) leaves no bar behind
            bar.close()
        final = checkpoint_path(self.output_dir, self.step) if self.checkpointer else None
        return LoopResult(final, self.step, self.metrics, self.resumed_from, self.skipped)

    def _window(self, batches, bar) -> MetricWindow:
        """The settings' log window, adding the loop's own numbers and showing what it makes beside `bar`."""
        own = self.settings.loop_metrics

        def annotate(metrics: dict[str, float], elapsed: float) -> dict[str, float]:
            lr = self.scheduler.get_last_lr()[0]
            return own.add(
                metrics, elapsed, lr=lr, batches=batches, grad_norm=self.last_grad_norm, skipped=self.skipped
            )

        reduce = partial(reduce_over_processes, self.accelerator)
        return metric_window(
            self.settings.log_window, reduce, annotate, partial(show_metrics, bar, self.settings.shown)
        )

    def _log_evaluate_save(
        self, window: MetricWindow, started: float, callbacks: LoopCallbacks, around: PhaseTimer
    ) -> None:
        """What the cadence asks for after the step: the log, then the evaluation, then the checkpoint."""
        cadence = self.settings.cadence
        if self._due(cadence.log_every):
            logged = window.logged(started)
            if self.settings.checkpoint_metrics == "train":
                self.metrics = logged
            if self.is_main and callbacks.on_log is not None:
                with around("log"):
                    finite = {k: v for k, v in logged.items() if math.isfinite(v)}
                    callbacks.on_log({**finite, **around.pop()}, self.step)
        if callbacks.evaluate is not None and self._due(cadence.eval_every):
            with around("eval"), self.full_parameters():  # every process gathers; the main one evaluates
                raise_everywhere(partial(self._evaluate, callbacks), self.is_main, self.world)
        if self._due(cadence.save_every):
            with around("checkpoint"):
                progress = Progress(self.step, self.epoch, self.position, self.skipped, self.state)
                self.checkpointer.save(progress, self.metrics, callbacks.on_checkpoint, callbacks.extra_files)

    def _evaluate(self, callbacks: LoopCallbacks) -> None:
        result = callbacks.evaluate(self.step)
        if self.settings.checkpoint_metrics == "eval":
            self.metrics = result
        if callbacks.on_eval is not None:
            callbacks.on_eval(result, self.step)

    def _due(self, every: int | None) -> bool:
        return bool(every) and (self.step % every == 0 or self.step == self.settings.total_steps)
