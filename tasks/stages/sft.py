"""The `sft` stage (the SFT warm start) as a Prefect task: train, save, register the checkpoint as a policy
version.

A finished warm start is reused when the same settings and data come again (the directory holds a
stage key), and its registered version is looked up by that key instead of registering a second one.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import PipelineConfig
from rlhf_core.data.tables import read_column
from rlhf_core.models.loading import load_causal_lm, model_tokenizer, prepare_for_training
from rlhf_core.training.loop import Hooks
from rlhf_core.training.sft import train_sft
from tasks import tracking
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.reporter import StageReporter
from tasks.runtime.retry import IO_RETRIES
from tasks.stage_io import Checkpoint, stage_key
from tasks.stages.data import PreparedData

STAGE_FILE = "rlhf_stage.json"


def sft_key(cfg: PipelineConfig, data: PreparedData) -> str:
    """What the warm start's result depends on: its settings, the model, the data, the seed."""
    return stage_key(
        {
            "sft": cfg.sft.model_dump(mode="json"),
            # unset gradient checkpointing keys as the false it meant before: it changes no number
            "model": cfg.model.model_dump(mode="json")
            | {"gradient_checkpointing": cfg.model.gradient_checkpointing or False},
            "data": data.fingerprints.get("sft"),
            "max_length": cfg.data.max_length,
            "seed": cfg.run.seed,
            "mixed_precision": cfg.run.mixed_precision,
        }
    )


def _read_stage_file(path: Path) -> dict:
    try:
        return json.loads((path / STAGE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _train(cfg: PipelineConfig, data: PreparedData, reporter: StageReporter, out_dir: Path, key: str) -> dict:
    """Train the warm start into out_dir; its metrics. The stage file is written last: a crash before it means
    the next run trains again. The stage run lists the SFT table as its dataset input (a warm start reused
    whole logs nothing: its run, left empty, is dropped)."""
    tracking.logs.log_datasets(reporter.run_id, data.inputs_for("sft"))
    tokenizer = model_tokenizer(cfg.model, data.tokenizer)
    model = load_causal_lm(
        data.base_model,
        revision=cfg.model.revision,
        trust_remote_code=cfg.model.trust_remote_code,
        torch_dtype=cfg.model.torch_dtype,
    )
    prepare_for_training(model, gradient_checkpointing=cfg.model.checkpointing)
    texts = read_column(data.tables["sft"], "text")
    reporter.start(cfg.sft.max_steps, f"SFT warm start: {cfg.sft.max_steps} steps")
    metrics = train_sft(
        model,
        tokenizer,
        texts,
        cfg.sft,
        cfg.run,
        max_length=cfg.data.max_length,
        output_dir=out_dir,
        hooks=Hooks(on_log=reporter.log),
    )
    (out_dir / STAGE_FILE).write_text(json.dumps({"key": key, "metrics": metrics}, indent=2))
    reporter.done()
    reporter.plot("sft_loss.png", "SFT warm start")
    reporter.logger.info("SFT loss %.3f -> %.3f", metrics["sft/first_loss"], metrics["sft/loss"])
    return metrics


@task(name="sft", cache_policy=NO_CACHE, **IO_RETRIES)
def sft_stage(cfg: PipelineConfig, data: PreparedData, parent_run_id: str) -> Checkpoint:
    """Fine-tune the base policy on the text corpus; reuse a finished run with the same key."""
    out_dir = cfg.run.output_dir / "sft"
    key = sft_key(cfg, data)
    curves = {"sft/loss": ("sft/loss",)}
    with (
        tracking.runs.stage_run(parent_run_id, "sft", tracking.runs.stage_params(cfg, "sft")) as run_id,
        StageReporter(
            StageIdentity(cfg, "sft", run_id, key, data.fingerprint),
            curves=curves,
            model=RegisteredModel(cfg.registry.policy_model_name),
        ) as reporter,
    ):
        done = _read_stage_file(out_dir)
        if done.get("key") == key:
            reporter.logger.info("SFT warm start with key %s already in %s; reusing it", key, out_dir)
            metrics = done["metrics"]
        else:
            metrics = _train(cfg, data, reporter, out_dir, key)
        step = int(metrics["sft/steps"])
        model_uri = reporter.register(out_dir, step)
        return Checkpoint(path=str(out_dir.resolve()), model_uri=model_uri, step=step, metrics=metrics, key=key)
