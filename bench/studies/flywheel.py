"""`make flywheel`: the closed loop on the demo world, three turns, offline, with every server it needs.

It starts an MLflow tracking server, a Prefect server and a process worker on loopback ports (their stores under
the run's directory), deploys `rlhf-feedback-watch/every-5-minutes` and `rlhf-retrain/on-feedback` from
deployments/prefect.yaml, trains a first champion (configs/flywheel.yaml: the demo's pipeline, short, promoted
against its start), then turns the loop three times:

1. the champion is served (`mlflow models serve`, traced into the experiment `traffic`);
2. simulated users send prompts of the demo's kind (its training prompts; the gate's held-out ones never), get two
   sampled completions each and log which they liked through MLflow's feedback API. Their taste is the demo's
   gold metric (VADER's compound score) plus Gaussian noise (`--noise`), so a preference follows the gold metric
   only on average;
3. the watch deployment counts the new pairs and emits `rlhf.feedback.ready`; its trigger starts the retraining:
   a reward model on all the feedback so far, RL from the champion, then promotion, judged by VADER, the metric
   the users' taste is drawn from and which the reward model learns only through their noisy choices;
4. the next turn serves whatever the gate left as champion.

One line per turn: the pairs so far, the reward model's accuracy on held-out feedback (the users' choices on a fixed
fifth of the prompts, which it does not train on: `split: test` of the traces: source), the served
champion's gold score on the users' prompts, and the promotion's decision with its interval. Everything stops at
the end, on Ctrl-C and on SIGTERM (flows/ui.py's Stopper).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flows.ui import BIN, Stopper
from rlhf_core.config.errors import UserError
from rlhf_core.rewards.functions import vader_compound
from tasks.runtime.server_processes import wait_healthy

CONFIG = "configs/flywheel.yaml"
EXPERIMENT = "traffic"
POLICY = "flywheel-policy"
DEPLOYMENTS = ("rlhf-feedback-watch/every-5-minutes", "rlhf-retrain/on-feedback")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, body: dict | None = None, timeout_s: float = 120) -> object:
    """GET (or POST `body` as JSON) and the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


