"""The model registry: checkpoints as registered model versions, their look-up, retention and aliases.

A checkpoint directory becomes a new version of a registered model, with lineage tags set in the same
call that creates the version, so there is never a version without its tags. Registrations hold a
file lock (`tracking.store.store_lock`), so concurrent processes never register one checkpoint twice.
The store is tasks/tracking/store.py, runs tasks/tracking/runs.py, what is logged to them tasks/tracking/logs.py.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import time
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import mlflow
from filelock import Timeout
from mlflow.entities import LoggedModelStatus
from mlflow.tracking import MlflowClient

# imported here, on the importing (main) thread: resolved first on the registration thread while the training
# thread loads its models, transformers' lazy modules imported each other half-way and failed with
# "cannot import name 'AutoModelForCausalLM'" (a stage resumed by a fresh process registers at once)
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_core.config.redaction import redact
from rlhf_core.models.loading import MODEL_BUILDING, load_pretrained
from rlhf_core.storage.checkpoints import link_identical_files
from tasks import served_policy
from tasks.tracking.runs import code_version
from tasks.tracking.store import store_lock, writes

# Packages a logged model needs to load again. Listed explicitly because MLflow's inference of
# default requirements looks for torchvision, which has no CPU build in our registries.
MODEL_REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors", "accelerate")

# MLflow runs the example once when the version is logged (short). The caller's random state is restored
# afterwards, which is only right on the thread that trains: a registration on the background thread
# (tasks/reporting/reporter.py) logs no example.
INPUT_EXAMPLE = (["Hello"], {"max_new_tokens": 2})


def lineage_tags(*, stage: str, step: int, config_hash: str, data_fingerprint: str, **extra: str) -> dict[str, str]:
    """The tags every registered checkpoint carries."""
    tags = {
        "stage": stage,
        "step": str(step),
        "config_hash": config_hash,
        "data_fingerprint": data_fingerprint,
        "code_version": code_version(),
    }
    tags.update({k: str(v) for k, v in extra.items()})
    return tags


def find_version(model_name: str, tags: dict[str, str]):
    """The newest version of `model_name` carrying all `tags`, or None."""
    client = MlflowClient()
    try:
        versions = client.search_model_versions(f"name = '{model_name}'")
    except mlflow.exceptions.MlflowException:
        return None
    matching = [v for v in versions if all(v.tags.get(k) == val for k, val in tags.items())]
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
    tasks/served_policy.py (its signature: per-request params max_new_tokens, temperature, top_p, do_sample with
    defaults from the checkpoint's generation_config; completions, finish reasons and token counts out) and, with input_example, a short input example whose run leaves the random
    state as it was (without one, nothing here draws from the global random generators). The logged model
    belongs to the run `run_id` (active or not: this may run on a background thread) and carries its
    metrics of the checkpoint's own step (tag `step`; MLflow would take step 0). The version is created
    with its tags in one call; if anything fails after it exists, it is deleted again, so no
    half-registered version remains. Returns {"name", "version", "uri"}.
    """
    checkpoint_dir = Path(checkpoint_dir)
    loader = AutoModelForSequenceClassification if task == "text-classification" else AutoModelForCausalLM
    with MODEL_BUILDING:  # beside training, whose model loading imports transformers' lazy modules too
        model = load_pretrained(loader, checkpoint_dir)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    requirements = model_requirements()

    flavor_log = logging.getLogger("mlflow.transformers")
    level = flavor_log.level
    flavor_log.setLevel(logging.ERROR)  # local checkpoints have no hub model card or license to find
    serving = {}
    if task == "text-generation":
        serving = {"signature": served_policy.generation_signature(model.generation_config)}
        if input_example:
            serving["input_example"] = INPUT_EXAMPLE
    # the logged model is created here, in its run's experiment: log_model would put one logged on a thread
    # without an active run (the registration thread) in the Default experiment
    run = MlflowClient().get_run(run_id)
    logged = mlflow.initialize_logged_model(
        name=f"{tags.get('stage', 'model')}-step-{tags.get('step', '0')}",
        source_run_id=run_id,
        experiment_id=run.info.experiment_id,
        params=dict(run.data.params),
    )
    try:
        with _random_state_kept() if input_example else nullcontext():
            log_model = served_policy.log_model if task == "text-generation" else mlflow.transformers.log_model
            info = log_model(
                transformers_model={"model": model, "tokenizer": tokenizer},
                name=logged.name,
                model_id=logged.model_id,
                task=task,
                pip_requirements=requirements,
                step=_step_of(tags),  # the run's metrics of this step become the logged model's (MLflow: 0)
                run_id=run_id,  # passed on to mlflow.models.Model.log
                **serving,
            )
    except BaseException:
        mlflow.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    finally:
        flavor_log.setLevel(level)
    link_identical_files(_local_artifact_dir(info.model_id), checkpoint_dir)
    version = mlflow.register_model(info.model_uri, model_name, tags=tags)
    try:
        _await_ready(model_name, version.version)
    except BaseException:
        MlflowClient().delete_model_version(model_name, version.version)
        raise
    return {"name": model_name, "version": str(version.version), "uri": f"models:/{model_name}/{version.version}"}


