"""Prefect tasks: one per stage, owning paths, checkpoints, MLflow and Prefect artifacts.

Importing this package sets Prefect defaults that must be in place before Prefect reads its
settings: the ephemeral server needs 20-35 s to start on a 2-core machine, longer than Prefect's
default startup timeout. A user's own settings (PREFECT_API_URL included) are never overridden.
"""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
