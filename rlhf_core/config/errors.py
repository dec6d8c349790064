"""What a user did wrong, in one sentence: `UserError`, the base of every exception a user causes, and the
messages for configs that do not validate (which field, what it accepts, and for an unknown key the field
this config calls it, TRL's names, or the closest spelling).

Kept apart from the schema (the section modules of `rlhf_core.config`); every function takes the root section.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel


class UserError(ValueError):
    """Something a user wrote or supplied (a config, a file, a data row, a model source) that cannot run; the
    message is one sentence that says what to change. Any other exception is a bug. A ValueError, so that
    `except ValueError` around a check keeps catching it."""


# TRL's (and transformers') names for what this config calls otherwise: (section or None for any, key) -> our field.
# A section-specific entry wins over the general one; "{section}" stands for the section the key was written in.
TRL_NAMES: dict[tuple[str | None, str], str] = {
    (None, "max_completion_length"): "rl.response_length",
    (None, "max_new_tokens"): "rl.response_length",
    (None, "min_new_tokens"): "rl.min_response_length",
    (None, "reward_funcs"): "grpo.rewards",
    (None, "max_tool_calling_iterations"): "grpo.max_tool_calls",
    (None, "environment_factory"): "grpo.environment",
    (None, "reward_weights"): "grpo.rewards[].weight",
    (None, "reward_model_path"): "grpo.rewards[].model (GRPO) or reward.base",
    (None, "reward_model"): "grpo.rewards[].model (GRPO) or reward.base",
    (None, "logging_steps"): "rl.log_steps",
    ("sft", "logging_steps"): "sft.log_steps",
    ("reward", "logging_steps"): "reward.log_steps",
    (
        None,
        "per_device_train_batch_size",
    ): "rl.batch_size (completions per RL step, for GRPO TRL's per_device_train_batch_size x steps_per_generation)",
    (
        None,
        "generation_batch_size",
    ): "grpo.generation_batch_size or rl.batch_size (per process, TRL's is over all processes)",
    ("sft", "per_device_train_batch_size"): "sft.batch_size",
    ("reward", "per_device_train_batch_size"): "reward.batch_size",
    (None, "per_device_eval_batch_size"): "eval.batch_size",
    (None, "num_train_epochs"): "rl.total_steps (steps, not epochs)",
    ("sft", "num_train_epochs"): "sft.max_steps (steps, not epochs)",
    ("reward", "num_train_epochs"): "reward.max_steps (steps, not epochs)",
    (None, "max_steps"): "rl.total_steps",
    (None, "total_episodes"): "rl.total_steps (rollout batches, not episodes)",
    (None, "learning_rate"): "sft.learning_rate, reward.learning_rate or rl.learning_rate",
    ("grpo", "kl_coef"): "grpo.beta",
    ("ppo", "beta"): "ppo.kl_coef",
    ("grpo", "cliprange"): "grpo.epsilon",
    ("ppo", "epsilon"): "ppo.cliprange",
    (None, "max_prompt_length"): "data.max_prompt_length",
    (None, "max_length"): "data.max_length",
    (None, "stop_token_id"): "rl.stop_tokens (token texts such as '<|im_end|>', not ids)",
    (None, "eos_token"): "rl.stop_token",
    (None, "model_name_or_path"): "model.base",
    (None, "sft_model_path"): "model.base",
    (None, "dataset_name"): "data.preference.path or data.prompts.path",
    (None, "lr_scheduler_type"): "{section}.lr_scheduler",
    (None, "warmup_ratio"): "{section}.warmup_steps (steps, not a ratio)",
    (None, "bf16"): "run.mixed_precision: bf16",
    (None, "fp16"): "run.mixed_precision: fp16",
    (None, "use_peft"): "model.lora.enabled",
    (None, "lora_r"): "model.lora.r",
    (None, "lora_alpha"): "model.lora.alpha",
    (None, "lora_dropout"): "model.lora.dropout",
    (None, "lora_target_modules"): "model.lora.target_modules",
    (None, "log_completions"): "grpo.log_completions_steps",
    (None, "num_sample_generations"): "eval.every_steps",
    (None, "report_to"): "tracking.uri",
    (None, "run_name"): "run.name",
    (None, "torch_dtype"): "model.torch_dtype",
    (None, "dtype"): "model.torch_dtype",
}


# Fields this config had and replaced: (section or None for any, key) -> the sentence that says what to write now.
# "{section}" stands for the section the key was written in.
REPLACED_FIELDS: dict[tuple[str | None, str], str] = {
    (
        None,
        "skip_nonfinite_steps",
    ): "`{section}.skip_nonfinite_steps` was replaced by `{section}.max_nonfinite_steps_in_a_row`: "
    "0 stops at the first non-finite step, as false did",
    ("promote", "metric"): "`promote.metric` was replaced by `promote.evaluator`: a metric function is "
    "`promote.evaluator.metrics: ['module:function']`, the reward model `promote.evaluator.reward_model`",
    ("promote", "min_improvement"): "`promote.min_improvement` was replaced by `promote.min_win_rate`: the "
    "candidate must beat the champion prompt by prompt, with 95% confidence",
}


def nested_section(annotation) -> type[BaseModel] | None:
    """The section (a pydantic model) a field's annotation holds: itself, or inside `X | None` / `list[X]`."""
    found = [
        c
        for c in (annotation, *getattr(annotation, "__args__", ()))
        if isinstance(c, type) and issubclass(c, BaseModel)
    ]
    return found[0] if found else None