def model_requirements() -> list[str]:
    """MODEL_REQUIREMENTS pinned to the installed versions: what every logged model lists."""
    return [f"{pkg}=={metadata.version(pkg)}" for pkg in MODEL_REQUIREMENTS]


@lru_cache(maxsize=1)
def warm_up() -> None:
    """Pay a process's one-time costs of its first registration ahead of it (about a second on 2 cores:
    importing MLflow's transformers flavor and PEFT, which the flavor checks for, and MLflow's map of every
    installed package, which it builds to compare a model's requirements with the environment). A stage runs
    this on its registration thread while it trains (tasks/reporting/reporter.py). Never raises: a failure here only
    means the first registration pays the cost itself."""
    try:
        import mlflow.transformers  # noqa: F401
        import peft  # noqa: F401
        from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

        warn_dependency_requirement_mismatches(model_requirements())
    except Exception as err:  # noqa: BLE001
        logging.getLogger(__name__).debug("registry warm-up skipped: %s", err)


def _step_of(tags: dict[str, str]) -> int:
    """The training step a checkpoint's tags name (0 when none)."""
    step = str(tags.get("step", "0"))
    return int(step) if step.isdigit() else 0


@contextmanager
def _random_state_kept():
    """Restore Python's, NumPy's and torch's (CPU and CUDA) random states on exit."""
    import numpy as np
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _local_artifact_dir(model_id: str | None) -> Path | None:
    """The directory of a logged model's artifacts when the artifact store is this machine's disk."""
    if not model_id:
        return None
    location = mlflow.get_logged_model(model_id).artifact_location or ""
    if not location.startswith("file:"):
        return None
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(location).path))


