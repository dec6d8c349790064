"""The run's own machinery, without Prefect or MLflow: one writer per run directory (`run_lock`), the server
processes a run starts (`server_processes`), retries of transient I/O (`retry`)."""
