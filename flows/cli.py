"""The `rlhf` command: validate a config, run the pipeline, print where everything went.

A `UserError` (a config, a file, data, a model source the user supplied) prints one sentence on stderr and
exits 2, a stage that did not finish on its processes (a worker lost after its restarts) one sentence and
exits 1; any other exception is a bug in this code: its traceback, a one-line hint, exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from flows.console import fields_markdown, memory_table, print_summary, promotion_line, quiet_known_failures
from rlhf_core.config import load_config
from rlhf_core.config.errors import UserError

REPO = Path(__file__).resolve().parents[1]


class Override(NamedTuple):
    """One `--set FIELD=VALUE` as parsed: the override text, which flow runs may show, and the MLflow
    environment variables that take the credentials it carried (set when the command runs)."""

    text: str
    environment: dict[str, str]


def credential_free_override(text: str) -> Override:
    """The `--set` parser: a `tracking.uri` that carries credentials leaves them to MLflow's environment.

    The overrides become Prefect flow-run parameters, which Prefect stores and shows, so the secret
    must not be in them: `http://user:password@host` becomes `http://host` plus MLFLOW_TRACKING_USERNAME
    and MLFLOW_TRACKING_PASSWORD; any other credentialed URI (a token as the user name, a ?token=
    parameter) becomes MLFLOW_TRACKING_URI and the override `tracking.uri=null`, which falls back to it.
    Pure: the variables are only returned here, `export_credentials` sets them.
    """
    from rlhf_core.config import parse_override
    from rlhf_core.config.redaction import has_secret, split_credentials

    key, sep, raw = text.partition("=")
    if key.strip() != "tracking.uri" or not has_secret(raw):
        return Override(text, {})
    uri = str(parse_override(text)[1]).strip()
    clean, user, password = split_credentials(uri)
    if user is not None and not has_secret(clean):
        return Override(
            f"tracking.uri={clean}", {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
        )
    return Override("tracking.uri=null", {"MLFLOW_TRACKING_URI": uri})


def export_credentials(overrides: list[Override]) -> list[str]:
    """Set the MLflow variables the overrides carried, in command-line order; the override texts."""
    for override in overrides:
        os.environ.update(override.environment)
    return [override.text for override in overrides]


def build_parser() -> argparse.ArgumentParser:
    """The `rlhf` command line; parsing it is pure (the credentials a `--set` carried are set by `main`)."""
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


# the commands: each takes the parsed arguments and the `--set` overrides, and returns the exit code ----------


def checked_config(config_path: str, overrides: list[str]):
    """The config, validated, then checked as far as it can be without training: files, functions, models,
    context, tracking server, registry names, that run.output_dir is ours to write (nothing written), and every
    row of the local tables as the data stage checks them, with the prompt count against one RL step, and the
    estimated peak memory per device against run.memory_budget_gib. -> (the config, the token-length table of
    `rlhf validate`, the memory estimate). Light: no Prefect, MLflow or training code is
    imported, so `rlhf run` refuses a mistake in seconds, before any server starts."""
    from rlhf_core.storage.ownership import check_pipeline_outputs
    from tasks.checks.lengths import check_tables
    from tasks.checks.memory import check_memory
    from tasks.checks.preflight import check_preflight

    cfg = load_config(config_path, overrides)
    check_preflight(cfg)
    check_pipeline_outputs(cfg, config_path=config_path, claim=False)
    lengths = check_tables(cfg)
    return cfg, lengths, check_memory(cfg)


def fields_command(args: argparse.Namespace, overrides: list[str]) -> int:
    print(fields_markdown())
    return 0


def deploy_command(args: argparse.Namespace, overrides: list[str]) -> int:
    return deploy(args.pool)


def ui_command(args: argparse.Namespace, overrides: list[str]) -> int:
    load_config(args.config, overrides)  # the config is checked here, the run checks the rest against the servers
    from flows.ui import serve

    config = None if args.no_run else args.config
    # the servers' logs beside ./mlflow.db, never in run.output_dir (the run wants it empty or its own)
    return serve(config, overrides, args.mlflow_port, args.prefect_port, Path.cwd() / ".rlhf-ui")


def validate_command(args: argparse.Namespace, overrides: list[str]) -> int:
    import yaml

    cfg, lengths, memory = checked_config(args.config, overrides)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    print(lengths)
    print(memory_table(memory, cfg.run.memory_budget_gib))
    return 0


def promote_command(args: argparse.Namespace, overrides: list[str]) -> int:
    from flows.promote import check_promotion, rlhf_promote

    check_promotion(load_config(args.config, overrides))  # one sentence before any flow run
    print(promotion_line(rlhf_promote(config_path=args.config, overrides=overrides)))
    return 0


def run_command(args: argparse.Namespace, overrides: list[str]) -> int:
    checked_config(args.config, overrides)  # before any work, and before the pipeline's imports
    from flows.rlhf_pipeline import rlhf_pipeline

    if not debug_wanted(args):
        quiet_known_failures(known_failures())
    try:
        summary = rlhf_pipeline(config_path=args.config, overrides=overrides)
    finally:
        stop_temporary_prefect_server()
    print_summary(summary)
    return 0


def stop_temporary_prefect_server() -> None:
    """Stop the server Prefect started for this run (no PREFECT_API_URL) now rather than at exit, so that the
    run's last words (the summary, or the failure's sentence) are the console's last lines."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:  # a server of the user's (or a test harness's): not ours to stop
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):  # what the run still sends to the server, before it stops
        worker.drain_all(timeout=5)
    for server in list(getattr(SubprocessASGIServer, "_instances", {}).values()):  # private in Prefect 3.9
        server.stop()


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "fields": fields_command,
    "deploy": deploy_command,
    "ui": ui_command,
    "validate": validate_command,
    "promote": promote_command,
    "run": run_command,
}


