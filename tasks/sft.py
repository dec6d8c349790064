"""The SFT warm start as a Prefect task: train, save, register the checkpoint as a policy version.

A finished warm start is reused when the same settings and data come again (the directory holds a
stage key), and its registered version is looked up by that key instead of registering a second one.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from rlhf_core.config import PipelineConfig
from rlhf_core.data import read_column
from rlhf_core.models import load_causal_lm, load_tokenizer, prepare_for_training
from rlhf_core.sft import train_sft
from tasks import tracking
from tasks.data import PreparedData
from tasks.plots import close, curve_figure
from tasks.progress import StageProgress
from tasks.retry import IO_RETRIES
from tasks.stage_io import Checkpoint, stage_key

STAGE_FILE = "rlhf_stage.json"


def sft_key(cfg: PipelineConfig, data: PreparedData) -> str:
    """What the warm start's result depends on: its settings, the model, the data, the seed."""
    return stage_key({
        "sft": cfg.sft.model_dump(mode="json"), "model": cfg.model.model_dump(mode="json"),
        "data": data.fingerprints.get("sft"), "max_length": cfg.data.max_length, "seed": cfg.run.seed,
        "mixed_precision": cfg.run.mixed_precision,
    })


def _read_stage_file(path: Path) -> dict:
    try:
        return json.loads((path / STAGE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@task(name="sft-warm-start", cache_policy=NO_CACHE, **IO_RETRIES)
def sft_warm_start(cfg: PipelineConfig, data: PreparedData, parent_run_id: str) -> Checkpoint:
    """Fine-tune the base policy on the text corpus; reuse a finished run with the same key."""
    logger = get_run_logger()
    out_dir = cfg.run.output_dir / "sft"
    key = sft_key(cfg, data)
    with tracking.stage_run(parent_run_id, "sft") as run_id:
        done = _read_stage_file(out_dir)
        if done.get("key") == key:
            logger.info("SFT warm start with key %s already in %s; reusing it", key, out_dir)
            metrics = done["metrics"]
        else:
            tokenizer = load_tokenizer(data.tokenizer, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
            model = load_causal_lm(data.base_model, revision=cfg.model.revision,
                                   trust_remote_code=cfg.model.trust_remote_code, torch_dtype=cfg.model.torch_dtype)
            prepare_for_training(model, gradient_checkpointing=cfg.model.gradient_checkpointing)
            texts = read_column(data.tables["sft"], "text")
            progress = StageProgress("sft-progress", f"SFT warm start: {cfg.sft.max_steps} steps")
            losses: list[tuple[int, float]] = []

            def on_log(metrics: dict[str, float], step: int) -> None:
                tracking.log_metrics(run_id, metrics, step)
                losses.append((step, metrics["sft/loss"]))
                progress.update(step, cfg.sft.max_steps)

            metrics = train_sft(model, tokenizer, texts, cfg.sft, cfg.run, max_length=cfg.data.max_length,
                                output_dir=out_dir, on_log=on_log)
            # written last: a crash before this line means the next run trains again
            (out_dir / STAGE_FILE).write_text(json.dumps({"key": key, "metrics": metrics}, indent=2))
            progress.update(cfg.sft.max_steps, cfg.sft.max_steps)
            fig = curve_figure({"sft/loss": losses}, "SFT warm start")
            tracking.log_figure(run_id, fig, "sft_loss.png")
            close(fig)
            logger.info("SFT loss %.3f -> %.3f", metrics["sft/first_loss"], metrics["sft/loss"])

        step = int(metrics["sft/steps"])
        model_uri = None
        if cfg.tracking.register_models:
            tags = tracking.lineage_tags(stage="sft", step=step, config_hash=cfg.config_hash(),
                                         data_fingerprint=data.fingerprint, stage_key=key)
            model_uri = tracking.register_once(out_dir, cfg.registry.policy_model_name, task="text-generation",
                                               tags=tags, run_id=run_id, keep_last=cfg.registry.keep_last_versions)
            logger.info("SFT checkpoint is %s", model_uri)
        return Checkpoint(path=str(out_dir.resolve()), model_uri=model_uri, step=step, metrics=metrics, key=key)
