"""Reading a config: YAML file, `--set a.b=value` overrides, validation into a `PipelineConfig`; the settings that
moved to another section (`MOVED_FIELDS`) read under their old names, which the run names once."""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlhf_core.config.base import ConfigError
from rlhf_core.config.errors import describe_error
from rlhf_core.config.pipeline import PipelineConfig


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: `5e-4`, `1e3` and `.5` are numbers, as people write them
    (YAML 1.1's resolver wants a dot and a signed exponent, so `5e-4` was the string '5e-4')."""


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_yaml(text: str) -> Any:
    """YAML text as the config reads it (safe, with YAML 1.2's floats)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def parse_override(text: str) -> tuple[list[str], Any]:
    """`ppo.kl_coef=0.1` -> (['ppo', 'kl_coef'], 0.1); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' must look like section.field=value, e.g. ppo.kl_coef=0.1")
    try:
        value = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{text}' has a value that is not valid YAML ({err.__class__.__name__})") from None
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b=value` override set (unknown keys are caught by validation)."""
    patched = json.loads(json.dumps(raw, default=str))
    for text in overrides:
        path, value = parse_override(text)
        node = patched
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': `{'.'.join(path[: i + 1])}` is a value, not a section")
            node = child
        node[path[-1]] = value
    return patched


def validate_config(raw: dict[str, Any]) -> PipelineConfig:
    """Validate a raw mapping into a PipelineConfig, or raise ConfigError naming the first bad field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_error(exc.errors()[0], PipelineConfig)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config (or the defaults with no path), apply overrides, validate. Settings that moved
    (`MOVED_FIELDS`) are read under their old names too, said once (`tell_moved`)."""
    raw = read_config_file(path)
    overrides = list(overrides or [])
    moved = moved_fields(raw, f"config file {path}")
    overrides, moved_by_set = moved_overrides(overrides)
    raw = apply_overrides(raw, overrides)
    tell_moved(moved, str(path))
    tell_moved(moved_by_set + moved_fields(raw, "the --set overrides"), "your --set overrides")
    return validate_config(raw)


def read_config_file(path: str | Path | None) -> dict[str, Any]:
    """The sections a YAML config file holds ({} with no path), or a ConfigError naming what is wrong with it."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = read_yaml(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file {path} is not valid YAML{where}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, not a {type(raw).__name__}")
    return raw


# settings that moved to the section where they apply: old path -> new path. A config (or an older run's resolved
# dump) that names an old path is read as the new one, and the run says so once.
MOVED_FIELDS = {
    "rollout.vllm.correction": "rollout.correction.mode",
    "rollout.vllm.correction_cap": "rollout.correction.cap",
    "rollout.vllm.correction_min": "rollout.correction.min",
    "rl.dynamic_sampling": "grpo.dynamic_sampling",
}


def _section(raw: dict[str, Any], parts: list[str], create: bool = False) -> dict[str, Any] | None:
    node: Any = raw
    for part in parts:
        node = node.setdefault(part, {}) if create else node.get(part)
        if not isinstance(node, dict):
            return None  # absent, or a value where a section goes (validation names it)
    return node


def moved_fields(raw: dict[str, Any], where: str) -> list[str]:
    """Move each old path `raw` holds to its new one, in place; -> the old paths moved. Both set: a ConfigError."""
    moved = []
    for old, new in MOVED_FIELDS.items():
        (*old_parents, old_key), (*new_parents, new_key) = old.split("."), new.split(".")
        source = _section(raw, old_parents)
        if source is None or old_key not in source:
            continue
        target = _section(raw, new_parents, create=True)
        if target is None:
            continue
        if new_key in target:
            raise ConfigError(
                f"{old} and {new} are both set in {where}; {old} is the old name of {new}: keep only {new}"
            )
        target[new_key] = source.pop(old_key)
        moved.append(old)
    return moved


def moved_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """The overrides with each old path renamed (`rl.dynamic_sampling.enabled=true` ->
    `grpo.dynamic_sampling.enabled=true`), and the old paths they named; both names of one setting: a ConfigError."""
    keys = [text.partition("=")[0].strip() for text in overrides]
    renamed, moved = [], []
    for text, key in zip(overrides, keys, strict=True):
        old = next((o for o in MOVED_FIELDS if _under(key, o)), None)
        _, sep, value = text.partition("=")
        if old is None or not sep:  # not moved, or not an override at all (parse_override names it)
            renamed.append(text)
            continue
        new = MOVED_FIELDS[old]
        if any(_under(k, new) for k in keys):
            raise ConfigError(
                f"{old} and {new} are both set in the --set overrides; {old} is the old name of {new}: keep only {new}"
            )
        renamed.append(f"{new}{key[len(old) :]}={value}")
        moved.append(old)
    return renamed, moved


def _under(key: str, path: str) -> bool:
    return key == path or key.startswith(f"{path}.")


def tell_moved(old_paths: list[str], where: str) -> None:
    """The one sentence that names the old paths a config used and their new ones; said once per process."""
    if not old_paths:
        return
    pairs = ", ".join(f"{old} is now {MOVED_FIELDS[old]}" for old in dict.fromkeys(old_paths))
    one = len(set(old_paths)) == 1
    _say_once(f"config: {pairs} (read as {'that' if one else 'those'}; rename {'it' if one else 'them'} in {where})")


@functools.cache
def _say_once(sentence: str) -> None:
    # `rlhf run` loads the config before its flow and the flow loads it again: the run says it once; workers get the
    # validated config (the new names), so they have nothing to say
    logging.getLogger(__name__).warning(sentence)


# configs written before rlhf_core became packages (2026-11) name this module by its old path; they keep working
MOVED_MODULES = {"rlhf_core.reward_functions": "rlhf_core.rewards.functions"}


def import_object(spec: str, *, field: str, error: type[Exception] = ConfigError, what: str = "function"):
    """Import 'package.module:name' (a reward function, a tool, an environment class) named in a config, or
    raise `error` naming the spec and `field`."""
    import importlib

    module_name, _, attr = spec.partition(":")
    module_name = MOVED_MODULES.get(module_name, module_name)
    if not module_name or not attr:
        raise error(f"{field}: '{spec}' must be written 'package.module:{what}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raises while importing
        raise error(
            f"{field}: could not import module '{module_name}' for '{spec}' ({type(err).__name__}: {err})"
        ) from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise error(f"{field}: module '{module_name}' has no {what} '{attr}'")
    return obj
