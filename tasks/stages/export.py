"""The `export` stage: the final policy as a directory `from_pretrained` loads, registered with the alias
`candidate`."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import GROUP_ALGORITHMS, PipelineConfig, section_of
from rlhf_core.config.rewards import GROUP_FIELDS_FOR
from rlhf_core.evaluation.promotion import alignment_markdown
from rlhf_core.models.card import card_field, card_license, source_name
from rlhf_core.models.export import ExportInfo, export_policy, generation_settings
from rlhf_core.models.loading import generation_config_of, load_tokenizer, run_stop_ids
from tasks import registry, tracking
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.progress import publish_markdown
from tasks.reporting.reporter import StageReporter
from tasks.runtime.retry import IO_RETRIES
from tasks.stage_io import Checkpoint
from tasks.stages.data import PreparedData
from tasks.stages.initialization import InitPlan

CANDIDATE = "candidate"


def export_info(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, trained: Checkpoint) -> ExportInfo:
    algorithm = cfg.rl.algorithm
    section = section_of(algorithm)
    settings = {"ppo": cfg.ppo, "grpo": cfg.grpo, "dpo": cfg.dpo}[section]
    skipped = {k for k, algorithms in GROUP_FIELDS_FOR.items() if algorithm not in algorithms}
    hyper = {
        f"rl.{k}": getattr(cfg.rl, k)
        for k in ("total_steps", "batch_size", "learning_rate", "response_length", "temperature")
    }
    hyper.update(
        {
            f"{section}.{k}": v
            for k, v in settings.model_dump(mode="json").items()
            if not isinstance(v, (list, dict)) and (section != "grpo" or k not in skipped)
        }
    )
    if cfg.model.lora.enabled:
        hyper.update({"lora.r": cfg.model.lora.r, "lora.alpha": cfg.model.lora.alpha})
    specs = {"preference": cfg.data.preference, "prompts": cfg.data.prompts}
    tables = ("preference",) if algorithm == "dpo" else ("preference", "prompts") if plan.reward_path else ("prompts",)
    return ExportInfo(
        algorithm=algorithm,
        steps=trained.step,
        base_model=root_base_name(cfg, data),
        reward_model=plan.reward_identity,
        datasets=list(dict.fromkeys(source_name(specs[t].path) for t in tables)),
        eval_metrics=trained.extra.get("final_eval", {}),
        hyperparameters=hyper,
        model_name=cfg.registry.policy_model_name,
        policy_start=plan.policy_identity,
        source_checkpoint=trained.model_uri or trained.path,
        license=cfg.export.license or base_license(cfg, data),
        eval_dataset=source_name(cfg.data.eval_prompts.path),
        tools=trained_tools(cfg),
    )


def trained_tools(cfg: PipelineConfig) -> list[str]:
    """The import paths of the tools and environments the policy's rollouts called (the GRPO family's alone)."""
    if cfg.rl.algorithm not in GROUP_ALGORITHMS:
        return []
    environment = cfg.grpo.environment
    environments = list(environment.values()) if isinstance(environment, dict) else [environment] if environment else []
    return [*cfg.grpo.tools, *environments]


def root_base_name(cfg: PipelineConfig, data: PreparedData) -> str:
    """The card's `base_model`: model.base's hub id, a local base's directory name, "demo" for the demo world;
    for a registered version (models:/name/v), the base its own card names, else the registered model's name."""
    base = cfg.model.base
    if base.startswith("models:/"):
        named = card_field(data.base_model, "base_model")
        if named and not named.startswith("models:/") and not Path(named).is_absolute():
            return named
        return base.removeprefix("models:/").split("/")[0].split("@")[0]
    return source_name(base)


def base_license(cfg: PipelineConfig, data: PreparedData) -> str | None:
    """The base model card's license: the local base's README.md, or a hub base's card in the local hub cache."""
    if Path(data.base_model).is_dir():
        return card_license(data.base_model)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(cfg.model.base, "README.md", revision=cfg.model.revision)
    except Exception:  # not a repo id: no hub card to read
        return None
    return card_license(Path(cached).parent) if isinstance(cached, str) else None


def base_generation_defaults(cfg: PipelineConfig, data: PreparedData) -> dict | None:
    """What the base model's own generation_config sets (None for the demo world's base, which sets no
    sampling defaults): the exported policy generates the way its base does by default."""
    if cfg.model.base == "demo":
        return None
    return generation_config_of(data.base_model, trust_remote_code=cfg.model.trust_remote_code).to_diff_dict()


def write_export(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, trained: Checkpoint) -> Path:
    """The export directory from the last RL checkpoint, with the run's stop tokens and the base model's
    generation defaults (never the RL sampling settings)."""
    tokenizer = load_tokenizer(trained.path)
    stops = run_stop_ids(tokenizer, generation_config_of(trained.path), cfg.rl)
    generation = generation_settings(
        tokenizer=tokenizer,
        max_new_tokens=cfg.rl.response_length,
        stop_token_ids=stops,
        base_defaults=base_generation_defaults(cfg, data),
    )
    export_policy(
        trained.path,
        cfg.export_dir,
        export_info(cfg, data, plan, trained),
        generation=generation,
        merge=cfg.export.merge,
    )
    return cfg.export_dir


