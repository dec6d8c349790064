"""The `rlhf` command: validate a config, run the pipeline, print where everything went."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlhf_core.config import ConfigError, load_config
from rlhf_core.config.redaction import redact


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF pipeline on Prefect and MLflow.")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error too (as does RLHF_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("run", "run the pipeline flow"),
        ("validate", "check a config and print it resolved"),
        ("promote", "evaluate @candidate against @champion and promote it when it passes promote.*"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--config", "-c", default="configs/demo.yaml", help="YAML config file")
        cmd.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="FIELD=VALUE",
            type=credential_free_override,
            help="override a config field, e.g. --set ppo.kl_coef=0.1 (repeatable)",
        )
    sub.add_parser("fields", help="print every config field, its default and meaning as a Markdown table")
    ui = sub.add_parser("ui", help="start a Prefect server and the MLflow UI on 127.0.0.1, run the demo against them")
    ui.add_argument("--config", "-c", default="configs/demo.yaml", help="YAML config file of the run")
    ui.add_argument("--set", dest="overrides", action="append", default=[], type=credential_free_override)
    ui.add_argument("--mlflow-port", type=int, default=5000)
    ui.add_argument("--prefect-port", type=int, default=4200)
    ui.add_argument("--no-run", action="store_true", help="only start the two servers")
    deploy = sub.add_parser(
        "deploy", help="create the work pool (if missing) and every deployment in deployments/prefect.yaml"
    )
    deploy.add_argument("--pool", default="rlhf-process", help="process work pool the deployments use")
    return parser


REPO = Path(__file__).resolve().parents[1]


def credential_free_override(text: str) -> str:
    """The `--set` parser: a `tracking.uri` that carries credentials leaves them in MLflow's environment.

    The overrides become Prefect flow-run parameters, which Prefect stores and shows, so the secret
    must not be in them: `http://user:password@host` becomes `http://host` plus MLFLOW_TRACKING_USERNAME
    and MLFLOW_TRACKING_PASSWORD; any other credentialed URI (a token as the user name, a ?token=
    parameter) becomes MLFLOW_TRACKING_URI and the override `tracking.uri=null`, which falls back to it.
    """
    import os

    from rlhf_core.config import parse_override
    from rlhf_core.config.redaction import has_secret, split_credentials

    key, sep, raw = text.partition("=")
    if key.strip() != "tracking.uri" or not has_secret(raw):
        return text
    uri = str(parse_override(text)[1]).strip()
    clean, user, password = split_credentials(uri)
    if user is not None and not has_secret(clean):
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = user, password
        return f"tracking.uri={clean}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    return "tracking.uri=null"


def deploy(pool: str) -> int:
    """prefect work-pool create (when missing) + prefect deploy --all, run from the repository root."""
    import subprocess

    prefect = str(Path(sys.executable).with_name("prefect"))
    exists = subprocess.run([prefect, "work-pool", "inspect", pool], cwd=REPO, capture_output=True).returncode == 0
    if not exists:
        subprocess.run([prefect, "work-pool", "create", pool, "--type", "process"], cwd=REPO, check=True)
    done = subprocess.run(
        [prefect, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all"], cwd=REPO
    )
    if done.returncode == 0:
        print(f"start a worker: {prefect} worker start --pool {pool}")
    return done.returncode


def fields_markdown() -> str:
    from rlhf_core.config.reference import render_reference

    return render_reference()


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    uri = summary["tracking_uri"]
    table = Table(title="Where everything is", show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("where", overflow="fold")
    table.add_row("MLflow store", redact(uri))
    if uri.startswith("sqlite:///"):
        table.add_row("MLflow artifacts", str(Path(uri.removeprefix("sqlite:///")).parent / "mlruns"))
    table.add_row("Output directory", summary["output_dir"])
    if summary.get("demo_world"):
        table.add_row("Demo world", summary["demo_world"])
    table.add_row("Checkpoints", ", ".join(summary["checkpoints"]) or "(none)")
    table.add_row("Last RL checkpoint", summary["policy_path"])
    if summary.get("policy_model_uri"):
        table.add_row("Its model version", summary["policy_model_uri"])
    table.add_row("Exported policy", summary["export_dir"])
    if summary.get("candidate_uri"):
        table.add_row("Exported model version", f"{summary['candidate_uri']} = {summary['candidate_alias']}")
    if summary.get("reward_model_path"):
        table.add_row("Reward model (HF format)", summary["reward_model_path"])
    if summary.get("reward_model_uri"):
        table.add_row("Reward model version", summary["reward_model_uri"])
    for key, value in summary.get("metrics", {}).items():
        table.add_row(key, f"{value:.4f}")
    console = Console(width=max(140, Console().width))  # paths stay on one line in logs
    if summary.get("final_eval_rows"):
        from rlhf_core.data.chat import shown_prompt
        from tasks.reporting.progress import print_rows

        rows = [{**row, "prompt": shown_prompt(row["prompt"])} for row in summary["final_eval_rows"]]
        print_rows(rows, "Held-out completions of the exported policy (first 5)")
    console.print(table)
    print_alignment(console, summary)
    if uri.startswith("sqlite"):
        console.print(
            f"Open the MLflow UI: .venv/bin/mlflow ui --backend-store-uri {uri} --port 5000"
            " and browse http://127.0.0.1:5000"
        )
    else:
        console.print(f"MLflow UI: {redact(uri)}")


def print_alignment(console, summary: dict) -> None:
    """Before (the initial policy, step 0) and after (the exported checkpoint) side by side: the gold and
    proxy rewards, the KL, length and diversity, the guard's verdict, and three completions of the same
    prompts; then the one-line gold gain."""
    from rich.table import Table

    from rlhf_core.data.chat import shown_prompt
    from rlhf_core.evaluation.promotion import alignment_rows

    gold, history = summary.get("gold_metric"), {int(k): v for k, v in (summary.get("eval_history") or {}).items()}
    if 0 not in history or len(history) < 2:
        return
    after_step = summary.get("selected_step")
    after_step = after_step if after_step in history else max(history)
    before, after = history[0], history[after_step]
    table = Table(title=f"Alignment: the initial policy (step 0) and the exported one (step {after_step})")
    for column in ("", "before", "after", "after / before"):
        table.add_column(column)
    for row in alignment_rows(before, after, gold):
        table.add_row(*row)
    console.print(table)
    triggers = summary.get("guard_triggers") or []
    console.print(f"Guard: {len(triggers)} trigger(s)" + "".join(f"\n  {t}" for t in triggers[:10]))
    pairs = list(zip(summary.get("initial_eval_rows") or [], summary.get("final_eval_rows") or []))[:3]
    if pairs:
        samples = Table(title="Three held-out prompts, before and after")
        for column in ("prompt", "before", "after"):
            samples.add_column(column, overflow="fold")
        for first, last in pairs:
            samples.add_row(shown_prompt(first["prompt"]), first["completion"], last["completion"])
        console.print(samples)
    key = f"eval/{gold}_mean"
    if key in before and key in after:
        console.print(
            f"Gold metric {gold}: {before[key]:.3f} at step 0 -> {after[key]:.3f} at step {after_step} "
            f"({after[key] - before[key]:+.3f})"
        )


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions a user causes (a config, a file, a model source, a reward function, a guard set to stop
    that stopped RL before any checkpoint): one sentence, exit 2."""
    from rlhf_core.data.rows import DataValidationError
    from rlhf_core.evaluation.guard import GuardStopError
    from rlhf_core.models.loading import ModelSourceError
    from rlhf_core.rewards.functions import RewardFunctionError
    from rlhf_core.storage.ownership import OwnershipError
    from tasks.preflight import PreflightError

    return (
        ConfigError,
        ModelSourceError,
        DataValidationError,
        RewardFunctionError,
        PreflightError,
        OwnershipError,
        GuardStopError,
    )


