"""The accelerate launch file that `run.accelerate_config` names: which strategy it asks for."""

from __future__ import annotations

from pathlib import Path

import yaml


def accelerate_strategy(path) -> str:
    """What an `accelerate launch` config file asks for: 'ddp', 'zero1'/'zero2'/'zero3', 'fsdp' (or 'fsdp1').

    Raises ValueError naming the file when it is missing, not YAML, or not an accelerate config.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"run.accelerate_config: {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"run.accelerate_config: {path} is not valid YAML ({err})") from None
    if not isinstance(raw, dict) or "distributed_type" not in raw:
        raise ValueError(f"run.accelerate_config: {path} has no distributed_type; write it with `accelerate config`")
    kind = str(raw["distributed_type"]).upper()
    if kind == "DEEPSPEED":
        stage = int((raw.get("deepspeed_config") or {}).get("zero_stage", 2))
        return f"zero{stage}"
    if kind == "FSDP":
        return "fsdp" if int((raw.get("fsdp_config") or {}).get("fsdp_version", 1)) == 2 else "fsdp1"
    return "ddp"
