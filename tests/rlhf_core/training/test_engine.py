"""rlhf_core/training/engine.py: what a stage's step trains through, on the tiny regression model of
test_loop.py: gradient accumulation, the non-finite policy, dropout, seeding and the one-process collectives."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import RunConfig
from rlhf_core.training.engine import TrainEngine
from tests.rlhf_core.training.test_loop import Tiny, X, Y, same, settings, weights


def prepared_engine(model: torch.nn.Module, seed: int = 0, **kw) -> TrainEngine:
    engine = TrainEngine(model, settings(4, **kw), RunConfig(device="cpu", seed=seed))
    engine.prepare(model)
    return engine


def one_step(engine: TrainEngine, factor: float = 1.0) -> None:
    with engine.micro_batch():
        engine.backward(((engine.trainable(X) - Y) ** 2).mean() * factor)
    engine.optimizer_step()


def test_two_half_micro_batches_accumulate_the_gradient_of_the_whole_batch():
    reference = Tiny()
    ((reference(X[:4]) - Y[:4]) ** 2).mean().backward()
    engine = prepared_engine(Tiny(), micro_batches=2)
    for half in (slice(0, 2), slice(2, 4)):
        with engine.micro_batch():  # each loss already divided by the step's 4 rows
            engine.backward(((engine.trainable(X[half]) - Y[half]) ** 2).sum() / 4)
    for ours, expected in zip(engine.trainable.parameters(), reference.parameters()):
        assert torch.allclose(ours.grad, expected.grad, rtol=0, atol=1e-6)


def test_a_non_finite_step_is_skipped_counted_and_stops_the_run_past_the_patience():
    model = Tiny()
    engine = prepared_engine(model, patience=1)
    before = weights(model)
    # a NaN gradient: no update, the gradients cleared, counted
    one_step(engine, float("nan"))
    assert same(weights(model), before) and all(p.grad is None for p in model.parameters())
    assert (engine.skipped, engine.nonfinite_in_a_row, engine.last_grad_norm) == (1, 1, None)
    # a finite one: an update, and the count in a row starts again
    one_step(engine)
    assert not same(weights(model), before)
    assert (engine.skipped, engine.nonfinite_in_a_row) == (1, 0) and torch.isfinite(engine.last_grad_norm)
    # two in a row with a patience of one: stopped, naming the step and the config field
    engine.step = 4  # the loop counts the steps done
    one_step(engine, float("inf"))
    with pytest.raises(FloatingPointError, match=r"test: .* in 2 optimizer step\(s\) in a row \(step 5\), .*"):
        one_step(engine, float("inf"))
    assert engine.skipped == 3


def test_prepare_turns_dropout_off_only_when_the_settings_ask():
    def with_dropout():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))

    assert prepared_engine(with_dropout()).unwrapped()[1].p == 0.5
    assert prepared_engine(with_dropout(), disable_dropout=True).unwrapped()[1].p == 0.0


def test_an_engine_seeds_every_generator_with_the_runs_seed():
    TrainEngine(Tiny(), settings(4), RunConfig(device="cpu", seed=7))
    drawn = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(3))


def test_on_one_process_the_collectives_are_the_values_themselves():
    model = Tiny()
    engine = prepared_engine(model)
    value = torch.arange(3.0)
    assert engine.world == 1 and engine.rank == 0 and engine.is_main
    assert engine.global_sum(value) is value and engine.gather(value) is value
    assert engine.unwrapped() is model
    with engine.full_parameters():
        assert engine.trainable(X).shape == (len(X),)
