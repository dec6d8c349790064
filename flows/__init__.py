"""Prefect flows: the pipeline DAG, retraining and promotion."""

import tasks  # noqa: F401  (sets Prefect's startup defaults before Prefect is imported)
