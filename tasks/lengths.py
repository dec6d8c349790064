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
from rlhf_core.models.loading import looks_like_path, model_tokenizer
from tasks.preflight import model_context


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


def _not_here(spec: DatasetSpec) -> str | None:
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
    if source == DEMO or source.startswith("models:/") or not looks_like_path(source):
        why = "the demo's tokenizer is built by the data stage" if source == DEMO else None
        why = why or f"the tokenizer {source} is not a local directory"
        return length_table([], {name: why for name, *_ in cfg.data_tables()}, context_words(cfg))
    import datasets

    datasets.disable_progress_bars()  # a bar per table read would bury the table printed after them
    tokenizer = model_tokenizer(cfg.model, source)
    skipped: dict[str, str] = {}
    measured: list[TableLengths] = []
    for name, field_name, spec, kind in cfg.data_tables():
        if why := _not_here(spec):
            skipped[name] = why
        else:
            measured.append(measure_table(cfg, tokenizer, name, field_name, spec, kind, None)[1])
    return length_table(measured, skipped, context_words(cfg))
