"""Export of the final policy: a directory that `from_pretrained` loads, with its model card.

Layout of the export directory:
- full fine-tuning: the policy (config.json, model.safetensors), generation_config.json, tokenizer
  files and README.md;
- LoRA, `merge: false`: the adapter (adapter_config.json, adapter_model.safetensors) at the top,
  with the tokenizer, generation_config.json and README.md. `AutoModelForCausalLM.from_pretrained`
  loads base + adapter through PEFT; `adapter_config.json` names the base;
- LoRA, `merge: true`: the merged full model at the top and the adapter in `adapter/`.
Only the policy is written: no value head, no reward model, no optimizer state. The directory is
written to a temporary sibling and renamed into place, so an export is complete or absent.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.model_card import write_model_card
from rlhf_core.saving import atomic_dir

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class ExportInfo:
    """What the model card says about how the policy was made."""

    algorithm: str
    steps: int
    base_model: str  # the policy's starting point (base model name, SFT checkpoint URI or path)
    reward_model: str  # the reward model version URI, or "none" (GRPO with reward functions only)
    datasets: list[str]
    eval_metrics: dict[str, float]
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""  # the registered model the export becomes a version of


def generation_settings(
    *, tokenizer, max_new_tokens: int, temperature: float, top_k: int, top_p: float, stop_token_ids: Sequence[int] = ()
) -> dict[str, Any]:
    """generation_config.json: the sampling the policy was trained with, and every id it learned to stop
    on as eos_token_id (a list when there are several, as instruct models ship; the tokenizer's eos when none)."""
    eos: Any = list(stop_token_ids) or tokenizer.eos_token_id
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    settings: dict[str, Any] = {
        "do_sample": True,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "eos_token_id": eos,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if tokenizer.bos_token_id is not None:
        settings["bos_token_id"] = tokenizer.bos_token_id
    return settings


def _card_body(info: ExportInfo, *, lora: bool, merged: bool, name: str) -> str:
    metrics = "\n".join(f"| {k} | {v:.4f} |" for k, v in info.eval_metrics.items()) or "| (none) | |"
    params = "\n".join(f"- `{k}`: {v}" for k, v in info.hyperparameters.items())
    if lora and not merged:
        load = (
            "This directory holds a LoRA adapter; `adapter_config.json` names its base model.\n\n"
            "```python\nfrom peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{name}")  # or AutoModelForCausalLM with peft installed\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")\n```'
        )
    else:
        load = (
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{name}")\ntokenizer = AutoTokenizer.from_pretrained("{name}")\n'
            'inputs = tokenizer("The movie was", return_tensors="pt")\n'
            "print(tokenizer.decode(model.generate(**inputs)[0], skip_special_tokens=True))\n```"
        )
        if lora:
            load += "\n\nThe LoRA adapter itself is in `adapter/` (load it with `peft.PeftModel.from_pretrained`)."
    reward = f"the reward model `{info.reward_model}`" if info.reward_model != "none" else "Python reward functions"
    return f"""This policy was trained with {info.algorithm.upper()} for {info.steps} steps by the RLHF pipeline,
starting from `{info.base_model}` and optimizing {reward}.
`generation_config.json` holds the sampling settings it was trained with.

## How to load it

{load}

## Final evaluation (held-out prompts, near-greedy generation)

| metric | value |
|---|---|
{metrics}

## Training settings

{params}
"""


def export_policy(
    policy_dir: str | Path, output_dir: str | Path, info: ExportInfo, *, generation: dict[str, Any], merge: bool
) -> Path:
    """Write the export of the RL checkpoint's `policy/` directory to `output_dir` (see the module docstring).

    `policy_dir` is what `training.save_hf_dir` wrote: full weights, the tokenizer, and with LoRA the
    adapter in `adapter/`. The weights are loaded and saved again as a causal LM, so only the
    policy's tensors reach model.safetensors.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    policy_dir = Path(policy_dir)
    lora = (policy_dir / "adapter" / "adapter_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    output_dir = Path(output_dir)
    with atomic_dir(output_dir) as tmp:
        adapter_target = tmp / "adapter" if (lora and merge) else tmp
        if lora:
            adapter_target.mkdir(exist_ok=True)
            # adapter_config.json keeps base_model_name_or_path: where the policy was loaded from
            for name in ADAPTER_FILES:
                shutil.copy2(policy_dir / "adapter" / name, adapter_target / name)
        if not lora or merge:
            model = AutoModelForCausalLM.from_pretrained(policy_dir)
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if lora and merge:
            tokenizer.save_pretrained(tmp / "adapter")
        GenerationConfig(**generation).save_pretrained(tmp)
        metadata = {
            "base_model": info.base_model,
            "library_name": "peft" if (lora and not merge) else "transformers",
            "pipeline_tag": "text-generation",
            "tags": ["rlhf", info.algorithm] + (["lora"] if lora else []),
            "datasets": info.datasets,
            "reward_model": info.reward_model,
            "rlhf": {"algorithm": info.algorithm, "steps": info.steps, "registered_model": info.model_name or None},
            "eval_results": {k: round(float(v), 6) for k, v in info.eval_metrics.items()},
        }
        write_model_card(
            tmp,
            title=f"{info.model_name or 'RLHF policy'} ({info.algorithm.upper()})",
            metadata=metadata,
            body=_card_body(info, lora=lora, merged=merge, name=str(output_dir)),
        )
    return output_dir
