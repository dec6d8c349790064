"""A checkpoint registered as a model version: logged to its run (tasks/registry/logged_model.py), then a
version created from the logged model with its tags in the same call, so there is never a version without its
tags. `register_once` holds a file lock (`tracking.store.store_lock`), so concurrent processes never register one
checkpoint twice.

A version's tags are what a person filters versions on and what the pipeline reads back (`version_tags`): its
stage, step, run label, stage key and data fingerprint, lineage, its evaluation's gold metric, the guard's verdict.
MLflow's list of versions shows every tag of a version, one a line, so what is read rather than filtered on
(`DESCRIBED`: the algorithm, the exact and the training KL, the proxy score, the config hash, the code version) is
the version's description instead, and an empty value is no tag at all."""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
from filelock import Timeout
from mlflow.tracking import MlflowClient

from tasks.registry.logged_model import log_checkpoint
from tasks.registry.versions import prune_versions
from tasks.tracking.runs import code_version
from tasks.tracking.store import store_lock, writes


def lineage_tags(*, stage: str, step: int, config_hash: str, data_fingerprint: str, **extra: str) -> dict[str, str]:
    """What every registered checkpoint records (its tags and, for `DESCRIBED`, its description)."""
    tags = {
        "stage": stage,
        "step": str(step),
        "config_hash": config_hash,
        "data_fingerprint": data_fingerprint,
        "code_version": code_version(),
    }
    tags.update({k: str(v) for k, v in extra.items()})
    return tags


# recorded for every checkpoint, read on its page, rarely filtered on: the version's description, not its tags
DESCRIBED = {
    "algorithm": "algorithm",
    "eval_score_mean": "held-out reward-model score (the proxy)",
    "eval_kl_exact_mean": "held-out KL to the initial policy (exact, nats per completion)",
    "kl": "training KL estimate at this step (k1, sampled, nats)",
    "config_hash": "config hash",
    "code_version": "code version",
}


def version_tags(tags: dict[str, str]) -> dict[str, str]:
    """The tags a version is created with: `tags` less `DESCRIBED` and less empty values."""
    return {k: str(v) for k, v in tags.items() if str(v) != "" and k not in DESCRIBED}


def checkpoint_description(tags: dict[str, str]) -> str:
    """A version's description (Markdown) from what `lineage_tags` records: what it is, in plain text (MLflow's
    list of versions shows the first line raw), then `DESCRIBED`."""
    run = f" of run {tags['run_label']}" if tags.get("run_label") else ""
    head = f"{tags.get('stage', 'model')} checkpoint at step {tags.get('step', '?')}{run}."
    details = [f"- {label}: `{tags[key]}`" for key, label in DESCRIBED.items() if tags.get(key, "") != ""]
    return "\n\n".join([head, "\n".join(details)]) if details else head


def find_version(model_name: str, tags: dict[str, str]):
    """The newest version of `model_name` carrying all `tags` (an empty value: no such tag), or None."""
    client = MlflowClient()
    try:
        versions = client.search_model_versions(f"name = '{model_name}'")
    except mlflow.exceptions.MlflowException:
        return None
    matching = [v for v in versions if all(v.tags.get(k, "") == str(val) for k, val in tags.items())]
    return max(matching, key=lambda v: int(v.version)) if matching else None


def register_checkpoint(
    checkpoint_dir: str | Path,
    model_name: str,
    *,
    task: str,
    tags: dict[str, str],
    run_id: str,
    input_example: bool = True,
) -> dict[str, str]:
    """Log a Hugging Face checkpoint directory as a new version of `model_name`.

    `task` is the transformers pipeline task ("text-generation" for policies,
    "text-classification" for reward models). A text-generation version is served by
    tasks/loaders/policy.py (its signature: per-request params max_new_tokens, temperature, top_p, do_sample with
    defaults from the checkpoint's generation_config; completions, finish reasons and token counts out) and, with
    input_example, a short input example whose run leaves the random state as it was (without one, nothing here
    draws from the global random generators). The logged model belongs to the run `run_id` (active or not: this
    may run on a background thread) and carries its metrics of the checkpoint's own step (tag `step`; MLflow
    would take step 0). The version gets `version_tags(tags)` and `checkpoint_description(tags)`.
    Returns {"name", "version", "uri"}.
    """
    info = log_checkpoint(Path(checkpoint_dir), task=task, tags=tags, run_id=run_id, input_example=input_example)
    version = create_version(info.model_uri, model_name, version_tags(tags), checkpoint_description(tags))
    return {"name": model_name, "version": version, "uri": f"models:/{model_name}/{version}"}


def create_version(model_uri: str, model_name: str, tags: dict[str, str], description: str = "") -> str:
    """A new version of `model_name` from the logged model at `model_uri`, created with its tags in one call,
    once READY and described; its number. If it never gets there it is deleted again, so no half-registered
    version remains."""
    version = mlflow.register_model(model_uri, model_name, tags=tags)
    try:
        await_ready(model_name, version.version)
        if description:
            MlflowClient().update_model_version(model_name, version.version, description=description)
    except BaseException:
        MlflowClient().delete_model_version(model_name, version.version)
        raise
    return str(version.version)


def await_ready(model_name: str, version: str, timeout_s: float = 300.0) -> None:
    """Block until the version's status is READY; raise when it failed or timeout_s passed."""
    client = MlflowClient()
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_model_version(model_name, version).status
        if status == "READY":
            return
        if status == "FAILED_REGISTRATION" or time.monotonic() > deadline:
            raise RuntimeError(f"model version {model_name}/{version} did not become READY (status {status})")
        time.sleep(0.5)


def register_once(
    checkpoint_dir: str | Path,
    model_name: str,
    *,
    task: str,
    tags: dict[str, str],
    run_id: str,
    identity: tuple[str, ...] = ("stage", "stage_key", "step", "attempt"),
    keep_last: int | None = None,
    input_example: bool = True,
) -> str:
    """URI of the version whose `identity` tags match `tags`, registering the checkpoint only if none does.

    This is what makes re-runs and resumed runs register no duplicate versions, also when two processes
    register the same checkpoint at once: the look-up and the registration hold `store_lock(uri,
    "register")` (the limits are that lock's). Returns "" on the processes of a data-parallel stage
    other than rank 0. keep_last (registry.keep_last_versions): after a new version is registered,
    `prune_versions(model_name, keep_last)`. input_example: see `register_checkpoint`.
    """
    if not writes():
        return ""
    # a tag of `identity` that `tags` lack must be absent from the version too (""): an RL checkpoint's
    # `attempt` (2 and on, after a guard rollback) tells it from the first attempt's checkpoint of its step
    identity_tags = {k: tags.get(k, "") for k in identity}
    existing = find_version(model_name, identity_tags)
    if existing is not None:
        return f"models:/{model_name}/{existing.version}"
    lock = store_lock(mlflow.get_registry_uri(), "register")
    try:
        lock.acquire()
    except Timeout:
        raise RuntimeError(
            f"waited {lock.timeout:.0f} s for another process's registration to end "
            f"(lock {lock.lock_file}); is a registration hanging?"
        ) from None
    try:
        existing = find_version(model_name, identity_tags)  # registered by another process while we waited
        if existing is not None:
            return f"models:/{model_name}/{existing.version}"
        uri = register_checkpoint(
            checkpoint_dir, model_name, task=task, tags=tags, run_id=run_id, input_example=input_example
        )["uri"]
        prune_versions(model_name, keep_last)
        return uri
    finally:
        lock.release()
