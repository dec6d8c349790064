import json
import random

import numpy as np
import pytest
import torch

from rlhf_core.checkpoint import (
    decode, encode, latest_checkpoint, load_training_state, save_training_state,
)


def test_encode_decode_round_trips_nested_state():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}], "name": None,
             "np": np.arange(3, dtype=np.uint32)}
    tensors = {}
    blob = json.loads(json.dumps(encode(state, tensors)))  # survives JSON
    back = decode(blob, tensors)
    assert list(back["state"]) == [0]  # the int key is still an int
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2]


def test_objects_that_would_need_pickle_are_refused():
    with pytest.raises(TypeError, match="without pickle"):
        encode({"fn": object()}, {})


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_saved_state_resumes_exactly(tmp_path):
    # given a run of 3 steps, saved, then 2 more steps
    model, optimizer, scheduler = _setup()
    for _ in range(3):
        _step(model, optimizer, scheduler)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    save_training_state(tmp_path, optimizer=optimizer, scheduler=scheduler, progress={"step": 3, "epoch": 0})
    py, npy = random.random(), np.random.rand()
    for _ in range(2):
        _step(model, optimizer, scheduler)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # when a fresh process restores the state and does the same 2 steps
    model2, optimizer2, scheduler2 = _setup()
    model2.load_state_dict(weights)
    progress = load_training_state(tmp_path, optimizer=optimizer2, scheduler=scheduler2)
    assert (random.random(), np.random.rand()) == (py, npy)
    for _ in range(2):
        _step(model2, optimizer2, scheduler2)

    # then it lands on the same weights and schedule
    assert progress == {"step": 3, "epoch": 0}
    for key, value in expected.items():
        torch.testing.assert_close(model2.state_dict()[key], value, rtol=0, atol=0)
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert not list(tmp_path.glob("training_state/*.pt")) and not list(tmp_path.glob("**/*.bin"))


def test_latest_checkpoint_skips_incomplete_ones(tmp_path):
    model, optimizer, scheduler = _setup()
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "config.json").write_text("{}")
    for step in (2, 4):
        save_training_state(tmp_path / f"checkpoint-{step}", optimizer=optimizer, scheduler=scheduler, progress={})
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert latest_checkpoint(tmp_path / "missing") is None
