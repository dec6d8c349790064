import json
import logging
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file

from rlhf_core.checkpoint import checkpoint_problem, latest_checkpoint, safetensors_intact, save_training_state
from rlhf_core.config import RewardConfig, RunConfig
from rlhf_core.models import load_tokenizer
from rlhf_core.ownership import ATOMIC_CREATOR, MARKER, host_id
from rlhf_core.reward_model import load_reward_model, train_reward_model
from rlhf_core.training import atomic_dir

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


def test_a_truncated_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    good, bad = fake_checkpoint(tmp_path, 2), fake_checkpoint(tmp_path, 4)
    assert latest_checkpoint(tmp_path) == bad and checkpoint_problem(bad) is None
    truncate(bad / "model.safetensors")
    assert not safetensors_intact(bad / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="rlhf_core.checkpoint"):
        assert latest_checkpoint(tmp_path) == good
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"skipping checkpoint {bad} for resume: {bad / 'model.safetensors'} is truncated or corrupt" in warning
    # a damaged training state or metrics file counts too
    truncate(good / "training_state" / "state.json")
    assert latest_checkpoint(tmp_path) is None
    assert bad.is_dir() and good.is_dir()  # nothing is deleted: the user may want to look at them


def test_reward_training_resumes_from_the_previous_good_checkpoint(tmp_path, smoke_world, caplog):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    rows = [json.loads(line) for line in smoke_world.preferences("train").read_text().splitlines()][:64]
    eval_rows = [json.loads(line) for line in smoke_world.preferences("test").read_text().splitlines()][:16]
    settings = RewardConfig(max_steps=4, batch_size=4, learning_rate=5e-3, eval_steps=4, save_steps=2, log_steps=1)
    out = tmp_path / "rm"

    def run():
        model = load_reward_model(str(smoke_world.base_model), tokenizer, seed=1)
        saved = []
        result = train_reward_model(model, tokenizer, rows, eval_rows, settings, RunConfig(device="cpu", seed=3),
                                    max_length=32, output_dir=out, card=CARD, show_progress=False,
                                    on_checkpoint=lambda p, s: saved.append(s))
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


def current_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
