"""Pipeline overhead: the Prefect flow with MLflow tracking against the bare training loops, same config.

Both sides start from the same demo world and run the same SFT, reward-model and PPO steps of
configs/demo.yaml (the guard's actions set to warn, so that a rollback cannot make the flow train
steps the bare loops do not). The bare side calls the rlhf_core training functions directly (no
Prefect, no MLflow, no evaluation, no registration); the flow side runs `rlhf_pipeline` (on a Prefect
server started beforehand, its start-up timed apart) into a fresh output directory and a new SQLite
store. Reported: the flow's wall time over the bare loops' (the anchor), the same ratio without the
generation evaluations the config asks for (their time in its own column), and where the difference
goes: each Prefect task's wall time beside the bare stage it wraps (from Prefect's task runs), the
registrations (their total time on the background thread, and how long stages waited for them), and,
measured apart, config validation with preflight, a new MLflow store's start-up (the first on a machine
runs MLflow's migrations and keeps the empty schema; every later one is a copy of it, as the flow's
is here) and the Prefect server's. Bare loops and flows run three times each, interleaved (bare, flow,
flow, bare, bare, flow), and the fastest of each side counts; the PPO steps' phases of the two are set side
by side, and the Prefect server's CPU seconds during each are read from its process.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.helpers.anchors import STEP_PHASES, phase_means, pipeline_main

REPO = Path(__file__).resolve().parents[2]

# the demo config as `make demo` runs it; a guard rollback would repeat steps the bare loops do not
OVERRIDES = [
    f"guard.{rule}.action=warn" for rule in ("kl_budget", "min_distinct_ratio", "max_length_change", "divergence")
]


def bare(cfg, root: Path, out: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of each training loop alone ("sft", "reward", "rl"), as a user would call them, writing under
    `out`, and the PPO loop's mean `time/<phase>_s` (what it logs, kept in a list)."""
    from rlhf_core.demo.world import build_demo_world, world_rows
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rewards.reward_model import PreferencePairs, load_reward_model, train_reward_model
    from rlhf_core.rl.inputs import rl_inputs
    from rlhf_core.rl.ppo import train_ppo
    from rlhf_core.training.loop import Hooks
    from rlhf_core.training.sft import train_sft

    world = build_demo_world(root / "demo_world", cfg.run.seed, cfg.data.demo, cfg.model.demo)  # cached: built before
    seconds, start = {}, time.perf_counter()
    tok = load_tokenizer(str(world.tokenizer))
    model = load_causal_lm(str(world.base_model))
    train_sft(
        model,
        tok,
        [r["text"] for r in world_rows(world, "text")],
        cfg.sft,
        cfg.run,
        max_length=cfg.data.max_length,
        output_dir=out / "bare-sft",
        hooks=Hooks(show_progress=False),
    )
    seconds["sft"], start = time.perf_counter() - start, time.perf_counter()
    reward = load_reward_model(str(out / "bare-sft"), tok, seed=cfg.run.seed)
    card = {"title": "reward", "metadata": {}, "body": ""}
    result = train_reward_model(
        reward,
        tok,
        PreferencePairs(
            world_rows(world, "preference", "train"), world_rows(world, "preference", "test"), cfg.data.max_length
        ),
        cfg.reward,
        cfg.run,
        output_dir=out / "bare-reward",
        card=card,
        hooks=Hooks(show_progress=False),
    )
    seconds["reward"], start = time.perf_counter() - start, time.perf_counter()
    policy, ref, logged = load_causal_lm(str(out / "bare-sft")), load_causal_lm(str(out / "bare-sft")), []
    value = load_reward_model(str(result.checkpoint), tok, seed=cfg.run.seed)
    reward_model = load_reward_model(str(result.checkpoint), tok, seed=cfg.run.seed).eval()
    train_ppo(
        rl_inputs(
            policy,
            tok,
            [r["prompt"] for r in world_rows(world, "prompt", "train")],
            out / "bare-ppo",
            value=value,
            reference=ref,
            reward_model=reward_model,
            rl=cfg.rl,
            ppo=cfg.ppo,
            run=cfg.run,
            max_prompt_length=cfg.data.max_prompt_length,
            on_log=lambda metrics, step: logged.append(metrics),
            show_progress=False,
        )
    )
    seconds["rl"] = time.perf_counter() - start
    return seconds, phase_means(logged)