# errors ------------------------------------------------------------------------------------------------------


def known_failures() -> tuple[type[BaseException], ...]:
    """The failures that are not bugs: a user error (exit 2), a stage that did not finish on its processes
    (a worker lost after its restarts: exit 1); both are one sentence, without a traceback."""
    from tasks.launch.launcher import StageFailedError

    return UserError, StageFailedError


def is_user_error(err: BaseException) -> bool:
    """A `UserError`: something the user can change (one sentence, exit 2); anything else is a bug."""
    return isinstance(err, UserError)


def debug_wanted(args: argparse.Namespace | None = None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("RLHF_DEBUG", "").strip().lower() not in (
        "",
        "0",
        "false",
        "no",
    )


def one_sentence(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def bug_hint(err: BaseException) -> str:
    """The line printed under a bug's traceback."""
    return (
        f"rlhf: this {type(err).__name__} is a bug in rlhf, not a mistake in the config or data; "
        "please report it with the traceback above"
    )


def main(argv: list[str] | None = None) -> int:
    """Run a command; a `UserError` prints one sentence on stderr and exits 2, a stage that did not finish on
    its processes (`StageFailedError`) one sentence and exits 1 (`--debug` or RLHF_DEBUG=1 print their
    traceback as well). Any other exception is a bug: it propagates with `bug_hint` as a note, so the
    interpreter prints its traceback, that line under it, and exits 1."""
    args = build_parser().parse_args(argv)
    # a module the config names (a reward function, a tool) may sit in the directory `rlhf` runs from, as with
    # `python -m`; appended, so it never shadows an installed package
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        overrides = export_credentials(getattr(args, "overrides", []))
        return COMMANDS[args.command](args, overrides)
    except Exception as err:
        code = 2 if isinstance(err, UserError) else 1 if isinstance(err, known_failures()) else None
        if code is None:  # a bug
            err.add_note(bug_hint(err))
            raise
        if debug_wanted(args):
            import traceback

            traceback.print_exception(err, file=sys.stderr)
        print(f"error: {one_sentence(err)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
