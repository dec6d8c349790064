"""The model registry: checkpoints as registered model versions, their look-up, retention and aliases.

`registration` makes a version of a checkpoint (logged to its run by `logged_model`, then a version with its
tags and description); `versions` works with versions once they exist (aliases, tags, descriptions, retention,
local copies); `version_server` serves a version for a stage's length.
Callers use the names re-exported here (`registry.register_once(...)`), which is also what tests patch.
The store is tasks/tracking/store.py, runs tasks/tracking/runs.py, what is logged to them tasks/tracking/logs.py.
"""

from tasks.registry.logged_model import (
    INPUT_EXAMPLE,
    MODEL_REQUIREMENTS,
    local_artifact_dir,
    log_checkpoint,
    model_requirements,
    warm_up,
)
from tasks.registry.registration import (
    await_ready,
    checkpoint_description,
    create_version,
    find_version,
    lineage_tags,
    register_checkpoint,
    register_once,
    version_tags,
)
from tasks.registry.versions import (
    MissingVersion,
    describe_model,
    describe_version,
    logged_model_id,
    materialize_model,
    materialize_version,
    prune_versions,
    resolve_version,
    set_alias,
    set_version_tags,
    version_by_alias,
    version_cache_key,
)

__all__ = [
    "INPUT_EXAMPLE",
    "MODEL_REQUIREMENTS",
    "MissingVersion",
    "resolve_version",
    "await_ready",
    "checkpoint_description",
    "create_version",
    "describe_model",
    "describe_version",
    "find_version",
    "lineage_tags",
    "local_artifact_dir",
    "log_checkpoint",
    "logged_model_id",
    "materialize_model",
    "materialize_version",
    "model_requirements",
    "prune_versions",
    "register_checkpoint",
    "register_once",
    "set_alias",
    "set_version_tags",
    "version_by_alias",
    "version_cache_key",
    "version_tags",
    "warm_up",
]
