"""Pipeline overhead: the Prefect flow with MLflow tracking against the bare training loops, same config.

Both sides start from the same demo world and run the same SFT, reward-model and PPO steps with the
same configs (configs/demo.yaml, shortened). The bare side calls the rlhf_core training functions
directly (no Prefect, no MLflow, no evaluation, no registration); the flow side runs
`rlhf_pipeline` (on a Prefect server started beforehand, not timed) into a fresh output directory
and SQLite store. Reported: the flow's wall time over the bare loops' (the anchor), and what the
difference is made of: registered versions, the time of the evaluations the config asks for (the RL
stage's `time/eval_s`, which the ratio excluding evaluations leaves out), the RL checkpoints'
save-and-register time (`time/checkpoint_s`), config validation with preflight, and a new MLflow
store's start-up, each measured apart.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from anchors import pipeline_main  # noqa: E402  (after the repository root is on sys.path)

OVERRIDES = [
    "sft.max_steps=100",
    "reward.max_steps=100",
    "reward.save_steps=50",
    "reward.eval_steps=50",
    "rl.total_steps=20",
    "rl.save_steps=10",
    "eval.every_steps=10",
]


def bare(cfg, root: Path) -> float:
    """The training loops alone, as a user would call them."""
    from rlhf_core.demo_world import build_demo_world, world_rows
    from rlhf_core.models import load_causal_lm, load_tokenizer
    from rlhf_core.ppo import train_ppo
    from rlhf_core.reward_model import load_reward_model, train_reward_model
    from rlhf_core.sft import train_sft

    world = build_demo_world(root / "demo_world", cfg.run.seed, cfg.data.demo, cfg.model.demo)  # cached: built before
    start = time.perf_counter()
    tok = load_tokenizer(str(world.tokenizer))
    model = load_causal_lm(str(world.base_model))
    train_sft(
        model,
        tok,
        [r["text"] for r in world_rows(world, "text")],
        cfg.sft,
        cfg.run,
        max_length=cfg.data.max_length,
        output_dir=root / "bare-sft",
        show_progress=False,
    )
    reward = load_reward_model(str(root / "bare-sft"), tok, seed=cfg.run.seed)
    card = {"title": "reward", "metadata": {}, "body": ""}
    result = train_reward_model(
        reward,
        tok,
        world_rows(world, "preference", "train"),
        world_rows(world, "preference", "test"),
        cfg.reward,
        cfg.run,
        max_length=cfg.data.max_length,
        output_dir=root / "bare-reward",
        card=card,
        show_progress=False,
    )
    policy, ref = load_causal_lm(str(root / "bare-sft")), load_causal_lm(str(root / "bare-sft"))
    value = load_reward_model(str(result.checkpoint), tok, seed=cfg.run.seed)
    reward_model = load_reward_model(str(result.checkpoint), tok, seed=cfg.run.seed).eval()
    train_ppo(
        policy,
        value,
        ref,
        reward_model,
        tok,
        [r["prompt"] for r in world_rows(world, "prompt", "train")],
        cfg.rl,
        cfg.ppo,
        cfg.run,
        max_prompt_length=cfg.data.max_prompt_length,
        output_dir=root / "bare-ppo",
        show_progress=False,
    )
    return time.perf_counter() - start


def flow(root: Path) -> tuple[float, dict]:
    from flows.rlhf_pipeline import rlhf_pipeline

    overrides = OVERRIDES + [f"run.output_dir={root / 'flow'}", f"tracking.uri=sqlite:///{root / 'mlflow.db'}"]
    start = time.perf_counter()
    summary = rlhf_pipeline(config_path=str(HERE.parent / "configs" / "demo.yaml"), overrides=overrides)
    return time.perf_counter() - start, summary


def fixed_costs(root: Path) -> dict[str, float]:
    """Seconds of config validation + preflight, and of a new SQLite MLflow store with its experiment."""
    from rlhf_core.config import load_config
    from tasks import tracking
    from tasks.preflight import preflight

    start = time.perf_counter()
    cfg = load_config(HERE.parent / "configs" / "demo.yaml", OVERRIDES)
    preflight(cfg)
    validation = time.perf_counter() - start
    uri = f"sqlite:///{root / 'startup.db'}"
    start = time.perf_counter()
    tracking.configure(uri)
    tracking.ensure_experiment("startup", uri)
    return {"validation_s": validation, "store_startup_s": time.perf_counter() - start}


def stage_timings(client, summary: dict) -> dict[str, float]:
    """Sums of the RL stage run's time/eval_s and time/checkpoint_s over its steps."""
    parent = client.get_run(summary["mlflow_run_id"])
    (rl_run,) = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}' and attributes.run_name = 'ppo'",
    )
    return {
        key: sum(m.value for m in client.get_metric_history(rl_run.info.run_id, f"time/{key}"))
        for key in ("eval_s", "checkpoint_s")
    }


def measure(root: Path) -> dict:
    import shutil

    from mlflow.tracking import MlflowClient

    from rlhf_core.config import load_config
    from rlhf_core.demo_world import build_demo_world
    from rlhf_core.ownership import claim_dir

    cfg = load_config(HERE.parent / "configs" / "demo.yaml", OVERRIDES)
    world = build_demo_world(root / "demo_world", cfg.run.seed, cfg.data.demo, cfg.model.demo)
    # both sides start with the world built: the flow's output directory is marked as a pipeline run's, as
    # an earlier run that built the world would have left it (an unmarked non-empty one is refused)
    claim_dir(root / "flow", "bench/bench_overhead.py")
    shutil.copytree(world.root, root / "flow" / "demo_world")
    bare_s = bare(cfg, root)
    flow_s, summary = flow(root)
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}", registry_uri=f"sqlite:///{root / 'mlflow.db'}")
    versions = sum(len(client.search_model_versions(f"name = '{n}'")) for n in ("demo-policy", "demo-reward-model"))
    evaluations = len(summary.get("eval_history", {}))
    parts = {**stage_timings(client, summary), **fixed_costs(root)}
    without_eval = (flow_s - parts["eval_s"]) / bare_s
    return {
        "metric": "wall seconds of the whole pipeline",
        "unit": "s",
        "ours": flow_s,
        "anchor": bare_s,
        "anchor_name": "the bare training loops",
        "ratio": flow_s / bare_s,
        "versions_registered": versions,
        "evaluations": evaluations,
        "ratio_without_evaluations": without_eval,
        **parts,
        "notes": (
            f"flow + tracking {flow_s:.0f} s vs bare SFT/reward/PPO loops {bare_s:.0f} s: +{flow_s - bare_s:.0f} s for "
            f"a new MLflow store ({parts['store_startup_s']:.1f} s), validation and preflight "
            f"({parts['validation_s']:.1f} s), {versions} registered versions (RL checkpoints saved and registered in "
            f"{parts['checkpoint_s']:.1f} s), {evaluations} generation evaluations (in-loop {parts['eval_s']:.1f} s; "
            f"without them {without_eval:.2f}x) and Prefect; sft 100, reward 100, ppo 20 steps of configs/demo.yaml, CPU"
        ),
    }


if __name__ == "__main__":
    pipeline_main(measure)
