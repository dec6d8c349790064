"""rlhf_core/training/checkpointing.py: checkpoint-N/ saved whole or not at all, pruned only once handed on,
and resumed from, on the tiny regression model of test_loop.py."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest
import torch

from rlhf_core.config import RunConfig
from rlhf_core.storage.checkpoints import STATE_DIR
from rlhf_core.training.checkpointing import Checkpointer, Progress, checkpoint_path, restore_latest
from rlhf_core.training.engine import TrainEngine
from tests.rlhf_core.training.test_loop import StubTokenizer, Tiny, same, settings, weights


def prepared_engine(model: torch.nn.Module) -> TrainEngine:
    engine = TrainEngine(model, settings(4), RunConfig(device="cpu", seed=0))
    engine.prepare(model)
    return engine


def checkpointer(output_dir, model: torch.nn.Module, name: str = "", **kw) -> Checkpointer:
    return Checkpointer(output_dir, prepared_engine(model), {name: model}, StubTokenizer(), label="test", **kw)


def names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("checkpoint-"))


def test_a_saved_checkpoint_resumes_its_weights_progress_and_metrics(tmp_path):
    # given a checkpoint with the stage's extra files
    model = Tiny(seed=0)
    saver = checkpointer(tmp_path, model)
    handed, extra = [], []

    def card(directory, metrics):
        extra.append(metrics)
        (directory / "README.md").write_text("card")

    progress = Progress(step=3, epoch=1, position=2, skipped_steps=1, state={"kl_coef": 0.5})
    path = saver.save(progress, {"loss": 0.25}, lambda p, s: handed.append((p, s)), extra_files=card)
    assert path == checkpoint_path(tmp_path, 3) == tmp_path / "checkpoint-3" and handed == [(path, 3)]
    assert (
        (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file() and (path / STATE_DIR).is_dir()
    )
    assert (path / "README.md").read_text() == "card" and extra == [{"loss": 0.25}]
    assert json.loads((path / "metrics.json").read_text()) == {"loss": 0.25}
    # when a fresh model and optimizer resume from it
    fresh = Tiny(seed=1)
    engine = TrainEngine(fresh, settings(4), RunConfig(device="cpu", seed=0))
    restored = restore_latest(tmp_path, {"": fresh}, engine.optimizer, engine.scheduler, is_main=True)
    # then the weights, the progress and the metrics come back
    assert restored.path == path and restored.progress == progress and restored.metrics == {"loss": 0.25}
    assert same(weights(fresh), weights(model)) and not same(weights(Tiny(seed=1)), weights(model))
    assert restore_latest(tmp_path / "none", {"": fresh}, engine.optimizer, engine.scheduler, is_main=True) is None


def test_on_checkpoint_receives_the_registered_model_of_the_checkpoint(tmp_path):
    model, handed = Tiny(), []
    saver = checkpointer(tmp_path, model, name="policy", registered="policy")
    saver.save(Progress(step=2), {}, lambda p, s: handed.append((p, s)))
    assert handed == [(tmp_path / "checkpoint-2" / "policy", 2)]
    assert (tmp_path / "checkpoint-2" / "policy" / "model.safetensors").is_file()


def test_old_checkpoints_go_only_once_on_checkpoint_succeeded_and_never_when_it_failed(tmp_path):
    # given three checkpoints, each handed to a registration that finishes later, keeping the newest one
    saver = checkpointer(tmp_path, Tiny(), keep_last=1)
    pending: dict[int, Future] = {}

    def register(path, step):
        pending[step] = Future()
        return pending[step]

    for step in (1, 2, 3):
        saver.save(Progress(step=step), {"loss": float(step)}, register)
    # then nothing is pruned while they run, nor when one fails or is cancelled
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    pending[3].set_exception(ConnectionError("registry down"))
    assert pending[2].cancel()
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    # and one that succeeds prunes what keep_last allows; the newest stays
    pending[1].set_result("models:/p/1")
    assert names(tmp_path) == ["checkpoint-3"]
    # on_checkpoint returning None (done with the files) prunes at once
    saver.save(Progress(step=4), {"loss": 4.0}, lambda p, s: None)
    assert names(tmp_path) == ["checkpoint-4"]


def test_the_best_checkpoint_by_best_metric_stays_beside_the_newest(tmp_path):
    saver = checkpointer(tmp_path, Tiny(), keep_last=1, best_metric=("score",))
    for step, score in [(1, 9.0), (2, 1.0), (3, 0.0)]:
        saver.save(Progress(step=step), {"score": score})  # no on_checkpoint: pruned at once
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-3"]


def test_non_finite_weights_are_refused_with_nothing_written_and_nothing_handed_on(tmp_path):
    model, handed = Tiny(), []
    saver = checkpointer(tmp_path / "out", model, name="value")
    with torch.no_grad():
        model.net[0].weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"the value model has non-finite values in net\.0\.weight"):
        saver.save(Progress(step=1), {}, lambda p, s: handed.append(s), extra_files=lambda d, m: handed.append(d))
    assert handed == [] and not (tmp_path / "out").exists()


def test_progress_of_a_checkpoint_saved_before_skipped_steps_and_state_were_recorded():
    assert Progress.from_saved({"step": 4, "epoch": 1, "position": 3}) == Progress(4, 1, 3, 0, {})
    saved = {"step": 4, "epoch": 1, "position": 3, "skipped_steps": 2, "state": {"kl_coef": 0.1}}
    assert Progress.from_saved(saved) == Progress(4, 1, 3, 2, {"kl_coef": 0.1})
