"""Every row of the tables checked, and their token lengths measured against the limits, before training: by
`rlhf validate` and `rlhf run` here (`check_tables`, before the pipeline is imported), by the data stage for every
table.

All three load and validate a table and count its tokens the same way (`measure_table`: `load_table`, then
`apply_length_policy`, which applies data.overlong) and refuse a prompt set smaller than one RL step the same way
(`check_prompt_count`), so they refuse the same inputs. `check_tables` reads what it can without downloading or
writing anything: every row of a local file, measured when the tokenizer is a local directory and checked
without its lengths when it is the demo's (which the data stage builds); hub data sets and the demo world's own
tables are left to the data stage, the demo world's prompt count read from its config. The numbers printed come
from `rlhf_core.data.lengths`.
"""

from __future__ import annotations

from rlhf_core.config import DEMO, DatasetSpec, PipelineConfig
from rlhf_core.data.lengths import TableLengths, length_table
from rlhf_core.data.rows import DataValidationError, Kind
from rlhf_core.data.sources import looks_local
from rlhf_core.data.tables import apply_length_policy, count_checked_rows, load_table
from rlhf_core.models.loading import looks_like_path, model_tokenizer
from tasks.checks.preflight import model_context


def measure_table(
    cfg: PipelineConfig, tokenizer, name: str, field_name: str, spec: DatasetSpec, kind: Kind, resolved: str | None
):
    """Load and validate one table (`resolved` replaces a 'demo' path), measure its rows against their limit
    and apply data.overlong. -> (the rows kept, the table's lengths)"""
    ds = load_table(
        spec,
        kind,
        field=field_name,
        resolved_path=resolved,
        tokenizer=tokenizer,
        chat_template_kwargs=cfg.data.chat_template_kwargs,
    )
    return apply_length_policy(
        ds,
        kind,
        tokenizer,
        max_length=cfg.data.max_length,
        max_prompt_length=cfg.data.max_prompt_length,
        action=cfg.data.overlong,
        table=name,
    )


def context_words(cfg: PipelineConfig) -> str:
    """The policy's context length in words, with where it was read: what the length table ends with."""
    context, where = model_context(cfg)
    if context is None:
        return f"not readable offline from {where} (the limits are checked against it when the model loads)"
    return f"{context} tokens ({where}); data.max_prompt_length + rl.response_length = {cfg.data.max_prompt_length + cfg.rl.response_length}"


def check_prompt_count(cfg: PipelineConfig, usable: int, source: str) -> None:
    """Refuse, before SFT, a prompt set smaller than one RL step (PPO would index past it, GRPO train on less)."""
    needed, fields = cfg.prompts_per_step()
    if usable < needed:
        raise DataValidationError(
            f"data.prompts: {source} has {usable} usable prompts, fewer than the {needed} one RL step takes "
            f"({fields}); lower {fields.split()[0]} or add prompts"
        )


def _not_here(spec: DatasetSpec) -> str | None:
    """Why `check_tables` does not read a table here, or None when it does."""
    if spec.path == DEMO:
        return "the demo world is built by the data stage"
    if spec.feedback_experiment is not None:
        return "users' feedback in MLflow: the data stage reads it"
    if not looks_local(spec.path):
        return "a hub data set: the data stage downloads and measures it"
    return None


def local_tokenizer(cfg: PipelineConfig) -> tuple[object | None, str]:
    """(the policy's tokenizer when it is a local directory, else None; why it is not, else '')."""
    source = cfg.model.tokenizer or cfg.model.base
    if source == DEMO:
        return None, "the demo's tokenizer is built by the data stage"
    if source.startswith("models:/") or not looks_like_path(source):
        return None, f"the tokenizer {source} is not a local directory"
    return model_tokenizer(cfg.model, source), ""


def check_tables(cfg: PipelineConfig) -> str:
    """Every row of every local table checked as the data stage checks it (the first bad row raises its
    DataValidationError, one sentence), and the prompt count against one RL step (the demo world's from its
    config); -> the token-length table `rlhf validate` prints. Nothing is downloaded or written. Without a local
    tokenizer the rows are checked but not measured, and the table says why."""
    tables = cfg.data_tables()
    skipped = {name: why for name, _, spec, _ in tables if (why := _not_here(spec))}
    if len(skipped) < len(tables):  # a local table to read (a config of the demo world's answers without datasets)
        import datasets

        datasets.disable_progress_bars()  # a bar per table read would bury the table printed after them
    tokenizer, no_tokenizer = local_tokenizer(cfg)
    measured: list[TableLengths] = []
    usable: dict[str, int] = {}
    for name, field_name, spec, kind in tables:
        if name in skipped:
            continue
        if tokenizer is None:
            skipped[name] = f"rows checked, not measured: {no_tokenizer}"
            usable[name] = count_checked_rows(spec, kind, field=field_name)
        else:
            measured.append(measure_table(cfg, tokenizer, name, field_name, spec, kind, None)[1])
            usable[name] = measured[-1].kept
    prompts = cfg.data.prompts
    if "prompts" in usable:
        check_prompt_count(cfg, usable["prompts"], prompts.path)
    elif prompts.path == DEMO:
        most, field = cfg.data.demo.prompt_rows(prompts)
        check_prompt_count(cfg, most, f"the demo world ({field})")
    return length_table(measured, skipped, context_words(cfg))
