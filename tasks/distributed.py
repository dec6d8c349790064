"""Data-parallel stages, the worker side: `python -m tasks.distributed <spec>` in each launched process.

tasks/launcher.py writes the spec (the stage, the config, the task's inputs) and starts N processes
on this module (torchrun on CPU, accelerate on CUDA). Each runs the stage task's body with
`launched()` true, so it trains instead of launching again; rank 0 writes the Checkpoint to the
spec's result file. This module imports the stage tasks; they import only the launcher.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from rlhf_core.config import PipelineConfig
from tasks import tracking
from tasks.data import PreparedData
from tasks.initialization import InitPlan
from tasks.launcher import is_main
from tasks.reward_model import train_reward
from tasks.rl import train_policy
from tasks.stage_io import Checkpoint


def _worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    cfg = PipelineConfig.model_validate(spec["config"])
    tracking.configure(cfg.tracking_uri())
    inputs = spec["inputs"]
    data = PreparedData(**inputs["data"])
    if spec["stage"] == "reward":
        policy = Checkpoint(**inputs["policy"]) if inputs.get("policy") else None
        out = train_reward.fn(cfg, data, policy, inputs["parent_run_id"])
    else:
        out = train_policy.fn(cfg, data, InitPlan(**inputs["plan"]), inputs["parent_run_id"])
    if is_main():
        Path(spec["result"]).write_text(json.dumps(dataclasses.asdict(out), default=str))


if __name__ == "__main__":
    _worker(sys.argv[1])
