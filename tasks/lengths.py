"""The tables' token lengths against the limits, measured before training: by `rlhf validate` here, by the data
stage for every table.

Both load and validate a table and count its tokens the same way (`measure_table`: `load_table`, then
`apply_length_policy`, which applies data.overlong); `rlhf validate` reads what it can without downloading or
writing anything (local files with a local tokenizer) and names what it leaves to the data stage (hub data sets,
the demo world, a tokenizer on the hub). The numbers printed come from `rlhf_core.data.lengths`.
"""

from __future__ import annotations

from rlhf_core.config import DEMO, DatasetSpec, PipelineConfig
from rlhf_core.data.lengths import TableLengths, length_table
from rlhf_core.data.rows import Kind
from rlhf_core.data.sources import looks_local
from rlhf_core.data.tables import apply_length_policy, load_table
from rlhf_core.models.loading import load_tokenizer, looks_like_path
from tasks.preflight import model_context


def stage_tokenizer(cfg: PipelineConfig, source: str):
    """A stage's tokenizer from `source` with the model.* loading options and model.chat_template (saved with
    every checkpoint, so the export carries it)."""
    return load_tokenizer(
        source,
        revision=cfg.model.revision,
        trust_remote_code=cfg.model.trust_remote_code,
        chat_template=cfg.model.chat_template,
    )


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


def _not_here(cfg: PipelineConfig, spec: DatasetSpec) -> str | None:
    """Why `rlhf validate` does not measure a table here, or None when it does."""
    if spec.path == DEMO:
        return "the demo world is built by the data stage"
    if not looks_local(spec.path):
        return "a hub data set: the data stage downloads and measures it"
    return None


def validate_lengths(cfg: PipelineConfig) -> str:
    """The token-length table `rlhf validate` prints: every local table measured with a local tokenizer, the rest
    named with the reason; nothing is downloaded or written. A table that cannot be read raises what the data
    stage would (DataValidationError, one sentence)."""
    source = cfg.model.tokenizer or cfg.model.base
    skipped: dict[str, str] = {}
    measured: list[TableLengths] = []
    tokenizer = None
    if source == DEMO or source.startswith("models:/") or not looks_like_path(source):
        why = (
            "the demo's tokenizer is built by the data stage"
            if source == DEMO
            else f"the tokenizer {source} is not a local directory"
        )
        skipped = {name: why for name, *_ in cfg.data_tables()}
    else:
        import datasets

        datasets.disable_progress_bars()  # a bar per table read would bury the table printed after them
        tokenizer = stage_tokenizer(cfg, source)
    for name, field_name, spec, kind in cfg.data_tables() if tokenizer is not None else []:
        why = _not_here(cfg, spec)
        if why:
            skipped[name] = why
            continue
        measured.append(measure_table(cfg, tokenizer, name, field_name, spec, kind, None)[1])
    return length_table(measured, skipped, context_words(cfg))
