"""The `data` stage: build the demo world when asked for, load and validate every table, save them.

Later stages read the validated JSONL files this task writes under <output_dir>/data/, and take the
tokenizer and base model from the paths it returns: stages hand each other paths, never objects.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from rlhf_core.config import DEMO, GROUP_ALGORITHMS, DatasetSpec, PipelineConfig
from rlhf_core.data.lengths import TableLengths, length_table
from rlhf_core.data.rows import DataValidationError, Kind
from rlhf_core.data.tables import fingerprint_rows, save_table
from rlhf_core.demo.world import DemoWorld, build_demo_world
from rlhf_core.models.loading import ModelSourceError, check_source, generation_config_of, model_tokenizer, run_stop_ids
from rlhf_core.rollout.tools import require_tool_template
from tasks import registry, tracking
from tasks.checks.lengths import check_prompt_count, context_words, measure_table
from tasks.reporting.identity import StageIdentity
from tasks.reporting.progress import publish_table
from tasks.reporting.reporter import StageReporter
from tasks.runtime.retry import IO_RETRIES
from tasks.stages.feedback import feedback_source


@dataclass(frozen=True)
class PreparedData:
    """What the data stage hands on: validated tables, their fingerprints, model sources."""

    tables: dict[str, str]
    fingerprints: dict[str, str]
    base_model: str
    tokenizer: str
    demo_world: str | None = None
    reports: list[dict] = field(default_factory=list)
    feedback_until: dict[str, int] = field(default_factory=dict)  # traces: experiment -> its window's end (ms)
    inputs: dict[str, dict] = field(default_factory=dict)  # table -> its MLflow dataset input (`dataset_inputs`)

    def source(self, table: str) -> str:
        """Where a table came from (a file, a hub name), for model cards."""
        return next((r["source"] for r in self.reports if r["table"] == table), table)

    def inputs_for(self, *tables: str) -> list[dict]:
        """The dataset-input entries of `tables` (names as in `tables`), for `tracking.logs.log_datasets` on the
        run of a stage that reads them; a table not prepared is left out."""
        return [self.inputs[name] for name in tables if name in self.inputs]

    @property
    def fingerprint(self) -> str:
        """One fingerprint over every table, for lineage tags."""
        blob = json.dumps(self.fingerprints, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def demo_path(world: DemoWorld, kind: Kind, spec: DatasetSpec) -> str:
    """The demo world's file for a 'demo' source of `kind` (split picks train or test)."""
    if kind == "text":
        return str(world.corpus)
    return str(world.preferences(spec.split) if kind == "preference" else world.prompts(spec.split))


def resolve_model_source(source: str, *, field: str, cfg: PipelineConfig, world: DemoWorld | None) -> str:
    """'demo' -> the demo base model, models:/ URI -> a local copy, else the directory or hub name."""
    if source == DEMO:
        assert world is not None
        return str(world.base_model)
    if source.startswith("models:/"):
        try:
            return str(registry.materialize_version(source, cfg.run.output_dir / "sources"))
        except registry.MissingVersion as err:
            raise ModelSourceError(f"{field}: {err}") from None
    check_source(source, field)
    return source


def tables_to_prepare(cfg: PipelineConfig) -> list[tuple[str, str, DatasetSpec, Kind]]:
    """(name, config field, spec, kind) for every table the pipeline reads (`PipelineConfig.data_tables`)."""
    return cfg.data_tables()


def check_policy_sources(cfg: PipelineConfig, world: DemoWorld | None) -> tuple[str, str, object]:
    """(base model path, tokenizer source, tokenizer), with reward.base and the stop tokens checked before any training."""
    base_model = resolve_model_source(cfg.model.base, field="model.base", cfg=cfg, world=world)
    if cfg.reward.base not in ("policy", DEMO) and not cfg.reward.base.startswith("models:/"):
        check_source(cfg.reward.base, "reward.base")  # fail before any training, not after SFT
    tokenizer_source = cfg.model.tokenizer or base_model
    tokenizer = model_tokenizer(cfg.model, tokenizer_source)  # conversational data is templated at the data stage
    # the stop tokens against the base model's tokenizer now, before SFT or reward training
    generation_config = generation_config_of(base_model, trust_remote_code=cfg.model.trust_remote_code)
    run_stop_ids(tokenizer, generation_config, cfg.rl)
    if (
        cfg.rl.algorithm in GROUP_ALGORITHMS and cfg.grpo.uses_tools
    ):  # a template that cannot carry tool turns, before SFT
        require_tool_template(tokenizer, cfg.data.chat_template_kwargs)
    return base_model, tokenizer_source, tokenizer