def register_once(
    checkpoint_dir: str | Path,
    model_name: str,
    *,
    task: str,
    tags: dict[str, str],
    run_id: str,
    identity: tuple[str, ...] = ("stage", "stage_key", "step"),
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
    identity_tags = {k: tags[k] for k in identity}
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


def _logged_model_id(version) -> str | None:
    """The logged model a version was registered from (its model_id, or its models:/m-... source)."""
    if getattr(version, "model_id", None):
        return version.model_id
    source = version.source or ""
    rest = source.removeprefix("models:/")
    return rest if source.startswith("models:/m-") and "/" not in rest else None


def prune_versions(model_name: str, keep_last: int | None) -> list[str]:
    """Delete the versions of `model_name` older than its newest `keep_last`; return their numbers.

    Kept whatever their age: every version an alias points at (candidate, champion, any other) and
    every version tagged keep=true. The logged model behind a deleted version is marked deleted too
    (MLflow soft-deletes it: its artifacts stay in the artifact store until `mlflow gc` removes them).
    keep_last None keeps everything.
    """
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    client = MlflowClient()
    aliased = {str(v) for v in client.get_registered_model(model_name).aliases.values()}
    versions = sorted(
        client.search_model_versions(f"name = '{model_name}'"), key=lambda v: int(v.version), reverse=True
    )
    deleted = []
    for version in versions[keep_last:]:
        if str(version.version) in aliased or str(version.tags.get("keep", "")).lower() == "true":
            continue
        client.delete_model_version(model_name, version.version)
        model_id = _logged_model_id(version)
        if model_id:
            try:
                client.delete_logged_model(model_id)
            except mlflow.exceptions.MlflowException:
                logging.getLogger(__name__).warning(
                    "could not mark logged model %s of %s/%s deleted",
                    model_id,
                    model_name,
                    version.version,
                    exc_info=True,
                )
        logging.getLogger(__name__).info(
            "deleted model version %s/%s (registry.keep_last_versions=%d)", model_name, version.version, keep_last
        )
        deleted.append(str(version.version))
    return deleted


def _await_ready(model_name: str, version: str, timeout_s: float = 300.0) -> None:
    client = MlflowClient()
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_model_version(model_name, version).status
        if status == "READY":
            return
        if status == "FAILED_REGISTRATION" or time.monotonic() > deadline:
            raise RuntimeError(f"model version {model_name}/{version} did not become READY (status {status})")
        time.sleep(0.5)


class MissingVersion(LookupError):
    """A models:/ URI that names no version in the registry."""


def version_cache_key(uri: str) -> str:
    """A directory name unique to the model version a models:/ URI points at now.

    Aliases move and version numbers restart when a registry is recreated, so the key holds the
    resolved version and a hash of where its artifacts live, never the URI as written.
    Raises MissingVersion when the registry has no such version.
    """
    ref = uri.removeprefix("models:/")
    client = MlflowClient()
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, number = ref.rsplit("/", 1)
            version = client.get_model_version(name, number)
    except mlflow.exceptions.MlflowException as err:
        raise MissingVersion(
            f"the registry at {redact(mlflow.get_tracking_uri())} has no model version {uri} ({err.error_code})"
        ) from None
    digest = hashlib.sha256(f"{version.source}|{version.run_id}|{version.creation_timestamp}".encode()).hexdigest()[:10]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{name}-v{version.version}-{digest}")


def materialize_version(uri: str, cache_root: str | Path) -> Path:
    """The version a models:/ URI (number or alias) points at, as a local Hugging Face directory under cache_root."""
    return materialize_model(uri, Path(cache_root) / version_cache_key(uri))


def materialize_model(uri: str, destination: str | Path) -> Path:
    """Resolve a models:/ URI to a local Hugging Face directory (model + tokenizer) and return it."""
    destination = Path(destination)
    if (destination / "config.json").is_file():
        return destination
    components = mlflow.transformers.load_model(uri, return_type="components")
    from rlhf_core.storage.saving import save_pretrained_atomic

    return save_pretrained_atomic(components["model"], components["tokenizer"], destination)


def set_alias(model_name: str, alias: str, version: str) -> None:
    if not writes():
        return
    MlflowClient().set_registered_model_alias(model_name, alias, str(version))


def version_by_alias(model_name: str, alias: str):
    """The model version `alias` points at, or None when the alias (or the model) does not exist."""
    try:
        return MlflowClient().get_model_version_by_alias(model_name, alias)
    except mlflow.exceptions.MlflowException:
        return None


def set_version_tags(model_name: str, version: str, tags: dict[str, str]) -> None:
    if not writes():
        return
    client = MlflowClient()
    for key, value in tags.items():
        client.set_model_version_tag(model_name, str(version), key, str(value))


def describe_version(uri: str, description: str) -> None:
    """Set the description of the version `uri` (models:/name/N): what the registry UI shows on its page."""
    name, version = uri.removeprefix("models:/").rsplit("/", 1)
    MlflowClient().update_model_version(name, version, description=description)
