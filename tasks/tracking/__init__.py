"""All MLflow tracking code (the registry's is the `tasks/registry/` package), one module per concern:

- `store`: where tracking and the registry point, credentials into MLflow's environment, the SQLite store
  and its cached template, locks, experiments, which process writes;
- `runs`: the pipeline's run, a nested run per stage, ending runs their process left RUNNING;
- `feedback`: users' feedback on a served policy's traced answers, and the cut-off of the last training on it;
- `params`: which config fields a run logs as its params (those it reads);
- `logs`: what a run receives (metrics and tables rounded for reading, figures, artifacts, dataset inputs,
  tags, its description, links).

Callers write `from tasks import tracking` and `tracking.store.configure(...)`, `tracking.runs.stage_run(...)`,
`tracking.logs.log_metrics(...)`.
"""

from tasks.tracking import feedback, logs, params, runs, store

__all__ = ["feedback", "logs", "params", "runs", "store"]
