"""Registered versions once they exist: look-up by alias, aliases and tags, retention, and a version as a
local Hugging Face directory (keyed by what the version is now, not by the URI as written)."""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from rlhf_core.config.redaction import redact
from tasks.tracking.store import writes

logger = logging.getLogger(__name__)


class MissingVersion(LookupError):
    """A models:/ URI that names no version in the registry."""


def version_by_alias(model_name: str, alias: str):
    """The model version `alias` points at, or None when the alias (or the model) does not exist."""
    try:
        return MlflowClient().get_model_version_by_alias(model_name, alias)
    except mlflow.exceptions.MlflowException:
        return None


def set_alias(model_name: str, alias: str, version: str) -> None:
    if not writes():
        return
    MlflowClient().set_registered_model_alias(model_name, alias, str(version))


def set_version_tags(model_name: str, version: str, tags: dict[str, str]) -> None:
    """Set the version's tags; an empty value removes the tag (no version carries an empty tag)."""
    if not writes():
        return
    client = MlflowClient()
    current = client.get_model_version(model_name, str(version)).tags if "" in map(str, tags.values()) else {}
    for key, value in tags.items():
        if str(value) != "":
            client.set_model_version_tag(model_name, str(version), key, str(value))
        elif key in current:
            client.delete_model_version_tag(model_name, str(version), key)


def describe_version(uri: str, description: str) -> None:
    """Set the description of the version `uri` (models:/name/N): what the registry UI shows on its page."""
    name, version = uri.removeprefix("models:/").rsplit("/", 1)
    MlflowClient().update_model_version(name, version, description=description)


def describe_model(model_name: str, description: str) -> None:
    """Give the registered model `model_name` its description (the first thing its page in MLflow's UI shows)
    when it has none: a description a person wrote stays. Nothing when the model does not exist."""
    if not writes():
        return
    client = MlflowClient()
    try:
        model = client.get_registered_model(model_name)
    except mlflow.exceptions.MlflowException:
        return
    if not model.description:
        client.update_registered_model(model_name, description=description)


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
        _delete_logged_model(client, model_name, version)
        logger.info(
            "deleted model version %s/%s (registry.keep_last_versions=%d)", model_name, version.version, keep_last
        )
        deleted.append(str(version.version))
    return deleted


def logged_model_id(version) -> str | None:
    """The logged model a version was registered from (its model_id, or its models:/m-... source)."""
    if getattr(version, "model_id", None):
        return version.model_id
    source = version.source or ""
    rest = source.removeprefix("models:/")
    return rest if source.startswith("models:/m-") and "/" not in rest else None


def _delete_logged_model(client: MlflowClient, model_name: str, version) -> None:
    """Mark the logged model behind a deleted version deleted; a failure is a warning (the version is gone)."""
    model_id = logged_model_id(version)
    if not model_id:
        return
    try:
        client.delete_logged_model(model_id)
    except mlflow.exceptions.MlflowException:
        logger.warning(
            "could not mark logged model %s of %s/%s deleted", model_id, model_name, version.version, exc_info=True
        )


def resolve_version(uri: str):
    """The model version a models:/<name>/<version> or models:/<name>@<alias> URI points at now; MissingVersion
    when the registry has none."""
    ref = uri.removeprefix("models:/")
    client = MlflowClient()
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            return client.get_model_version_by_alias(name, alias)
        name, number = ref.rsplit("/", 1)
        return client.get_model_version(name, number)
    except (mlflow.exceptions.MlflowException, ValueError) as err:
        reason = getattr(err, "error_code", None) or "not models:/<name>/<version> or models:/<name>@<alias>"
        raise MissingVersion(
            f"the registry at {redact(mlflow.get_tracking_uri())} has no model version {uri} ({reason})"
        ) from None


def version_cache_key(uri: str) -> str:
    """A directory name unique to the model version a models:/ URI points at now.

    Aliases move and version numbers restart when a registry is recreated, so the key holds the
    resolved version and a hash of where its artifacts live, never the URI as written.
    Raises MissingVersion when the registry has no such version.
    """
    version = resolve_version(uri)
    digest = hashlib.sha256(f"{version.source}|{version.run_id}|{version.creation_timestamp}".encode()).hexdigest()[:10]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{version.name}-v{version.version}-{digest}")


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