class Stopwatch:
    """Seconds spent in the functions it wraps, summed per name, on whichever thread they run."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.wrapped = False

    def wrap(self, owner, attribute: str, name: str) -> None:
        import functools
        import threading

        real, lock = getattr(owner, attribute), threading.Lock()

        @functools.wraps(real)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                with lock:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        setattr(owner, attribute, timed)
        self.wrapped = True


WATCH = Stopwatch()


def children_cpu_s() -> float:
    """CPU seconds used so far by this process's children: the Prefect server the harness started, which
    shares the machine's cores with training."""
    import psutil

    return sum(sum(child.cpu_times()[:2]) for child in psutil.Process().children(recursive=True))


def flow(root: Path, out: Path, store: str) -> tuple[float, dict, dict[str, float]]:
    """The pipeline's wall time into `out` and `store`, its summary, and the seconds of its evaluations and
    registrations."""
    import tasks.registry
    import tasks.stages.rl.stage
    from flows.rlhf_pipeline import rlhf_pipeline
    from tasks.reporting.reporter import StageReporter

    if not WATCH.wrapped:
        WATCH.wrap(
            tasks.stages.rl.stage, "evaluate_policy", "eval_s"
        )  # every evaluation: step 0, in the loop, the last
        WATCH.wrap(tasks.registry, "register_once", "registration_s")  # background thread and stage ends alike
        WATCH.wrap(StageReporter, "wait_registrations", "registration_wait_s")
    WATCH.seconds = {}
    overrides = OVERRIDES + [f"run.output_dir={out}", f"tracking.uri={store}"]
    start = time.perf_counter()
    summary = rlhf_pipeline(config_path=str(REPO / "configs" / "demo.yaml"), overrides=overrides)
    return time.perf_counter() - start, summary, dict(WATCH.seconds)


def task_seconds(mlflow_client, summary: dict) -> dict[str, float]:
    """Wall seconds of each Prefect task run of the flow run behind `summary` (from the Prefect API)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_run_id = mlflow_client.get_run(summary["mlflow_run_id"]).data.tags["prefect.flow_run_id"]
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: (r.end_time - r.start_time).total_seconds() for r in runs if r.end_time}


def fixed_costs(root: Path) -> dict[str, float]:
    """Seconds of config validation + preflight, and of a new SQLite MLflow store with its experiment: the
    first on this machine and MLflow version (MLflow's migrations, which also make the empty-store template
    in a cache of this benchmark's own), then a second (a copy of the template)."""
    import os

    from rlhf_core.config import load_config
    from tasks import tracking
    from tasks.checks.preflight import preflight_problems

    start = time.perf_counter()
    cfg = load_config(REPO / "configs" / "demo.yaml", OVERRIDES)
    preflight_problems(cfg)
    seconds = {"validation_s": time.perf_counter() - start}
    os.environ[tracking.store.CACHE_ENV] = str(root / "cache")
    for name in ("store_first_s", "store_startup_s"):
        uri = f"sqlite:///{root / name / 'mlflow.db'}"
        start = time.perf_counter()
        tracking.store.configure(uri)
        tracking.store.ensure_experiment("startup", uri)
        seconds[name] = time.perf_counter() - start
    return seconds


# bare loops and flows alternate, so that drifting load hits both alike; the fastest run of each side counts
# (these machines are shared: one side's run has moved by 5% between repeats)
ORDER = ("bare", "flow", "flow", "bare", "bare", "flow")
LOOP_PHASES = ("log", "eval", "checkpoint")  # the loop's own time around the steps, summed between logs


def phase_seconds(client, summary: dict) -> tuple[dict[str, float], dict[str, float]]:
    """The PPO stage's mean `time/<phase>_s` and `perf/step_seconds` over its logged steps, and the loop's
    total `time/log_s`, `time/eval_s` and `time/checkpoint_s` over the stage (from MLflow)."""
    parent = client.get_run(summary["mlflow_run_id"])
    (rl_run,) = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}' and attributes.run_name = 'ppo'",
    )
    history = lambda key: client.get_metric_history(rl_run.info.run_id, key)  # noqa: E731
    keys = [f"time/{p}_s" for p in STEP_PHASES] + ["perf/step_seconds"]
    means = {k: sum(m.value for m in h) / len(h) for k in keys if (h := history(k))}
    totals = {p: sum(m.value for m in history(f"time/{p}_s")) for p in LOOP_PHASES}
    return means, totals


