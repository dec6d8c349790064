"""The tasks' shared fixture: a config that tracks into tmp_path's SQLite store and writes into tmp_path."""

from __future__ import annotations

import pytest

from rlhf_core.config import PipelineConfig, load_config


@pytest.fixture
def cfg(tmp_path, mlflow_uri) -> PipelineConfig:
    """The default config, tracking into tmp_path's SQLite store (experiment `t`), writing into tmp_path."""
    return load_config(
        None, [f"tracking.uri={mlflow_uri}", "tracking.experiment=t", f"run.output_dir={tmp_path}", "run.name=unit"]
    )