def guard_tags(trained: Checkpoint) -> dict[str, str]:
    """The guard's verdict on the exported checkpoint, as version tags promotion reads: `guard.passed`, and
    `guard.broken` (the rules, comma-separated) only when it broke any."""
    broken = trained.extra.get("guard_broken", [])
    return {"guard.passed": str(not broken).lower(), **({"guard.broken": ",".join(broken)} if broken else {})}


def promotion_blocked(trained: Checkpoint) -> str | None:
    """One plain sentence when the exported checkpoint broke a guard rule: promotion refuses such a candidate (it
    reads the version's guard.broken tag), so whatever shows the alias says so. None when it passed."""
    broken = trained.extra.get("guard_broken", [])
    if not broken:
        return None
    rules = f"rule{'s' if len(broken) > 1 else ''} {', '.join(broken)}"
    return (
        f"Cannot be promoted: this checkpoint broke the guard {rules} at its evaluation during training "
        "(tag guard.broken), and promotion refuses a candidate that broke any."
    )


def version_description(cfg: PipelineConfig, plan: InitPlan, trained: Checkpoint) -> str:
    """The candidate version's description, its first line plain text (the version list shows it raw): that it
    cannot be promoted when it broke a guard rule (`promotion_blocked`); what was trained and which checkpoint
    export.select picked; the before/after table and the guard's verdict; its algorithm, source checkpoint and reward
    model, the config hash and code version."""
    history = {int(k): v for k, v in trained.extra.get("eval_history", {}).items()}
    table = alignment_markdown(history, trained.step, cfg.gold_metric(), trained.extra.get("guard_triggers", []))
    rollbacks = trained.extra.get("rollbacks", 0)
    head = (
        f"{cfg.rl.algorithm.upper()} policy of run {cfg.run_label()}, exported at step {trained.step} "
        f"(export.select {trained.extra.get('selected', 'last')}), {rollbacks} guard rollback(s)."
    )
    reward = plan.lineage.get("reward_model_version")
    details = [  # the table holds the evaluation (the exact KL among it); these its tags leave out
        f"- algorithm: `{cfg.rl.algorithm}`",
        f"- source checkpoint: `{trained.model_uri or trained.path}`",
        f"- reward model: `{reward}`" if reward else "- reward model: none",
        f"- config hash: `{cfg.config_hash()}`",
        f"- code version: `{tracking.runs.code_version()}`",
    ]
    parts = (promotion_blocked(trained), head, table, "\n".join(details))
    return "\n\n".join(part for part in parts if part)


def publish_candidate(reporter: StageReporter, out: Path, uri: str, blocked: str | None) -> None:
    """Point `candidate` at the exported version and say where it is, and that it cannot be promoted when the
    guard says so (`promotion_blocked`)."""
    reporter.alias(CANDIDATE, uri)
    reporter.logger.info("%s is %s, alias %s", out, uri, CANDIDATE)
    if blocked:
        reporter.logger.warning("%s: %s", uri, blocked)
    name = reporter.cfg.registry.policy_model_name
    lines = [
        "# Exported policy",
        "",
        *([blocked, ""] if blocked else []),
        f"- directory: `{out.resolve()}`",
        f"- model version: `{uri}` (alias `{CANDIDATE}`: `models:/{name}@{CANDIDATE}`)",
        f'- load: `AutoModelForCausalLM.from_pretrained("{out.resolve()}")`',
    ]
    publish_markdown("policy-export", "\n".join(lines) + "\n", "The exported final policy")


@task(name="export", cache_policy=NO_CACHE, **IO_RETRIES)
def export_stage(
    cfg: PipelineConfig, data: PreparedData, plan: InitPlan, trained: Checkpoint, parent_run_id: str
) -> Checkpoint:
    """Write <export dir> from the RL checkpoint export.select picked, register it as a version (tagged with its
    lineage and the guard's verdict; `version_description` says the rest), point `candidate` at it."""
    with tracking.runs.stage_run(parent_run_id, "export", tracking.runs.stage_params(cfg, "export")) as run_id:
        with StageReporter(
            StageIdentity(cfg, "export", run_id, trained.key, data.fingerprint),
            model=RegisteredModel(cfg.registry.policy_model_name, lineage=plan.lineage),
        ) as reporter:
            out = write_export(cfg, data, plan, trained)
            reporter.artifact(out / "README.md", "model_card")
            reporter.logger.info(
                "exported the %s policy (step %d) to %s", cfg.rl.algorithm, trained.step, out.resolve()
            )
            # an adapter-only export has no full weights to log; the checkpoint it came from has them merged
            full = out if (out / "config.json").is_file() else Path(trained.path)
            final = trained.extra.get("final_eval", {})
            reporter.log(final, trained.step)  # the export run's metrics, which its logged model then carries
            uri = reporter.register(full, trained.step, **guard_tags(trained))
            if uri is not None:
                registry.describe_version(uri, version_description(cfg, plan, trained))
                tracking.logs.link_model(parent_run_id, uri, trained.step)
                publish_candidate(reporter, out, uri, promotion_blocked(trained))
                # the feedback windows it trained on end here: the next `since: last_training` starts after them
                tracking.feedback.record_cutoffs(cfg.registry.policy_model_name, data.feedback_until)
        return Checkpoint(
            path=str(out.resolve()),
            model_uri=uri,
            step=trained.step,
            metrics=trained.metrics,
            key=trained.key,
            extra={"source": trained.path},
        )
