"""Everything that can be checked without training, checked before the first stage starts.

`preflight_problems(cfg)` returns the problems it finds, each one sentence naming the config field;
`check_preflight(cfg)` raises the first (as :class:`PreflightError` or what the stage that would have met it
raises). `rlhf validate` and the pipeline flow call it right after the config is loaded, so a wrong reward
function or tool, a missing data file, a model that cannot hold prompt + response, an unreachable tracking
server or a bad registry name stops the run before the demo world is built, SFT and reward training.

This module stays light (no prefect, mlflow or torch imports): `rlhf validate` runs it in a second.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from rlhf_core.config import DEMO, GROUP_ALGORITHMS, DatasetSpec, PipelineConfig, reads_grpo_rewards
from rlhf_core.config.errors import UserError
from rlhf_core.config.redaction import redact
from rlhf_core.data.rows import DataValidationError, Kind, check_first_rows, is_conversational_table
from rlhf_core.data.sources import FILE_READ_ERRORS, files_of, first_rows, is_saved_dataset, looks_local
from rlhf_core.models.loading import ModelSourceError, check_source, looks_like_path
from rlhf_core.rewards.functions import RewardFunctionError, load_function
from rlhf_core.rollout.tools import ToolError, load_tool_use
from rlhf_core.rollout.vllm_server import head_size, server_problems
from tasks.checks import reward_urls

TRACKING_TIMEOUT_S = 10.0
FIRST_ROWS = 5
HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
MODELS_URI = re.compile(r"models:/[^/@\s]+(/\d+|@[A-Za-z0-9_-]+)")


class PreflightError(UserError):
    """A config that validates but cannot run (an unreachable server, a bad registry name...); one sentence."""


class Problem(str):
    """One problem's sentence, remembering the error class `check_preflight` raises it as."""

    kind: type[ValueError] = PreflightError

    @classmethod
    def of(cls, kind: type[ValueError], message: str) -> Problem:
        problem = cls(message)
        problem.kind = kind
        return problem


def check_preflight(cfg: PipelineConfig) -> None:
    """Raise the first problem `preflight_problems` finds (and say how many more there are).

    It is raised as what the stage that would have met it raises: RewardFunctionError for functions,
    DataValidationError for data, ModelSourceError for model sources, else PreflightError; all of
    them are ValueErrors with a one-sentence message.
    """
    problems = preflight_problems(cfg)
    if problems:
        more = len(problems) - 1
        kind = getattr(problems[0], "kind", PreflightError)
        raise kind(
            problems[0]
            + (f" (and {more} more problem{'s' if more > 1 else ''}; `rlhf validate` checks them all)" if more else "")
        )


def preflight_problems(cfg: PipelineConfig) -> list[str]:
    """Every problem found without training, one sentence each; an empty list means go."""
    problems: list[str] = []
    for check_one, kind in (
        (_check_functions, RewardFunctionError),
        (_check_data, DataValidationError),
        (_check_models, ModelSourceError),
        (_check_context, PreflightError),
        (_check_rollout_engine, PreflightError),
        (_check_tools, PreflightError),
        (reward_urls.preflight_problems, PreflightError),  # served rewards answer a first request
        (_check_tracking, PreflightError),
        (_check_output, PreflightError),
        (_check_registry, PreflightError),
    ):
        problems += [Problem.of(kind, p) for p in check_one(cfg)]
    return problems


# ----------------------------- reward and metric functions, tools -----------------------------


