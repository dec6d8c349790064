"""Scheduled retraining: the pipeline on the current preference data, then promotion.

`preference_path` (a file, a directory or a glob such as data/prefs/*.jsonl) replaces
data.preference.path. New or changed files change the data fingerprint; when the `candidate`
policy was already trained on data with the same fingerprint, nothing is trained and promotion has
nothing new to judge. `start_from` picks the policy's start: the current champion, the SFT warm
start, or the base model.
"""

from __future__ import annotations

from typing import Literal

from prefect import flow
from prefect.logging import get_run_logger

from flows.promote import CHAMPION, check_promotion, rlhf_promote
from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.config import load_config
from tasks import registry, tracking


@flow(name="rlhf-retrain", log_prints=True)
def rlhf_retrain(
    config_path: str | None = "configs/demo.yaml",
    overrides: list[str] | None = None,
    preference_path: str | None = None,
    start_from: Literal["champion", "sft", "base"] = "champion",
    promote: bool = True,
) -> dict:
    """Retrain on new preference data (if any), then run promotion."""
    logger = get_run_logger()
    settings = list(overrides or []) + [f"init.policy={start_from}"]
    if preference_path:
        settings.append(f"data.preference.path={preference_path}")
    if promote:  # a promotion that cannot run (no evaluator outside the demo, ...) fails before training
        cfg = load_config(config_path, settings)
        check_promotion(cfg)
        if not cfg.is_demo() and cfg.promote.min_value is None:  # a first champion may need promote.min_value
            tracking.store.configure(cfg.tracking_uri())
            champion = registry.version_by_alias(cfg.registry.policy_model_name, CHAMPION)
            check_promotion(cfg, champion_exists=champion is not None)
    trained = rlhf_pipeline(config_path=config_path, overrides=settings, only_if_new_data=True)
    result = {"pipeline": trained, "promotion": None}
    if trained.get("skipped"):
        logger.info("retraining skipped: %s", trained["skipped"])
    if promote:
        result["promotion"] = rlhf_promote(config_path=config_path, overrides=settings)
    return result
