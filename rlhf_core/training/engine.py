"""What a stage's step trains through: the Accelerator, AdamW and the learning-rate schedule over one module,
gradient accumulation and clipping, the non-finite policy, and the collectives over data-parallel processes.

An engine is built in two steps so that a resume can load weights and optimizer state in between: the
constructor seeds and builds the accelerator, the optimizer and the schedule; `prepare(trainable)` hands
the module and the optimizer to Accelerate. `TrainingLoop` is the engine with the loop around the steps.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlhf_core.config import OptimSettings, RunConfig
from rlhf_core.training.determinism import disable_dropout, seed_everything
from rlhf_core.training.optimization import build_optimizer
from rlhf_core.training.parallel import full_parameters, make_accelerator


class EngineSettings(Protocol):
    """What the engine reads of a stage's `LoopSettings`."""

    name: str  # the stage's name in messages
    section: str  # the config section named in errors
    total_steps: int  # the schedule's length
    optim: OptimSettings  # learning rate, schedule, clipping, the non-finite patience
    micro_batches: int  # backward passes per optimizer step
    micro_batch_size: int | None  # DeepSpeed's "auto" micro-batch size
    disable_dropout: bool


class TrainEngine:
    """The accelerator, optimizer and schedule over `trainable`, and what a stage's step calls of them.

    step: optimizer rounds done (the loop counts them); skipped: those skipped for a non-finite gradient norm.
    """

    def __init__(self, trainable: torch.nn.Module, settings: EngineSettings, run: RunConfig):
        self.settings, self.run_cfg = settings, run
        seed_everything(run.seed)
        # accumulation through accelerate: no gradient all-reduce until the last micro-batch (DDP), and
        # DeepSpeed steps its engine at that boundary only
        micro, clip = settings.micro_batch_size, settings.optim.max_grad_norm
        self.accelerator = make_accelerator(run, settings.micro_batches, micro_batch_size=micro, max_grad_norm=clip)
        self.optimizer, self.scheduler = build_optimizer(trainable, settings.optim, settings.total_steps)
        self.step = self.skipped = self.nonfinite_in_a_row = 0
        self.last_grad_norm: torch.Tensor | None = None

    def prepare(self, trainable: torch.nn.Module) -> None:
        """Hand `trainable` and the optimizer to Accelerate (once the weights and optimizer state are loaded)."""
        if self.settings.disable_dropout:  # on-policy, the first update's ratio must be exactly 1
            disable_dropout(trainable)
        # the schedule stays outside Accelerate: one step per optimizer step, whatever num_processes is
        self.trainable, self.optimizer = self.accelerator.prepare(trainable, self.optimizer)
        self.device = self.accelerator.device
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.is_main = self.accelerator.is_main_process

    def micro_batch(self):
        """Context for one micro-batch's forward and backward (gradient accumulation)."""
        return self.accelerator.accumulate(self.trainable)

    def accumulate_over(self, micro_batches: int) -> None:
        """The next optimizer step accumulates `micro_batches` micro-batches (a token budget's count varies by
        step): gradients are synchronized on the last of them."""
        self.accelerator.gradient_accumulation_steps = micro_batches
        self.accelerator.step = 0

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