def _signature_problem(fn: Callable, *, needs_kwargs: bool) -> str | None:
    """Why fn(prompts=[...], completions=[...], **columns) cannot be called, else None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: give them the benefit of the doubt
        return None
    params = sig.parameters.values()
    if needs_kwargs and not any(p.kind is p.VAR_KEYWORD for p in params):
        return "it takes no **kwargs, which receive the prompt table's other columns"
    try:
        sig.bind(prompts=[], completions=[])
    except TypeError as err:
        return str(err)
    return None


def _check_functions(cfg: PipelineConfig) -> list[str]:
    specs: list[tuple[str, str, bool]] = []
    if reads_grpo_rewards(cfg.rl.algorithm):  # the GRPO family and online DPO read grpo.rewards
        specs += [
            (f"grpo.rewards[{i}].function", r.function, True) for i, r in enumerate(cfg.grpo.rewards) if r.function
        ]
    specs += [("eval.metrics", spec, False) for spec in cfg.eval.metrics]
    problems = []
    for field, spec, needs_kwargs in specs:
        try:
            fn = load_function(spec, field=field)
        except RewardFunctionError as err:
            problems.append(str(err))
            continue
        why = _signature_problem(fn, needs_kwargs=needs_kwargs)
        if why:
            call = "fn(prompts=..., completions=..., **kwargs)" if needs_kwargs else "fn(prompts=..., completions=...)"
            problems.append(f"{field}: '{spec}' cannot be called as {call} ({why})")
    return problems


def _check_tools(cfg: PipelineConfig) -> list[str]:
    """grpo.tools and grpo.environment import (their chat template is checked where the data stage loads the
    tokenizer, before any training)."""
    if cfg.rl.algorithm not in GROUP_ALGORITHMS or not cfg.grpo.uses_tools:
        return []
    try:
        load_tool_use(cfg.grpo)
    except ToolError as err:
        return [str(err)]
    plain = [f for _, f, spec, kind in cfg.data_tables() if kind == "prompt" and _plain_prompts(cfg, f, spec)]
    why = "grpo.tools needs conversational ones (lists of messages) for the chat template to write the tool turns after"
    return [f"{field} holds plain-text prompts, and {why}" for field in plain]


def _plain_prompts(cfg: PipelineConfig, field: str, spec: DatasetSpec) -> bool:
    if spec.path == DEMO:
        return cfg.data.demo.world == "arithmetic"
    if not looks_local(spec.path) or spec.format == "conversational":
        return False
    problem, conversational = _check_table(field, spec, "prompt")
    return problem is None and not conversational


# ----------------------------- data: the files exist and their first rows have the mapped columns -----------------------------


def tables_to_check(cfg: PipelineConfig) -> list[tuple[str, DatasetSpec, Kind]]:
    """(config field, spec, kind) of every table the pipeline reads (`PipelineConfig.data_tables`)."""
    return [(field, spec, kind) for _, field, spec, kind in cfg.data_tables()]


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _check_table(field: str, spec: DatasetSpec, kind: Kind) -> tuple[str | None, bool]:
    """(the table's first problem or None, whether it is conversational as far as can be seen offline)."""
    path, conversational = spec.path, spec.format == "conversational"
    if path == DEMO:
        return None, False  # the demo world's tokenizer has its chat template
    if spec.feedback_experiment is not None:
        return None, False  # the served policy's rendered prompts: the data stage reads the tracking server
    if not looks_local(path):
        if not HUB_NAME.fullmatch(path) or ".." in path or "--" in path:
            return (
                f"{field}.path: '{path}' is neither an existing local file nor a hub dataset name such as 'owner/dataset'",
                False,
            )
        return None, conversational  # a hub dataset: only the data stage can reach the hub
    local = Path(path).expanduser()
    if is_saved_dataset(local):
        return None, conversational  # a save_to_disk directory: the data stage reads and checks it with `datasets`
    try:
        fmt, files = files_of(path, field)
    except DataValidationError as err:
        return str(err), False
    except OSError as err:  # a directory that cannot be listed
        return f"{field}.path: {local} could not be read ({_first_line(err)})", False
    try:
        rows = first_rows(fmt, files[0], FIRST_ROWS)
    except DataValidationError as err:
        return str(err), False
    except FILE_READ_ERRORS as err:
        return f"{field}.path: {files[0]} could not be read as {fmt} ({_first_line(err)})", False
    problem = check_first_rows(rows, kind, spec, source=files[0], field=field, file_fmt=fmt)
    return problem, problem is None and is_conversational_table(rows, kind, spec)


def local_chat_template(directory: Path) -> bool:
    """Whether the tokenizer files in `directory` carry a chat template (read from the files: no transformers)."""
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _chat_template_problem(cfg: PipelineConfig, field: str) -> str | None:
    """Conversational data needs a chat template: model.chat_template, or one in a local tokenizer directory.
    (A hub or models:/ tokenizer is checked by the data stage, which loads it.)"""
    source = cfg.model.tokenizer or cfg.model.base
    if cfg.model.chat_template or source == DEMO or source.startswith("models:/") or not looks_like_path(source):
        return None
    directory = Path(source).expanduser()
    if not directory.is_dir() or local_chat_template(directory):
        return None
    which = "model.tokenizer" if cfg.model.tokenizer else "model.base"
    return (
        f"{field} is conversational (lists of messages) but the tokenizer of {which} ({directory.name}) has no "
        "chat template; set model.chat_template to a template file or string"
    )


def _check_data(cfg: PipelineConfig) -> list[str]:
    checked = [(field, *_check_table(field, spec, kind)) for field, spec, kind in tables_to_check(cfg)]
    problems = [problem for _, problem, _ in checked if problem]
    conversational = [field for field, _, conv in checked if conv]
    template = _chat_template_problem(cfg, conversational[0]) if conversational else None
    return problems + ([template] if template else [])


# ----------------------------- models and tokenizers, and the context length -----------------------------


def _source_problem(source: str, field: str) -> str | None:
    if source.startswith("models:/"):
        if not MODELS_URI.fullmatch(source):
            return f"{field}: '{source}' must look like models:/<name>/<version> or models:/<name>@<alias>"
        return None
    try:
        check_source(source, field)
    except ModelSourceError as err:
        return str(err)
    if not looks_like_path(source) and (not HUB_NAME.fullmatch(source) or ".." in source or "--" in source):
        return (
            f"{field}: '{source}' is neither an existing local directory nor a hub model name such as "
            "'Qwen/Qwen2.5-0.5B'"
        )
    return None


def _check_models(cfg: PipelineConfig) -> list[str]:
    sources = [("model.base", cfg.model.base)]
    if cfg.model.tokenizer is not None:
        sources.append(("model.tokenizer", cfg.model.tokenizer))
    if cfg.reward.base != "policy":
        sources.append(("reward.base", cfg.reward.base))
    if reads_grpo_rewards(cfg.rl.algorithm):  # the GRPO family and online DPO read grpo.rewards
        sources += [
            (f"grpo.rewards[{i}].model", r.model)
            for i, r in enumerate(cfg.grpo.rewards)
            if r.model is not None and r.model != "reward_stage"
        ]
    return [p for p in (_source_problem(source, field) for field, source in sources if source != DEMO) if p]


def model_context(cfg: PipelineConfig) -> tuple[int | None, str]:
    """(the base policy's context length, where it comes from); None when it cannot be read offline."""
    if cfg.model.base == DEMO:
        return cfg.model.demo.max_position_embeddings, "model.demo.max_position_embeddings"
    if looks_like_path(cfg.model.base):
        config = Path(cfg.model.base).expanduser() / "config.json"
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            return None, str(config)
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = data.get(key) if isinstance(data, dict) else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value, f"{key} in {config}"
    return None, cfg.model.base


def _check_context(cfg: PipelineConfig) -> list[str]:
    """The limits against the policy's context: a prompt and its completion, and data.max_length."""
    (context, where), needed, problems = model_context(cfg), cfg.data.max_prompt_length + cfg.rl.response_length, []
    if context is not None and needed > context:
        problems.append(
            f"data.max_prompt_length {cfg.data.max_prompt_length} + rl.response_length {cfg.rl.response_length} = "
            f"{needed} tokens exceeds the policy's context of {context} ({where})"
        )
    if context is not None and cfg.data.max_length > context:
        problems.append(f"data.max_length {cfg.data.max_length} exceeds the policy's context of {context} ({where})")
    return problems


def _check_rollout_engine(cfg: PipelineConfig) -> list[str]:
    """rollout.engine vllm with a server to start: its environment, the policy's head size, the port."""
    v, base = cfg.rollout.vllm, cfg.model.base
    if cfg.rollout.engine != "vllm" or v.url is not None:
        return []
    head = None
    if base == DEMO:
        head = (cfg.model.demo.hidden_size // cfg.model.demo.num_attention_heads, "the demo model (model.demo)")
    elif looks_like_path(base) and (Path(base).expanduser() / "config.json").is_file():
        head = (head_size(Path(base).expanduser()), f"the model in {base} (model.base)")
    return server_problems(v.interpreter(), head, v.host, v.port)


# ----------------------------- tracking server and registry names -----------------------------


def _strip_userinfo(uri: str) -> str:
    return re.sub(r"//[^/@\s]*@", "//", uri)


def _check_tracking(cfg: PipelineConfig) -> list[str]:
    uri = cfg.tracking_uri()
    field = (
        "tracking.uri"
        if cfg.tracking.uri
        else ("MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking.uri")
    )
    if uri.startswith(("http://", "https://")):
        url = _strip_userinfo(uri).rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=TRACKING_TIMEOUT_S):
                return []
        except urllib.error.HTTPError as err:
            if err.code < 500:  # it answered (a proxy may want credentials for /health): reachable
                return []
            reason = f"HTTP {err.code}"
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = str(getattr(err, "reason", err)) or type(err).__name__
        return [
            f"{field}: the tracking server {redact(uri)} does not answer (GET /health, "
            f"{TRACKING_TIMEOUT_S:.0f} s timeout: {reason}); start it or fix the URI"
        ]
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///")).expanduser()
        parent = db.parent
        if not parent.is_dir():
            return [f"{field}: the directory {parent} of the SQLite store {db} does not exist"]
        if not os.access(parent, os.W_OK) or (db.exists() and not os.access(db, os.W_OK)):
            return [f"{field}: the SQLite store {db} is not writable here"]
    return []


def _writable_problem(field: str, directory: Path) -> str | None:
    """Why `directory` (which need not exist yet) cannot be created and written here, else None: its nearest
    existing ancestor must be a directory that takes a file (tried with a temporary one, removed at once)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{field}: {existing} is a file, so {directory} cannot be a directory under it"
    try:
        fd, probe = tempfile.mkstemp(prefix=".rlhf-write-check-", dir=existing)
    except OSError as err:
        return f"{field}: {directory} cannot be written here ({existing}: {err.strerror or type(err).__name__})"
    os.close(fd)
    os.unlink(probe)
    return None


def _check_output(cfg: PipelineConfig) -> list[str]:
    fields = [("run.output_dir", cfg.run.output_dir)]
    if cfg.export.output_dir is not None:
        fields.append(("export.output_dir", cfg.export.output_dir))
    return [p for p in (_writable_problem(f, Path(d).expanduser().absolute()) for f, d in fields) if p]


def registry_name_problem(field: str, name: str) -> str | None:
    """Why `name` cannot be a registered model's name (models:/<name>/<version> must parse), else None."""
    if not name.strip():
        return f"{field} is empty; give the registered model a name"
    bad = [c for c in ("/", ":", "@") if c in name]
    if bad:
        return f"{field} '{name}' contains '{bad[0]}', which models:/ URIs cannot hold; use letters, digits, '-', '_' or '.'"
    if name != name.strip():
        return f"{field} '{name}' starts or ends with whitespace"
    return None


def _check_registry(cfg: PipelineConfig) -> list[str]:
    names = [
        ("registry.reward_model_name", cfg.registry.reward_model_name),
        ("registry.policy_model_name", cfg.registry.policy_model_name),
    ]
    problems = [p for p in (registry_name_problem(f, n) for f, n in names) if p]
    if not problems and names[0][1] == names[1][1]:
        problems.append(
            f"registry.reward_model_name and registry.policy_model_name are both '{names[0][1]}'; "
            "reward models and policies need their own registered models"
        )
    return problems
