"""rlhf_core/storage/checkpoints.py: the pickle-free training state, checkpoint integrity (a torn or corrupt checkpoint is
skipped for the previous good one) and retention (run.keep_last_checkpoints)."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rlhf_core.config import RewardConfig, RunConfig
from rlhf_core.demo.world import world_rows
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.rewards.reward_model import PreferencePairs, load_reward_model, train_reward_model
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.storage.checkpoints import (
    checkpoint_problem,
    checkpoints_to_delete,
    decode,
    encode,
    latest_checkpoint,
    list_checkpoints,
    load_training_state,
    prune_checkpoints,
    safetensors_intact,
    save_training_state,
)
from rlhf_core.storage.ownership import ATOMIC_CREATOR, MARKER, host_id, remove_orphan_temps
from rlhf_core.storage.saving import atomic_dir
from rlhf_core.training.loop import Hooks


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


CARD = {"title": "test reward model", "metadata": {"base_model": "tiny"}, "body": "trained in a test"}


def truncate(path, keep=0.5):
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(int(size * keep))


def fake_checkpoint(root, step):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with atomic_dir(root / f"checkpoint-{step}") as tmp:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        (tmp / "metrics.json").write_text("{}")
        save_training_state(tmp, optimizer=optimizer, scheduler=scheduler, progress={"step": step})
    return root / f"checkpoint-{step}"


def current_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


P = Path("out")


def ck(n):
    return P / f"checkpoint-{n}"


def save(directory, step, metrics):
    with atomic_dir(directory / f"checkpoint-{step}") as tmp:
        (tmp / "metrics.json").write_text(json.dumps(metrics))
        (tmp / "weights").write_text("w")


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


CARD = {"title": "t", "metadata": {"base_model": "tiny", "datasets": ["demo"], "tags": []}, "body": "b"}


def reward_run(smoke_world, out, keep, on_log=None, accuracy=None):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    model = load_reward_model(str(smoke_world.base_model), tokenizer, seed=1)
    settings = RewardConfig(max_steps=6, batch_size=8, learning_rate=5e-3, eval_steps=1, save_steps=1, log_steps=1)
    seen = []

    def on_checkpoint(path, step):  # registration sees every checkpoint before retention runs
        seen.append((step, path.is_dir(), sorted(p.name for p in out.glob("checkpoint-*"))))

    pairs = PreferencePairs(
        world_rows(smoke_world, "preference", "train"), world_rows(smoke_world, "preference", "test"), max_length=40
    )
    hooks = Hooks(
        on_log=on_log,
        on_checkpoint=on_checkpoint,
        show_progress=False,
        on_eval=lambda m, s: accuracy.__setitem__(s, m["eval_accuracy"]) if accuracy is not None else None,
    )
    result = train_reward_model(
        model,
        tokenizer,
        pairs,
        settings,
        RunConfig(device="cpu", seed=3, keep_last_checkpoints=keep),
        output_dir=out,
        card=CARD,
        hooks=hooks,
    )
    return result, seen


def test_encode_decode_round_trips_nested_state():
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        "name": None,
        "np": np.arange(3, dtype=np.uint32),
    }
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
    (tmp_path / "checkpoint-10").mkdir()  # after 6 (numbers, not names, order them), with no training state
    (tmp_path / "checkpoint-8").write_text("a file, not a checkpoint")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert latest_checkpoint(tmp_path / "missing") is None
    # the listing every caller filters: each checkpoint-N directory, complete or not, oldest first
    assert list_checkpoints(tmp_path) == [(s, tmp_path / f"checkpoint-{s}") for s in (2, 4, 6, 10)]
    assert list_checkpoints(tmp_path / "missing") == []


def test_a_truncated_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    good, bad = fake_checkpoint(tmp_path, 2), fake_checkpoint(tmp_path, 4)
    assert latest_checkpoint(tmp_path) == bad and checkpoint_problem(bad) is None
    truncate(bad / "model.safetensors")
    assert not safetensors_intact(bad / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="rlhf_core.storage.checkpoints"):
        assert latest_checkpoint(tmp_path) == good
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"skipping checkpoint {bad} for resume: {bad / 'model.safetensors'} is truncated or corrupt" in warning
    # a damaged training state or metrics file counts too
    truncate(good / "training_state" / "state.json")
    assert latest_checkpoint(tmp_path) is None
    assert bad.is_dir() and good.is_dir()  # nothing is deleted: the user may want to look at them


@pytest.mark.slow  # a training process, killed
def test_reward_training_resumes_from_the_previous_good_checkpoint(tmp_path, smoke_world, caplog):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    rows = world_rows(smoke_world, "preference", "train")[:64]
    eval_rows = world_rows(smoke_world, "preference", "test")[:16]
    settings = RewardConfig(max_steps=4, batch_size=4, learning_rate=5e-3, eval_steps=4, save_steps=2, log_steps=1)
    out = tmp_path / "rm"

    def run():
        model = load_reward_model(str(smoke_world.base_model), tokenizer, seed=1)
        saved = []
        result = train_reward_model(
            model,
            tokenizer,
            PreferencePairs(rows, eval_rows, max_length=32),
            settings,
            RunConfig(device="cpu", seed=3),
            output_dir=out,
            card=CARD,
            hooks=Hooks(show_progress=False, on_checkpoint=lambda p, s: saved.append(s)),
        )
        return result, saved

    run()
    newest = out / "checkpoint-4"
    truncate(newest / "model.safetensors")
    # a killed save left its temporary directory behind
    orphan = out / ".checkpoint-6-x1y2z3"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"partial")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (orphan / MARKER).write_text(json.dumps({"created_by": ATOMIC_CREATOR, "host": host_id(), "pid": proc.pid}))

    with caplog.at_level(logging.WARNING):
        result, saved = run()
    assert result.resumed_from == 2 and result.step == 4 and saved == [4]
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(newest / "model.safetensors") in m and "skipping checkpoint" in m for m in messages)
    assert not orphan.exists()
    assert checkpoint_problem(newest) is None  # the redone checkpoint replaced the damaged one
    assert (newest / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~current_umask()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]


def test_selection_by_hand():
    dirs = [
        (ck(2), {"acc": 0.5}),
        (ck(10), {"acc": 0.7}),
        (ck(4), {"acc": 0.9}),
        (ck(6), {"acc": 0.6}),
        (ck(8), {"acc": 0.8}),
    ]
    # newest two are 10 and 8; the best (0.9) is 4; deleted: 2 and 6, oldest first
    assert checkpoints_to_delete(dirs, 2, "acc") == [ck(2), ck(6)]
    # the best among the newest: nothing extra kept
    assert checkpoints_to_delete(dirs, 1, "acc") == [ck(2), ck(6), ck(8)]
    assert checkpoints_to_delete(dirs, 3, "acc") == [ck(2)]
    # no metric: only the newest
    assert checkpoints_to_delete(dirs, 2, None) == [ck(2), ck(4), ck(6)]
    assert checkpoints_to_delete(dirs, 2, "missing") == [ck(2), ck(4), ck(6)]
    # keep all
    assert checkpoints_to_delete(dirs, None, "acc") == []
    assert checkpoints_to_delete(dirs, 9, "acc") == []
    # step order is numeric, not by name (checkpoint-10 is newer than checkpoint-8)
    assert ck(10) not in checkpoints_to_delete(dirs, 1, None)
    with pytest.raises(ValueError):
        checkpoints_to_delete(dirs, 0, "acc")


def test_selection_ignores_unusable_scores_and_breaks_ties_to_the_newer():
    dirs = [
        (ck(1), {"acc": math.nan}),
        (ck(2), None),
        (ck(3), {"acc": "high"}),
        (ck(4), {"acc": True}),
        (ck(5), {"acc": 0.3}),
        (ck(6), {"acc": 0.3}),
        (ck(7), {"acc": 0.1}),
        (P / "final", {"acc": 9.0}),
    ]
    # best is 0.3, tie between 5 and 6 goes to 6; newest is 7; names not checkpoint-N never come back
    assert checkpoints_to_delete(dirs, 1, "acc") == [ck(1), ck(2), ck(3), ck(4), ck(5)]


def test_prune_deletes_only_marked_checkpoints(tmp_path):
    for step, score in [(1, 0.9), (2, 0.1), (3, 0.2), (4, 0.3)]:
        save(tmp_path, step, {"objective/scores": score})
    foreign = tmp_path / "checkpoint-0"  # not made by the pipeline: never deleted, never counted
    foreign.mkdir()
    (foreign / "mine.txt").write_text("x")
    (tmp_path / "checkpoint-9").symlink_to(tmp_path / "checkpoint-2")
    (tmp_path / "notes").mkdir()

    deleted = prune_checkpoints(tmp_path, 1, ("objective/scores", "reward"))

    assert deleted == [tmp_path / "checkpoint-2", tmp_path / "checkpoint-3"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["checkpoint-0", "checkpoint-1", "checkpoint-4", "checkpoint-9", "notes"]
    assert (foreign / "mine.txt").read_text() == "x"
    assert latest_checkpoint(tmp_path) is None or latest_checkpoint(tmp_path).name != "checkpoint-2"
    assert prune_checkpoints(tmp_path, None, "reward") == []


def test_prune_falls_back_to_the_second_key(tmp_path):
    for step, reward in [(1, 0.5), (2, 0.9), (3, 0.1)]:
        save(tmp_path, step, {"reward": reward})
    assert prune_checkpoints(tmp_path, 1, ("objective/scores", "reward")) == [tmp_path / "checkpoint-1"]


def test_an_interrupted_removal_is_cleaned_up_as_an_orphan(tmp_path, monkeypatch):
    save(tmp_path, 1, {})
    save(tmp_path, 2, {})
    import shutil

    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # killed after the rename
    prune_checkpoints(tmp_path, 1, None)
    monkeypatch.undo()
    holders = [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-1-deleting-")]
    assert len(holders) == 1 and (holders[0] / MARKER).is_file() and not (tmp_path / "checkpoint-1").exists()
    # the holder is marked by this (live) process; a later run's cleanup removes it once it is gone
    marker = json.loads((holders[0] / MARKER).read_text())
    marker["pid"] = 2**22 + 12345  # a pid that does not exist
    (holders[0] / MARKER).write_text(json.dumps(marker))
    assert remove_orphan_temps(tmp_path) == holders
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_reward_stage_keeps_the_newest_and_the_most_accurate(tmp_path, smoke_world):
    out = tmp_path / "rm"

    def crash(metrics, step):
        if step == 4:
            raise RuntimeError("injected crash")

    accuracy = {}
    with pytest.raises(RuntimeError, match="injected crash"):
        reward_run(smoke_world, out, 1, on_log=crash, accuracy=accuracy)
    result, seen = reward_run(smoke_world, out, 1, accuracy=accuracy)  # resumes from the newest kept checkpoint

    assert result.resumed_from == 3 and result.step == 6
    assert [(s, exists) for s, exists, _ in seen] == [(4, True), (5, True), (6, True)]
    best = max((a, s) for s, a in accuracy.items() if s <= 6)[1]  # ties to the newer step
    assert sorted(accuracy) == [1, 2, 3, 4, 5, 6]
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == sorted({best, 6})
    assert result.checkpoint == out / "checkpoint-6" and result.checkpoint.is_dir()


def test_ppo_keeps_the_newest_and_the_best_scoring_and_resumes(tmp_path, smoke_world):
    from rlhf_core.config import PPOConfig, RLConfig
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rl.ppo import train_ppo

    tok = load_tokenizer(str(smoke_world.tokenizer))
    prompts = [r["prompt"] for r in world_rows(smoke_world, "prompt", "train")]
    out, scores, seen = tmp_path / "ppo", {}, []

    def run(steps, on_log=None):
        policy, ref = load_causal_lm(str(smoke_world.base_model)), load_causal_lm(str(smoke_world.base_model))
        value = load_reward_model(str(smoke_world.base_model), tok, seed=0)
        reward = load_reward_model(str(smoke_world.base_model), tok, seed=1)

        def log(metrics, step):
            scores[step] = metrics["objective/scores"]
            if on_log is not None:
                on_log(metrics, step)

        return train_ppo(
            rl_inputs(
                policy,
                tok,
                prompts,
                out,
                value=value,
                reference=ref,
                reward_model=reward,
                rl=RLConfig(
                    total_steps=steps, batch_size=4, learning_rate=3e-3, response_length=4, save_steps=1, log_steps=1
                ),
                ppo=PPOConfig(num_ppo_epochs=1, num_mini_batches=1),
                run=RunConfig(device="cpu", seed=5, keep_last_checkpoints=1),
                max_prompt_length=12,
                on_log=log,
                show_progress=False,
                on_checkpoint=lambda p, s: seen.append((s, p.is_dir())),
            )
        )

    def crash(metrics, step):
        if step == 4:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError, match="injected crash"):
        run(5, on_log=crash)
    result = run(5)

    assert result.resumed_from == 3 and result.step == 5
    assert seen == [(1, True), (2, True), (3, True), (4, True), (5, True)]  # every one existed when registered
    best = max((v, s) for s, v in scores.items())[1]
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == sorted({best, 5})
    assert (result.checkpoint / "policy" / "model.safetensors").is_file()


def test_each_process_gets_its_own_random_stream_back_and_only_for_the_same_process_count(tmp_path):
    from rlhf_core.storage.checkpoints import restore_process_rng, rng_state

    model, optimizer, scheduler = _setup()
    streams = []
    for seed in (1, 2):  # what two data-parallel processes hold when the checkpoint is written
        torch.manual_seed(seed)
        random.seed(seed)
        streams.append(rng_state())
    expected = []
    for state in streams:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        expected.append((torch.rand(3), random.random()))
    save_training_state(tmp_path, optimizer=optimizer, scheduler=scheduler, progress={}, process_rngs=streams)

    for rank in (1, 0):
        torch.manual_seed(99)
        assert restore_process_rng(tmp_path, rank, 2)
        drawn = (torch.rand(3), random.random())
        assert torch.equal(drawn[0], expected[rank][0]) and drawn[1] == expected[rank][1]
    # resumed on another number of processes, or from a one-process save: nothing is restored
    torch.manual_seed(99)
    before = torch.get_rng_state()
    assert not restore_process_rng(tmp_path, 0, 3)
    save_training_state(tmp_path / "one", optimizer=optimizer, scheduler=scheduler, progress={})
    assert not restore_process_rng(tmp_path / "one", 0, 2)
    assert torch.equal(torch.get_rng_state(), before)
