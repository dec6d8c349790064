"""rlhf_core/training/loop.py: the one training-loop skeleton, on a tiny two-layer regression model.

The batch order (ShardedBatches, epoch_batches), the non-finite policy, the cadence of logs, evaluations
and checkpoints, resume, gradient accumulation and the log window. No stage, no flow: a step function
and LoopSettings, as a stage plugs in.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from rlhf_core.config import RewardConfig, RunConfig
from rlhf_core.data.batching import Grouped, ShardedBatches
from rlhf_core.storage.checkpoints import STATE_DIR
from rlhf_core.training.loop import Cadence, LoopCallbacks, LoopMetrics, LoopResult, LoopSettings, TrainingLoop
from rlhf_core.training.parallel import portable_error

N_ROWS = 16


class Tiny(torch.nn.Module):
    """Two Linear layers with the two things the loop asks of a Hugging Face model: config and save_pretrained."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(tie_word_embeddings=False)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def save_pretrained(self, directory, state_dict=None, safe_serialization=True):
        Path(directory).mkdir(parents=True, exist_ok=True)
        weights = state_dict if state_dict is not None else self.state_dict()
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(Path(directory) / "model.safetensors"))


class StubTokenizer:
    def save_pretrained(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "tokenizer.json").write_text("{}")


DATA = torch.Generator().manual_seed(1)
X = torch.randn(N_ROWS, 4, generator=DATA)
Y = torch.randn(N_ROWS, generator=DATA)


def settings(
    total_steps: int,
    *,
    patience: int = 3,
    scheduler: str = "constant",
    log_every: int = 1,
    eval_every: int | None = None,
    save_every: int | None = None,
    grad_norm_key: str | None = None,
    **kw,
) -> LoopSettings:
    optim = RewardConfig(learning_rate=0.05, lr_scheduler=scheduler, max_nonfinite_steps_in_a_row=patience)
    return LoopSettings(
        name="test",
        section="reward",
        total_steps=total_steps,
        optim=optim,
        cadence=Cadence(log_every, eval_every, save_every),
        loop_metrics=LoopMetrics(grad_norm=grad_norm_key),
        **kw,
    )


def make_loop(s: LoopSettings, output_dir=None, seed: int = 0) -> tuple[TrainingLoop, Tiny]:
    model = Tiny()
    loop = TrainingLoop(
        model, {"": model}, StubTokenizer(), s, RunConfig(device="cpu", seed=seed), output_dir=output_dir
    )
    return loop, model


def run(loop: TrainingLoop, step, batches, show_progress: bool = False, **callbacks) -> LoopResult:
    """`loop.run` with the callbacks named as `LoopCallbacks` names them."""
    return loop.run(step, batches, LoopCallbacks(**callbacks), show_progress=show_progress)


def regression_step(loop: TrainingLoop, poisoned: dict[int, float] | None = None):
    """Squared error summed over the step's rows / the step's row count, whatever the micro-batching;
    the steps named in `poisoned` multiply their loss by NaN or inf."""
    poisoned = poisoned or {}

    def step(batch):
        micro = batch if batch and isinstance(batch[0], list) else [batch]
        rows = sum(len(m) for m in micro)
        total = 0.0
        for indices in micro:
            with loop.micro_batch():
                loss = ((loop.trainable(X[indices]) - Y[indices]) ** 2).sum() / rows
                if loop.step + 1 in poisoned:
                    loss = loss * poisoned[loop.step + 1]
                loop.backward(loss)
            total += float(loss.detach())
        loop.optimizer_step()
        return {"loss": total}

    return step


def batches(loop: TrainingLoop, batch_size: int = 4) -> ShardedBatches:
    return ShardedBatches(N_ROWS, batch_size, seed=0, rank=0, world=1, epoch=loop.epoch, position=loop.position)


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 0.0) -> bool:
    return all(torch.allclose(x, y, rtol=0, atol=atol) for x, y in zip(a, b))


# -- the batch order -------------------------------------------------------------------------------


# -- (a) the non-finite policy -------------------------------------------------------------------------


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_step_is_skipped_and_counted_leaving_weights_and_optimizer_alone(poison):
    loop, model = make_loop(settings(3))
    before, seen, logs = weights(model), {}, []

    def on_step(step):
        seen[step] = (weights(model), len(loop.optimizer.optimizer.state))

    result = run(
        loop,
        regression_step(loop, {1: poison}),
        batches(loop),
        on_step=on_step,
        on_log=lambda m, s: logs.append((s, m)),
        show_progress=False,
    )
    assert same(seen[1][0], before) and seen[1][1] == 0  # step 1 skipped: no update, no Adam moments
    assert not same(seen[2][0], before) and seen[2][1] > 0  # step 2 finite: stepped
    assert result.skipped_steps == 1 and result.step == 3
    assert [(s, m["perf/skipped_steps"]) for s, m in logs] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert "loss" not in logs[0][1] and "loss" in logs[1][1]  # on_log gets the finite metrics only