OUR_PACKAGES = tuple(str(REPO / name) + "/" for name in ("rlhf_core", "tasks", "flows"))


def is_user_error(err: BaseException) -> bool:
    """One of `user_error_types`, or a plain ValueError that our own checks raised (rlhf_core, tasks, flows)."""
    if isinstance(err, user_error_types()):
        return True
    if type(err) is not ValueError or err.__traceback__ is None:
        return False
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(OUR_PACKAGES)


def debug_wanted(args: argparse.Namespace | None = None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("RLHF_DEBUG", "").strip().lower() not in (
        "",
        "0",
        "false",
        "no",
    )


def one_sentence(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text


def _run_command(args: argparse.Namespace) -> int:
    if args.command == "fields":
        print(fields_markdown())
        return 0
    if args.command == "deploy":
        return deploy(args.pool)
    cfg = load_config(args.config, args.overrides)
    if args.command == "ui":  # the config is checked here, the run checks the rest against the servers
        from flows.ui import serve

        config = None if args.no_run else args.config
        # the servers' logs beside ./mlflow.db, never in run.output_dir (the run wants it empty or its own)
        return serve(config, args.overrides, args.mlflow_port, args.prefect_port, Path.cwd() / ".rlhf-ui")
    if args.command in ("validate", "run"):
        from tasks.preflight import check_preflight

        check_preflight(cfg)  # files, functions, models, context, tracking server, registry names: before any work
        from rlhf_core.storage.ownership import check_pipeline_outputs

        check_pipeline_outputs(cfg, config_path=args.config, claim=False)  # owned writes only; writes nothing here
    if args.command == "validate":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return 0

    if args.command == "promote":
        cfg.promotion_gates()  # outside the demo an explicit gate is needed: one sentence before any flow run
        from flows.promote import rlhf_promote

        result = rlhf_promote(config_path=args.config, overrides=args.overrides)
        print(
            f"{result['model']} version {result['candidate']} vs champion {result['champion']}: "
            f"{result['decision']}{'' if result['changed'] else ' (nothing changed)'}; {result['reason']}"
        )
        return 0

    from flows.rlhf_pipeline import rlhf_pipeline

    summary = rlhf_pipeline(config_path=args.config, overrides=args.overrides)
    print_summary(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run a command; a user error (see `is_user_error`) prints one sentence on stderr and exits 2.

    `--debug` or RLHF_DEBUG=1 prints its traceback as well; any other exception is a bug and
    propagates with its traceback.
    """
    args = _parser().parse_args(argv)
    try:
        return _run_command(args)
    except Exception as err:
        if not is_user_error(err):
            raise
        if debug_wanted(args):
            import traceback

            traceback.print_exception(err, file=sys.stderr)
        print(f"error: {one_sentence(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