def field_paths(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Every field of every section, dotted -> its leaf name (sections included, e.g. `ppo`, `data.prompts`)."""
    out: dict[str, str] = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out[path] = name
        nested = nested_section(field.annotation)
        if nested is not None:
            inner = field.annotation is not nested and getattr(field.annotation, "__origin__", None) is list
            out.update(field_paths(nested, path + ("[]." if inner else ".")))
    return out


def unknown_key_hint(loc: tuple, root: type[BaseModel]) -> str | None:
    """For an unknown key: the field this config calls it (TRL's names), or the closest spelling."""
    import difflib

    key = str(loc[-1])
    parent_loc = loc[:-1]
    section = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parent_loc).lstrip(".")
    last_section = next((str(p) for p in reversed(parent_loc) if not isinstance(p, int)), None)
    replaced = REPLACED_FIELDS.get((last_section, key)) or REPLACED_FIELDS.get((None, key))
    if replaced:
        return replaced.replace("{section}", section or "rl")
    trl = TRL_NAMES.get((last_section, key)) or TRL_NAMES.get((None, key))
    if trl:
        target = trl.replace("{section}", section or "rl")
        if not target.startswith(f"{section}.{key}"):
            main, _, note = target.partition(" (")
            named = re.sub(r"\b([a-z_]+(?:\[\])?(?:\.[a-z_]+(?:\[\])?)+)", r"`\1`", main)
            return f"TRL's `{key}` is {named} here" + (f", {note.rstrip(')')}" if note else "")
    parent = section_at(parent_loc, root)
    fields = list(parent.model_fields) if parent else []
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{section + '.' if section else ''}{close[0]}`?"
    paths = field_paths(root)
    elsewhere = [p for p, leaf in paths.items() if leaf == key]
    if not elsewhere:
        near = set(difflib.get_close_matches(key, set(paths.values()), n=2, cutoff=0.75))
        elsewhere = [p for p, leaf in paths.items() if leaf in near]
    if elsewhere:
        return "did you mean " + " or ".join(f"`{p}`" for p in elsewhere[:3]) + "?"
    return None


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string (quote it in YAML)",
    "list_type": "a list",
    "model_type": "a mapping of fields",
    "dict_type": "a mapping of fields",
}


def _yaml_repr(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return repr(value)


def describe_error(err: dict[str, Any], root: type[BaseModel]) -> str:
    """One sentence for a pydantic error of a config validated as `root`, naming the field."""
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = section_at(err["loc"][:-1], root)
        allowed = ", ".join(parent.model_fields) if parent else "see docs/configuration.md"
        where = ".".join(str(p) for p in err["loc"][:-1]) or "the top level"
        hint = unknown_key_hint(tuple(err["loc"]), root)
        hint = f" ({hint})" if hint else ""
        return f"unknown config field `{loc}`{hint}; the fields allowed in {where} are: {allowed}"
    if kind in ("literal_error", "enum"):
        return f"config field `{loc}` got {err.get('input')!r}: {err['msg'].replace('Input should be', 'allowed values are')}"
    if kind == "value_error":
        msg = err["msg"].removeprefix("Value error, ")
        return f"config field `{loc}`: {msg}" if loc else f"config: {msg}"
    if kind in _TYPE_WORDS:
        value = err.get("input")
        kind_name = {"bool": "boolean", "int": "integer", "str": "string", "dict": "mapping"}.get(
            type(value).__name__, type(value).__name__
        )
        return (
            f"config field `{loc}` must be {_TYPE_WORDS[kind]}, but got {_yaml_repr(value)} "
            f"({'an' if kind_name[0] in 'aeiou' else 'a'} {kind_name})"
        )
    return f"config field `{loc}` got {err.get('input')!r}: {err['msg']}"


def section_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The section at a dotted location (list indices skipped), or None where the location is a value."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = nested_section(field.annotation)
        if model is None:
            return None
    return model