def step_table(bare: dict[str, float], flow: dict[str, float]) -> str:
    """Markdown: one PPO step's phases in the bare loop and in the flow, mean seconds per step."""
    rows = ["| PPO step phase | bare loop s/step | flow s/step | flow / bare |", "|---|---|---|---|"]
    for key in [f"time/{p}_s" for p in STEP_PHASES] + ["perf/step_seconds"]:
        if key in bare and key in flow:
            name = f"`{key}`" + (" (whole step)" if key == "perf/step_seconds" else "")
            rows.append(f"| {name} | {bare[key]:.4f} | {flow[key]:.4f} | {flow[key] / bare[key]:.3f} |")
    return "\n".join(rows)


STAGES = (("sft", "sft"), ("reward", "reward"), ("ppo", "rl"))  # (Prefect task name, bare loop): the bench runs PPO


def breakdown_table(bare_s: dict[str, float], tasks_s: dict[str, float], flow_s: float, parts: dict) -> str:
    """Markdown: each stage's bare loop against its Prefect task (the evaluations in a column of their own),
    then what only the flow does, then the fixed costs measured apart."""
    eval_s = parts["eval_s"]
    rows = [
        "| part | bare loops (s) | flow (s) | of which evaluations (s) | flow - bare - evaluations (s) |",
        "|---|---|---|---|---|",
    ]
    for task_name, stage in STAGES:
        got, evals = tasks_s.get(task_name, float("nan")), eval_s if stage == "rl" else 0.0
        rows.append(
            f"| {task_name} | {bare_s[stage]:.2f} | {got:.2f} | {evals:.2f} | {got - evals - bare_s[stage]:+.2f} |"
        )
    for task_name, seconds in sorted(tasks_s.items()):
        if task_name not in dict(STAGES):
            rows.append(f"| {task_name} (flow only) | | {seconds:.2f} | | {seconds:+.2f} |")
    outside = flow_s - sum(tasks_s.values())
    rows.append(
        f"| the flow outside its tasks (run lock, MLflow parent run, summary, Prefect) | | {outside:.2f} | | {outside:+.2f} |"
    )
    bare_total = sum(bare_s.values())
    rows.append(f"| **total** | {bare_total:.2f} | {flow_s:.2f} | {eval_s:.2f} | {flow_s - eval_s - bare_total:+.2f} |")
    rows += [
        "",
        f"Checkpoint registrations: {parts['registration_s']:.2f} s on the background thread, of which stages "
        f"waited {parts.get('registration_wait_s', 0.0):.2f} s at their ends. Measured apart: a new SQLite MLflow "
        f"store {parts['store_startup_s']:.2f} s (a copy of the empty schema; the first on a machine and MLflow "
        f"version runs MLflow's migrations: {parts['store_first_s']:.2f} s), config validation and preflight "
        f"{parts['validation_s']:.3f} s, the Prefect server's start-up {parts['server_startup_s']:.1f} s "
        "(before the flow, as a deployment's server or `prefect server start` is). The Prefect server process, on "
        f"the same 2 cores, used {parts['server_cpu_s']['flow']:.1f} CPU-seconds per flow run and "
        f"{parts['server_cpu_s']['bare']:.1f} per bare run (its own idle loops).",
    ]
    return "\n".join(rows)