def prepare_table(
    cfg: PipelineConfig, world: DemoWorld | None, tokenizer, name: str, field_name: str, spec: DatasetSpec, kind: Kind
) -> tuple[dict, TableLengths]:
    """Load, validate and length-check one table and save it under <output_dir>/data; its report row and lengths."""
    resolved = demo_path(world, kind, spec) if spec.path == DEMO else None
    feedback = feedback_source(cfg, name, field_name, spec, kind, tokenizer) if spec.feedback_experiment else None
    if feedback is not None:
        resolved = feedback.path
        for note in feedback.notes:
            get_run_logger().warning("%s: %s", field_name, note)
    ds, lengths = measure_table(cfg, tokenizer, name, field_name, spec, kind, resolved)
    source = spec.path if feedback is not None else resolved or spec.path
    if lengths.over:
        get_run_logger().warning(lengths.sentence(source))
    if lengths.kept == 0:
        raise DataValidationError(
            f"{field_name}: every row of {source} is over {lengths.limit_field} ({lengths.limit} tokens) and "
            f"data.overlong is 'drop'; raise {lengths.limit_field}"
        )
    path = save_table(ds, cfg.run.output_dir / "data" / f"{name}.jsonl")
    report = {
        "table": name,
        "source": source,
        "rows": lengths.rows,
        "overlong": lengths.over,
        "action": lengths.action,
        "kept": lengths.kept,
        **lengths.as_row(),
        "fingerprint": fingerprint_rows(ds),
        "path": str(path),
    }
    if feedback is not None:
        report.update(feedback_until=feedback.until_ms, notes=" ".join(f"{n}." for n in feedback.notes))
    return report, lengths


def feedback_cutoffs(cfg: PipelineConfig, reports: list[dict]) -> dict[str, int]:
    """Each traces: experiment's window end, from the training tables read from it (kept in the registry once the
    candidate is registered, for the next `since: last_training`)."""
    specs = {name: spec for name, _, spec, _ in tables_to_prepare(cfg)}
    return {
        specs[r["table"]].feedback_experiment: r["feedback_until"]
        for r in reports
        if "feedback_until" in r and r["table"] not in EVALUATION_TABLES
    }


EVALUATION_TABLES = ("preference_eval", "eval_prompts")


def dataset_inputs(cfg: PipelineConfig, reports: list[dict]) -> dict[str, dict]:
    """The prepared tables as MLflow dataset inputs, by table name: name (the config field), source (the
    configured path, hub name or 'demo'), digest (the table's fingerprint), context (training or evaluation),
    split, rows. Computed once here; the data stage's run and each stage that reads a table log these entries."""
    by_table = {r["table"]: r for r in reports}
    inputs = {}
    for name, field_name, spec, _ in tables_to_prepare(cfg):
        if name not in by_table:
            continue
        inputs[name] = {
            "name": field_name,
            "source": spec.path,
            "digest": by_table[name]["fingerprint"],
            "context": "evaluation" if name in EVALUATION_TABLES else "training",
            "split": spec.split,
            "revision": spec.revision,
            "rows": by_table[name]["kept"],
        }
    return inputs


# log_prints off here: `datasets` fingerprints a new table with dill, which reads the bytecode listing that
# dis.dis prints; with the flow's print patched into the log, that listing (about 55 lines) landed in it
@task(name="data", cache_policy=NO_CACHE, log_prints=False, **IO_RETRIES)
def data_stage(cfg: PipelineConfig, parent_run_id: str) -> PreparedData:
    """Build or reuse the demo world, validate every table, write them under <output_dir>/data."""
    with (
        tracking.runs.stage_run(parent_run_id, "data", tracking.runs.stage_params(cfg, "data")) as run_id,
        StageReporter(StageIdentity(cfg, "data", run_id)) as reporter,
    ):
        world = None
        if cfg.uses_demo_world():
            reporter.start(0, "Building the offline demo world", key="demo-world-progress")
            world = build_demo_world(
                cfg.run.output_dir / "demo_world",
                cfg.run.seed,
                cfg.data.demo,
                cfg.model.demo,
                progress=reporter.advance,
            )
            get_run_logger().info("demo world ready at %s", world.root)
        base_model, tokenizer_source, tokenizer = check_policy_sources(cfg, world)
        reports, measured = [], []
        for name, field_name, spec, kind in tables_to_prepare(cfg):
            report, lengths = prepare_table(cfg, world, tokenizer, name, field_name, spec, kind)
            reports.append(report)
            measured.append(lengths)
            reporter.log({f"data/{name}/rows": lengths.kept, f"data/{name}/overlong": lengths.over}, 0)
        get_run_logger().info(length_table(measured, {}, context_words(cfg)))
        for report in (r for r in reports if r["table"] == "prompts"):
            check_prompt_count(cfg, report["kept"], report["source"])
        tables = {r["table"]: r.pop("path") for r in reports}
        publish_table(
            "data-report",
            reports,
            "Validated tables: rows, token lengths (p50, p95, max) against the limit, rows over it and what was done",
        )
        prepared = PreparedData(
            tables=tables,
            fingerprints={r["table"]: r["fingerprint"] for r in reports},
            base_model=base_model,
            tokenizer=tokenizer_source,
            demo_world=str(world.root.resolve()) if world else None,
            reports=reports,
            inputs=dataset_inputs(cfg, reports),
            feedback_until=feedback_cutoffs(cfg, reports),
        )
        reporter.tag({"data_fingerprint": prepared.fingerprint})
        tracking.logs.log_datasets(run_id, prepared.inputs_for(*prepared.tables))
        return prepared