def test_a_finite_step_between_non_finite_ones_resets_the_count():
    loop, _ = make_loop(settings(6, patience=1))
    result = run(
        loop,
        regression_step(loop, {1: float("nan"), 3: float("nan"), 5: float("inf")}),
        batches(loop),
        show_progress=False,
    )
    assert result.skipped_steps == 3 and result.step == 6


@pytest.mark.parametrize("patience", [1, 2])
def test_one_more_than_the_patience_in_a_row_stops_naming_the_field(patience):
    loop, _ = make_loop(settings(6, patience=patience))
    ok = run(
        loop,
        regression_step(loop, {s: float("nan") for s in range(2, 2 + patience)}),
        batches(loop),
        show_progress=False,
    )
    assert ok.skipped_steps == patience  # exactly `patience` in a row is tolerated
    loop, model = make_loop(settings(6, patience=patience))
    with pytest.raises(FloatingPointError, match=rf"reward\.max_nonfinite_steps_in_a_row {patience}") as err:
        run(
            loop,
            regression_step(loop, {s: float("nan") for s in range(2, 3 + patience)}),
            batches(loop),
            show_progress=False,
        )
    assert f"{patience + 1} optimizer step(s) in a row (step {patience + 2})" in str(err.value)
    assert loop.skipped == patience + 1


def test_zero_patience_stops_at_the_first_non_finite_step():
    loop, model = make_loop(settings(3, patience=0))
    with pytest.raises(FloatingPointError, match=r"test: .*reward\.max_nonfinite_steps_in_a_row 0"):
        run(loop, regression_step(loop, {2: float("inf")}), batches(loop), show_progress=False)
    assert loop.step == 1  # the step that failed was not counted as done


# -- (b) cadence -----------------------------------------------------------------------------------------


def test_logs_evaluations_and_checkpoints_come_at_their_multiples_and_the_last_step(tmp_path):
    loop, _ = make_loop(settings(7, log_every=3, eval_every=2, save_every=3), output_dir=tmp_path)
    logged, evaluated, evals_seen, saved = [], [], [], []
    result = run(
        loop,
        regression_step(loop),
        batches(loop),
        on_log=lambda m, s: logged.append((s, m)),
        evaluate=lambda s: evaluated.append(s) or {"eval/score": float(s)},
        on_eval=lambda r, s: evals_seen.append((s, r)),
        on_checkpoint=lambda p, s: saved.append((p.name, s)),
        show_progress=False,
    )
    assert [s for s, _ in logged] == [3, 6, 7]
    assert evaluated == [2, 4, 6, 7] and [s for s, _ in evals_seen] == [2, 4, 6, 7]
    assert saved == [("checkpoint-3", 3), ("checkpoint-6", 6), ("checkpoint-7", 7)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")) == [n for n, _ in saved]
    for (name, step), (log_step, metrics) in zip(saved, logged):
        ckpt = tmp_path / name
        assert (
            (ckpt / "metrics.json").is_file() and (ckpt / STATE_DIR).is_dir() and (ckpt / "model.safetensors").is_file()
        )
        recorded = json.loads((ckpt / "metrics.json").read_text())
        assert log_step == step and recorded["loss"] == pytest.approx(metrics["loss"])  # "train": the step's metrics
    assert result.checkpoint == tmp_path / "checkpoint-7" and result.step == 7


def test_old_checkpoints_are_pruned_only_once_their_background_registration_succeeded(tmp_path):
    # given on_checkpoint handing each checkpoint to a registration that finishes later
    loop, _ = make_loop(settings(4, save_every=1, keep_last=1), output_dir=tmp_path)
    pending: dict[int, Future] = {}

    def on_checkpoint(path, step):
        pending[step] = Future()
        return pending[step]

    run(loop, regression_step(loop), batches(loop), on_checkpoint=on_checkpoint, show_progress=False)

    def names():
        return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))

    # then nothing was pruned while the registrations were running
    assert names() == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    # a failed registration prunes nothing (the next run registers what is left)
    pending[1].set_exception(ConnectionError("registry down"))
    assert len(names()) == 4
    # one that succeeded prunes what keep_last allows: the newest stays
    pending[2].set_result("models:/p/2")
    assert names() == ["checkpoint-4"]


def test_without_save_every_nothing_is_written_and_eval_metrics_can_be_what_a_checkpoint_records(tmp_path):
    loop, _ = make_loop(settings(2), output_dir=tmp_path / "none")
    assert run(loop, regression_step(loop), batches(loop), show_progress=False).checkpoint is None
    assert not (tmp_path / "none").exists()
    loop, _ = make_loop(settings(2, eval_every=1, save_every=2, checkpoint_metrics="eval"), output_dir=tmp_path / "e")
    run(loop, regression_step(loop), batches(loop), evaluate=lambda s: {"eval/score": 10.0 * s}, show_progress=False)
    assert json.loads((tmp_path / "e" / "checkpoint-2" / "metrics.json").read_text()) == {"eval/score": 20.0}