def measure(root: Path, server_startup_s: float) -> dict:
    import shutil

    from mlflow.tracking import MlflowClient

    from rlhf_core.config import load_config
    from rlhf_core.demo.world import build_demo_world
    from rlhf_core.storage.ownership import claim_dir

    cfg = load_config(REPO / "configs" / "demo.yaml", OVERRIDES)
    world = build_demo_world(root / "demo_world", cfg.run.seed, cfg.data.demo, cfg.model.demo)
    # first: the flows' new stores are then copies of the empty schema, as on every run but a machine's first
    fixed = fixed_costs(root)
    bares, flows, server_cpu = [], [], {"bare": 0.0, "flow": 0.0}
    for i, side in enumerate(ORDER):
        before = children_cpu_s()
        if side == "bare":
            bares.append(bare(cfg, root, root / f"bare-{i}"))
            server_cpu["bare"] += children_cpu_s() - before
            continue
        # each flow starts with the world built: its output directory is marked as a pipeline run's, as an
        # earlier run that built the world would have left it (an unmarked non-empty one is refused)
        out, store = root / f"flow-{i}", f"sqlite:///{root / f'mlflow-{i}.db'}"
        claim_dir(out, "bench/timing/flow_vs_bare_loops.py")
        shutil.copytree(world.root, out / "demo_world")
        flows.append((*flow(root, out, store), store))
        server_cpu["flow"] += children_cpu_s() - before
    bare_parts, bare_phases = min(bares, key=lambda b: sum(b[0].values()))
    bare_s = sum(bare_parts.values())
    flow_s, summary, watched, store = min(flows, key=lambda f: f[0])
    client = MlflowClient(store, registry_uri=store)
    versions = sum(len(client.search_model_versions(f"name = '{n}'")) for n in ("demo-policy", "demo-reward-model"))
    evaluations = len(summary.get("eval_history", {}))
    parts = {"eval_s": 0.0, "registration_s": 0.0, **watched, **fixed, "server_startup_s": server_startup_s}
    parts["server_cpu_s"] = {side: seconds / ORDER.count(side) for side, seconds in server_cpu.items()}
    tasks_s = task_seconds(client, summary)
    phases, loop_totals = phase_seconds(client, summary)
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
        "all_bare_s": [sum(b[0].values()) for b in bares],
        "all_flow_s": [f[0] for f in flows],
        "bare_s": bare_parts,
        "task_s": tasks_s,
        **parts,
        "phase_s": phases,
        "bare_phase_s": bare_phases,
        "loop_s": loop_totals,
        "table_md": breakdown_table(bare_parts, tasks_s, flow_s, parts)
        + "\n\n"
        + step_table(bare_phases, phases)
        + "\n\nThe PPO loop's own time around its steps, over the stage: "
        + ", ".join(f"`time/{p}_s` {s:.2f} s" for p, s in loop_totals.items())
        + " (logging the metrics, inline for this local store; the evaluations; writing checkpoints, whose "
        "registration is on the background thread). Prefect's flow engine joins its heartbeat thread at the flow's "
        "end, which sleeps in 1 s steps: up to 1 s of the flow outside its tasks.",
        "notes": (
            f"flow + tracking {flow_s:.1f} s vs bare SFT/reward/PPO loops {bare_s:.1f} s; without the {evaluations} "
            f"generation evaluations ({parts['eval_s']:.1f} s): **{without_eval:.3f}x** (target <= 1.10); "
            f"{versions} versions registered ({parts['registration_s']:.1f} s in the background, stages waited "
            f"{parts.get('registration_wait_s', 0.0):.1f} s); new MLflow store {parts['store_startup_s']:.2f} s "
            f"({parts['store_first_s']:.1f} s the first on a machine), validation and preflight "
            f"{parts['validation_s']:.2f} s; per-task split below; configs/demo.yaml (sft {cfg.sft.max_steps}, reward "
            f"{cfg.reward.max_steps}, ppo {cfg.rl.total_steps} steps, guard actions warn); bare, flow, flow, bare, bare, "
            f"flow, the fastest of each (bare {', '.join(f'{sum(b[0].values()):.1f}' for b in bares)} s, flow "
            f"{', '.join(f'{f[0]:.1f}' for f in flows)} s), CPU"
        ),
    }


if __name__ == "__main__":
    pipeline_main(measure)