class Loop:
    """The servers, the worker and the served champion of one `make flywheel`, and what each turn measured."""

    def __init__(self, root: Path, seed: int, stopper: Stopper):
        self.root, self.seed, self.stopper = root, seed, stopper
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.mlflow = f"http://127.0.0.1:{free_port()}"
        prefect_port = free_port()
        self.prefect_api = f"http://127.0.0.1:{prefect_port}/api"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
        self.env = {
            **base,
            **OFFLINE,
            "PREFECT_HOME": str(root / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_URL": self.prefect_api,
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "MLFLOW_TRACKING_URI": self.mlflow,
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "PATH": f"{BIN}{os.pathsep}{base.get('PATH', '')}",
        }
        self.prefect_port = prefect_port
        self.served: subprocess.Popen | None = None

    def overrides(self) -> list[str]:
        """What every run of the loop sets over configs/flywheel.yaml."""
        return [f"run.output_dir={self.root / 'run'}", f"run.seed={self.seed}", f"tracking.uri={self.mlflow}"]

    def start(self, name: str, command: list[str], env: dict | None = None) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("w") as out:
            return self.stopper.start(command, env or self.env, out)

    def servers(self) -> None:
        """MLflow and Prefect on loopback ports, then the two deployments and a worker."""
        port = self.mlflow.rsplit(":", 1)[1]
        mlflow = self.start(
            "mlflow",
            [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
            + ["--artifacts-destination", str(self.root / "mlflow-artifacts"), "--host", "127.0.0.1"]
            + ["--port", port, "--workers", "1"],
        )
        prefect = self.start(
            "prefect",
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.prefect_port)],
            {**self.env, "PREFECT_UI_API_URL": self.prefect_api, "PREFECT_SERVER_API_PORT": str(self.prefect_port)},
        )
        wait_healthy(mlflow, f"{self.mlflow}/health", "MLflow server", self.logs / "mlflow.log", timeout_s=180)
        wait_healthy(prefect, f"{self.prefect_api}/health", "Prefect server", self.logs / "prefect.log", timeout_s=180)
        self.run([str(BIN / "prefect"), "work-pool", "create", "rlhf-process", "--type", "process"], "work pool")
        deploy = [str(BIN / "prefect"), "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml"]
        for name in DEPLOYMENTS:
            deploy += ["--name", name]
        self.run(deploy, "deploy")
        self.start("worker", [str(BIN / "prefect"), "worker", "start", "--pool", "rlhf-process"])

    def run(self, command: list[str], what: str) -> str:
        """Run a command to its end (its output into the logs); a failure names the log."""
        log = self.logs / f"{what.replace(' ', '-')}.log"
        with log.open("a") as out:
            done = subprocess.run(command, env=self.env, stdout=out, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {done.returncode}); its output is in {log}")
        return log.read_text()

    def first_champion(self) -> None:
        """The demo's pipeline, short, on its own preference pairs; promoted against its start."""
        first = [*self.overrides(), "data.preference.path=demo", "data.preference_eval.path=demo"]
        sets = [arg for o in first for arg in ("--set", o)]
        self.run([str(BIN / "rlhf"), "run", "--config", CONFIG, *sets], "first champion")
        self.run([str(BIN / "rlhf"), "promote", "--config", CONFIG, *sets], "first promotion")

    def serve(self) -> str:
        """The champion behind `mlflow models serve`, tracing into EXPERIMENT; its base URL."""
        if self.served is not None:
            from tasks.runtime.server_processes import stop_group

            stop_group(self.served, 20)
        port = free_port()
        env = {**self.env, "MLFLOW_EXPERIMENT_NAME": EXPERIMENT}
        self.served = self.start(
            "served-champion",
            [str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{POLICY}@champion", "--env-manager", "local"]
            + ["--host", "127.0.0.1", "--port", str(port)],
            env,
        )
        base = f"http://127.0.0.1:{port}"
        wait_healthy(self.served, f"{base}/ping", "mlflow models serve", self.logs / "served-champion.log", 180)
        return base

    # ----------------------------- a turn of the loop -----------------------------

    def users(self, base: str, prompts: list[str], rng: random.Random, noise: float) -> dict:
        """Each prompt asked once for two sampled completions; the user logs the one whose gold score plus noise
        is higher (nothing when the two are the same text). -> pairs logged, the champion's mean gold."""
        import mlflow
        from mlflow.entities import AssessmentSource

        body = {"inputs": prompts, "params": {"n": 2, "do_sample": True, "temperature": 1.0}}
        records = call(f"{base}/invocations", body, timeout_s=600)["predictions"]
        by_trace: dict[str, list[dict]] = {}
        for record in records:
            by_trace.setdefault(record["trace_id"], []).append(record)
        golds = vader_compound(completions=[r["completion"] for r in records])
        gold_of = {id(r): g for r, g in zip(records, golds)}
        mlflow.set_tracking_uri(self.mlflow)
        logged = 0
        for user, (trace_id, (a, b)) in enumerate(sorted(by_trace.items())):
            if a["completion"] == b["completion"]:
                continue
            taste = [gold_of[id(r)] + rng.gauss(0.0, noise) for r in (a, b)]
            source = AssessmentSource(source_type="HUMAN", source_id=f"simulated-user-{user % 16}")
            logged += self.feedback(trace_id, int(taste[1] > taste[0]), source)
        return {"pairs": logged, "gold": sum(golds) / len(golds)}

    def feedback(self, trace_id: str, choice: int, source) -> int:
        """`mlflow.log_feedback`, once the served champion's trace has reached the server (its export is async)."""
        import mlflow

        for _ in range(50):
            try:
                mlflow.log_feedback(trace_id=trace_id, name="preference", value=choice, source=source)
                return 1
            except Exception as err:  # noqa: BLE001 - the trace not stored yet: wait, then count it lost
                if "not found" not in str(err).lower():
                    raise
                time.sleep(0.2)
        return 0

    def watch_and_retrain(self, turn: int) -> dict:
        """Run the watch deployment (it emits the event at the threshold) and wait for the retraining its trigger
        starts; -> the retraining's final state and its promotion's decision."""
        before = {r["id"] for r in self.flow_runs("rlhf-retrain", "on-feedback")}
        params = ["--param", f"config_path={CONFIG}", "--param", f"overrides={json.dumps(self.overrides())}"]
        self.run(
            [str(BIN / "prefect"), "deployment", "run", DEPLOYMENTS[0], *params, "--watch", "--watch-timeout", "600"],
            f"watch {turn}",
        )
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            runs = [r for r in self.flow_runs("rlhf-retrain", "on-feedback") if r["id"] not in before]
            done = [r for r in runs if r["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")]
            if done:
                return {"state": done[0]["state"]["name"], "id": done[0]["id"]}
            time.sleep(3)
        raise RuntimeError(f"turn {turn}: no retraining ended within 15 minutes of the watch (logs in {self.logs})")

    def flow_runs(self, flow: str, deployment: str) -> list[dict]:
        found = call(f"{self.prefect_api}/deployments/name/{flow}/{deployment}")
        return call(f"{self.prefect_api}/flow_runs/filter", {"deployments": {"id": {"any_": [found["id"]]}}})

    def promotion(self) -> dict:
        """The newest policy version's promotion tags and the reward model's latest eval accuracy."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.mlflow, registry_uri=self.mlflow)
        versions = client.search_model_versions(f"name = '{POLICY}'")
        newest = max(versions, key=lambda v: int(v.version))
        rewards = client.search_model_versions("name = 'flywheel-reward-model'")
        reward = max(rewards, key=lambda v: int(v.version)) if rewards else None
        accuracy = reward.tags.get("eval_accuracy") if reward is not None else None
        tags = newest.tags
        interval = [tags.get(f"promotion.{k}") for k in ("ci_low", "ci_high")]
        return {
            "version": newest.version,
            "decision": tags.get("promotion.decision", "none"),
            "win_rate": tags.get("promotion.win_rate", ""),
            "interval": f"[{interval[0]}, {interval[1]}]" if all(interval) else "",
            "champion": client.get_model_version_by_alias(POLICY, "champion").version,
            "reward_accuracy": float(accuracy) if accuracy else None,
        }


def prompts_of(root: Path, count: int, rng: random.Random) -> list[str]:
    """`count` of the demo world's RL training prompts (rendered by its chat template, as a client sends them)."""
    rows = [json.loads(line)["prompt"] for line in (root / "run" / "data" / "prompts.jsonl").open()]
    return rng.sample(rows, min(count, len(rows)))


def turn_line(turn: int, pairs: int, measured: dict, promoted: dict) -> str:
    accuracy = promoted["reward_accuracy"]
    return (
        f"turn {turn}: {pairs} feedback pairs so far | reward model's accuracy on held-out feedback "
        f"{'-' if accuracy is None else f'{accuracy:.3f}'} | served champion's gold {measured['gold']:+.3f} | "
        f"candidate v{promoted['version']}: {promoted['decision']} (win rate {promoted['win_rate'] or '-'} "
        f"{promoted['interval']}) | champion v{promoted['champion']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make flywheel", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=int(os.environ.get("FLYWHEEL_SEED", "1")))
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=160, help="users' prompts per turn")
    parser.add_argument("--noise", type=float, default=0.3, help="the users' taste: gold + N(0, noise)")
    args = parser.parse_args(argv)
    root = Path("outputs") / f"flywheel-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    rng = random.Random(args.seed)
    stopper = Stopper()
    started = time.monotonic()
    try:
        stopper.install()
        loop = Loop(root.resolve(), args.seed, stopper)
        loop.servers()
        print(f"MLflow {loop.mlflow}, Prefect {loop.prefect_api[:-4]}: logs in {loop.logs}", flush=True)
        loop.first_champion()
        promoted, pairs = loop.promotion(), 0
        print(f"turn 0: first champion v{promoted['champion']} ({time.monotonic() - started:.0f} s)", flush=True)
        for turn in range(1, args.turns + 1):
            measured = loop.users(loop.serve(), prompts_of(root, args.prompts, rng), rng, args.noise)
            pairs += measured["pairs"]
            retrained = loop.watch_and_retrain(turn)
            if retrained["state"] != "Completed":
                raise RuntimeError(f"turn {turn}: the retraining ended {retrained['state']} (logs in {loop.logs})")
            print(
                turn_line(turn, pairs, measured, loop.promotion()), f"({time.monotonic() - started:.0f} s)", flush=True
            )
        final = loop.users(loop.serve(), prompts_of(root, args.prompts, rng), rng, args.noise)
        print(f"after {args.turns} turns: the served champion's gold {final['gold']:+.3f}", flush=True)
        return 0
    except KeyboardInterrupt:
        return 130
    except (UserError, RuntimeError) as err:
        print(f"make flywheel: {err}", file=sys.stderr)
        return 1
    finally:
        stopper.stop_all()


if __name__ == "__main__":
    sys.exit(main())
