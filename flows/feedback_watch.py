"""New feedback starts the retraining: count the feedback pairs that arrived since the last training and, once
they reach `retrain.min_new_pairs`, emit the Prefect event `rlhf.feedback.ready` that the `rlhf-retrain/on-feedback`
deployment's trigger (deployments/prefect.yaml) answers with a retraining on the same config.

Run it on a schedule of minutes (`rlhf-feedback-watch/every-5-minutes`). The event's resource is
`rlhf.feedback.<experiment>`; its payload holds the count, the threshold, and the config path and overrides the
retraining takes. The retraining deployment runs one at a time (concurrency limit 1, a new run is cancelled while
one is going), so a watch that fires again before the retraining registered its candidate starts nothing twice.
"""

from __future__ import annotations

from prefect import flow
from prefect.events import emit_event
from prefect.logging import get_run_logger

from rlhf_core.config import load_config
from rlhf_core.config.redaction import refuse_secret_overrides
from tasks.stages.feedback import new_pairs

FEEDBACK_READY = "rlhf.feedback.ready"


@flow(name="rlhf-feedback-watch", log_prints=True)
def rlhf_feedback_watch(config_path: str | None = "configs/demo.yaml", overrides: list[str] | None = None) -> dict:
    """Count the new feedback pairs of data.preference's traces: source; emit FEEDBACK_READY at the threshold."""
    refuse_secret_overrides(overrides)  # the event's payload and Prefect's parameters keep them
    logger = get_run_logger()
    cfg = load_config(config_path, overrides or [])
    count, experiment = new_pairs(cfg)
    needed = cfg.retrain.min_new_pairs
    ready = count >= needed
    logger.info(
        "%d new feedback pairs in experiment '%s' since the last training (retrain.min_new_pairs %d)",
        count,
        experiment,
        needed,
    )
    if ready:
        emit_event(
            event=FEEDBACK_READY,
            resource={"prefect.resource.id": f"rlhf.feedback.{experiment}", "prefect.resource.name": experiment},
            payload={
                "new_pairs": count,
                "min_new_pairs": needed,
                "config_path": config_path,
                "overrides": list(overrides or []),
            },
        )
        logger.info("emitted %s: a retraining starts on the %d pairs", FEEDBACK_READY, count)
    return {"experiment": experiment, "new_pairs": count, "min_new_pairs": needed, "emitted": ready}