# -- (c) resume ----------------------------------------------------------------------------------------------


def test_a_run_killed_after_a_checkpoint_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    # the linear schedule, Adam's moments and the batch position must all come back
    whole, whole_model = make_loop(settings(6, save_every=3, scheduler="linear"), output_dir=tmp_path / "whole")
    run(whole, regression_step(whole), batches(whole), show_progress=False)

    class Killed(Exception):
        pass

    def kill(path, step):
        raise Killed(step)

    first, _ = make_loop(settings(6, save_every=3, scheduler="linear"), output_dir=tmp_path / "cut")
    with pytest.raises(Killed):
        run(first, regression_step(first), batches(first), on_checkpoint=kill, show_progress=False)
    assert (tmp_path / "cut" / "checkpoint-3").is_dir()

    again, again_model = make_loop(settings(6, save_every=3, scheduler="linear"), output_dir=tmp_path / "cut", seed=0)
    assert again.resumed and again.resumed_from == 3 and (again.epoch, again.position) == (0, 3)
    result = run(again, regression_step(again), batches(again), show_progress=False)
    assert result.resumed_from == 3 and result.step == 6
    assert same(weights(again_model), weights(whole_model))
    assert again.scheduler.get_last_lr() == whole.scheduler.get_last_lr()


def test_a_finished_run_resumes_to_nothing_to_do(tmp_path):
    loop, _ = make_loop(settings(2, save_every=1), output_dir=tmp_path)
    run(loop, regression_step(loop), batches(loop), show_progress=False)
    again, model = make_loop(settings(2, save_every=1), output_dir=tmp_path)
    calls = []
    result = run(again, lambda b: calls.append(b) or {}, batches(again), show_progress=False)
    assert calls == [] and result.step == 2 and result.checkpoint == tmp_path / "checkpoint-2"
    assert result.metrics == json.loads((tmp_path / "checkpoint-2" / "metrics.json").read_text())


# -- (d) gradient accumulation -------------------------------------------------------------------------------


def test_two_half_micro_batches_make_the_update_of_one_full_batch():
    # Adam hides a loss scale in the weights; the gradient norm (before clipping) shows it
    full, full_model = make_loop(settings(3, grad_norm_key="grad_norm"))
    full_result = run(full, regression_step(full), batches(full, 4), show_progress=False)
    halves, half_model = make_loop(settings(3, micro_batches=2, grad_norm_key="grad_norm"))
    # the same permutation in batches of 2: two consecutive ones are one batch of 4
    half_result = run(halves, regression_step(halves), Grouped(batches(halves, 2), 2), show_progress=False)
    assert not same(weights(half_model), weights(Tiny()))
    assert same(weights(half_model), weights(full_model), atol=1e-6)
    assert half_result.metrics["loss"] == pytest.approx(full_result.metrics["loss"], rel=1e-5)
    assert half_result.metrics["grad_norm"] == pytest.approx(full_result.metrics["grad_norm"], rel=1e-5)


# -- (e) the log window --------------------------------------------------------------------------------------


@pytest.mark.parametrize("window, expected", [("mean", [1.5, 3.5, 5.0]), ("last", [2.0, 4.0, 5.0])])
def test_the_mean_window_averages_the_steps_since_the_last_log(window, expected):
    loop, _ = make_loop(settings(5, log_every=2, log_window=window))
    logged = []

    def step(batch):
        loop.optimizer_step()  # no backward: nothing to clip, a finite step
        return {"value": float(loop.step + 1)}

    run(loop, step, batches(loop), on_log=lambda m, s: logged.append((s, m["value"])), show_progress=False)
    assert logged == list(zip([2, 4, 5], expected))


def test_what_the_evaluation_raises_ends_the_loop_at_that_step_and_crosses_processes_intact(tmp_path):
    from rlhf_core.evaluation.guard import GuardStop, Trigger

    loop, _ = make_loop(settings(6, eval_every=2, save_every=2), output_dir=tmp_path)
    trigger = Trigger("kl_budget", "stop", 4, 5.0, 1.0, "eval KL 5.000 nats > 1")

    def on_eval(result, step):
        if step == 4:
            raise GuardStop(trigger)

    with pytest.raises(GuardStop, match="eval KL 5.000 nats > 1"):
        run(loop, regression_step(loop), batches(loop), evaluate=lambda s: {}, on_eval=on_eval, show_progress=False)
    assert loop.step == 4 and sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]

    # what is broadcast to the other processes: the exception itself when it pickles, else a description
    stop = GuardStop(trigger)
    assert portable_error(stop) is stop and portable_error(None) is None

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    described = portable_error(Unpicklable("lost the store"))
    assert type(described) is RuntimeError
    assert str(described) == "the evaluating process (rank 0) failed: Unpicklable: lost the store"
