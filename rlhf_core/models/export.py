"""Export of the final policy: a directory that `from_pretrained` loads, with its model card.

Layout of the export directory:
- full fine-tuning: the policy (config.json, model.safetensors), generation_config.json, tokenizer
  files and README.md;
- LoRA, `merge: false`: the adapter (adapter_config.json, adapter_model.safetensors) at the top,
  with the tokenizer, generation_config.json and README.md. `AutoModelForCausalLM.from_pretrained`
  loads base + adapter through PEFT; `adapter_config.json` names the base by
  its hub id, or a local base by its path relative to the adapter's directory;
- LoRA, `merge: true`: the merged full model at the top and the adapter in `adapter/`.
Only the policy is written: no value head, no reward model, no optimizer state. The directory is
written to a temporary sibling and renamed into place, so an export is complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.data.markdown import markdown_table
from rlhf_core.models.card import write_model_card
from rlhf_core.models.loading import load_pretrained
from rlhf_core.storage.saving import atomic_dir

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class ExportInfo:
    """What the model card says about how the policy was made."""

    algorithm: str
    steps: int
    base_model: str  # the root base model's hub id (or local name / "demo"): the card's `base_model`
    reward_model: str  # the reward model version URI, or "none" (GRPO with reward functions only)
    datasets: list[str]  # hub ids, local file names or "demo": never absolute paths
    eval_metrics: dict[str, float]
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""  # the registered model the export becomes a version of
    policy_start: str = ""  # lineage: where RL started (base model, SFT checkpoint URI, champion version URI)
    source_checkpoint: str = ""  # lineage: the RL checkpoint (model URI or path) the export was written from
    license: str | None = None  # a hub license id; omitted from the card when None
    eval_dataset: str = ""  # the held-out prompts the final evaluation ran on (hub id, file name or "demo")
    tools: list[str] = field(default_factory=list)  # grpo.tools and grpo.environment's import paths: what it called


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
TOKEN_ID_KEYS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id")


def generation_settings(
    *,
    tokenizer,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    base_defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """generation_config.json: the base model's own inference defaults, with every id the run stopped on.

    `base_defaults` is what the base model's generation_config sets (`GenerationConfig.to_diff_dict()`;
    None for the demo world's base, which sets no sampling defaults). Its settings are kept as they are,
    its token ids replaced: eos_token_id is every id the policy learned to stop on (a list when there are
    several, as instruct models ship; the tokenizer's eos when none), pad and bos the tokenizer's.
    Where the base sets no `do_sample`, generation is greedy (do_sample false, no temperature, top_k or
    top_p). max_new_tokens is the run's response length unless the base sets max_new_tokens or max_length.
    The RL stage's sampling settings (rl.temperature, rl.top_k, rl.top_p) are never written: they are
    how the policy explored while training, not how it should be used.
    """
    settings: dict[str, Any] = {
        k: v
        for k, v in (base_defaults or {}).items()
        if k not in TOKEN_ID_KEYS and k != "transformers_version" and v is not None
    }
    if not settings.get("do_sample"):
        settings["do_sample"] = False
        for key in SAMPLING_KEYS:
            settings.pop(key, None)
    if "max_new_tokens" not in settings and "max_length" not in settings:
        settings["max_new_tokens"] = max_new_tokens
    eos: Any = list(stop_token_ids) or tokenizer.eos_token_id
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    settings["eos_token_id"] = eos
    settings["pad_token_id"] = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        settings["bos_token_id"] = tokenizer.bos_token_id
    return settings


def _adapter_base(adapter_dir: Path, final_dir: Path) -> tuple[str | None, bool]:
    """Point adapter_config.json's base_model_name_or_path at the base as a hub id, or for a local base at its
    path relative to `final_dir` (where the adapter will live): (the value written, whether it is a local path)."""
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if not base or not Path(base).expanduser().is_dir():
        return base, False
    config["base_model_name_or_path"] = os.path.relpath(Path(base).expanduser().resolve(), final_dir.resolve())
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return config["base_model_name_or_path"], True


def _adapter_load(where: str, directory: str, base: str | None, relative: bool) -> str:
    """How to load the adapter in `directory` (`where`: 'this directory' or 'adapter/') on its base."""
    if relative:
        note = (
            f"`adapter_config.json` names its base by a relative path: load with the base at `{base}` from {where}. "
            "`from_pretrained` resolves a relative path against the current directory, so join it with the "
            "adapter's directory first:"
        )
    else:
        note = f"`adapter_config.json` names its base model, `{base}`:"
    code = (
        "```python\nimport os\n\nfrom peft import PeftConfig, PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
        f'adapter_dir = "{directory}"\n'
        "base = PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path\n"
        + ("base = os.path.join(adapter_dir, base)\n" if relative else "")
        + "model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)\n```"
    )
    return f"{note}\n\n{code}"


def _card_body(
    info: ExportInfo, *, lora: bool, merged: bool, name: str, adapter_base: tuple[str | None, bool] = (None, False)
) -> str:
    scores = [(k, f"{v:.4f}") for k, v in info.eval_metrics.items()] or [("(none)", "")]
    metrics = "\n".join(markdown_table(("metric", "value"), scores))
    params = "\n".join(f"- `{k}`: {v}" for k, v in info.hyperparameters.items())
    if lora and not merged:
        load = "This directory holds a LoRA adapter. " + _adapter_load("this directory", name, *adapter_base)
    else:
        load = (
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{name}")\ntokenizer = AutoTokenizer.from_pretrained("{name}")\n'
            'inputs = tokenizer("The movie was", return_tensors="pt")\n'
            "print(tokenizer.decode(model.generate(**inputs)[0], skip_special_tokens=True))\n```"
        )
        if lora:
            load += "\n\nThe LoRA adapter itself is in `adapter/`. " + _adapter_load(
                "adapter/", f"{name}/adapter", *adapter_base
            )
    reward = f"the reward model `{info.reward_model}`" if info.reward_model != "none" else "Python reward functions"
    lineage = [
        f"- base model: `{info.base_model}`",
        f"- policy start: `{info.policy_start or info.base_model}`",
        f"- reward model: `{info.reward_model}`",
    ]
    if info.source_checkpoint:
        lineage.append(f"- source checkpoint: `{info.source_checkpoint}`")
    if info.model_name:
        lineage.append(f"- registered model: `{info.model_name}`")
    lineage_text = "\n".join(lineage)
    tools = _tools_section(info.tools)
    return f"""This policy was trained with {info.algorithm.upper()} for {info.steps} steps by the RLHF pipeline,
starting from `{info.policy_start or info.base_model}` and optimizing {reward}.
`generation_config.json` holds the base model's own generation defaults (greedy for the demo world) and the
run's stop tokens; the sampling settings used during RL are not in it.

## How to load it

{load}

## Lineage

{lineage_text}

{tools}## Final evaluation (held-out prompts, near-greedy generation)

{metrics}

## Training settings

{params}
"""


def _tools_section(tools: list[str]) -> str:
    """The card's list of the tools the policy learned to call (empty without any)."""
    if not tools:
        return ""
    listed = "\n".join(f"- `{t}`" for t in tools)
    return f"""## Tools

Its rollouts were episodes in which it called these tools and read their answers (grpo.tools, grpo.environment):

{listed}

The tokenizer keeps the chat template that wrote those calls and answers: pass the same tools to
`tokenizer.apply_chat_template(messages, tools=[...])` when serving it, and run the calls it writes.

"""


def _model_index(info: ExportInfo) -> list[dict[str, Any]] | None:
    """The eval results in the hub's `model-index` format (None without any)."""
    if not info.eval_metrics:
        return None
    dataset = info.eval_dataset or "held-out prompts"
    metrics = [
        {"type": k.removeprefix("eval/").replace("/", "_"), "value": round(float(v), 6), "name": k}
        for k, v in info.eval_metrics.items()
    ]
    return [
        {
            "name": info.model_name or "rlhf-policy",
            "results": [
                {
                    "task": {"type": "text-generation", "name": "Text Generation"},
                    "dataset": {"name": dataset, "type": dataset},
                    "metrics": metrics,
                }
            ],
        }
    ]


def card_metadata(info: ExportInfo, *, lora: bool, merge: bool) -> dict[str, Any]:
    """The exported card's YAML metadata, in the fields the Hugging Face hub reads.

    base_model_relation: "adapter" for an adapter-only export, "finetune" for full weights (a LoRA merged into
    its one base is a fine-tune of it; the hub's "merge" means several models merged into one)."""
    metadata: dict[str, Any] = {
        "base_model": info.base_model,
        "base_model_relation": "adapter" if (lora and not merge) else "finetune",
    }
    if info.license:
        metadata["license"] = info.license
    metadata.update(
        {
            "library_name": "peft" if (lora and not merge) else "transformers",
            "pipeline_tag": "text-generation",
            "tags": ["rlhf", info.algorithm] + (["lora"] if lora else []) + (["tool-use"] if info.tools else []),
            "datasets": list(info.datasets),
        }
    )
    model_index = _model_index(info)
    if model_index is not None:
        metadata["model-index"] = model_index
    return metadata


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
            # adapter_config.json's base_model_name_or_path: made a hub id or a path relative to the export below
            for name in ADAPTER_FILES:
                shutil.copy2(policy_dir / "adapter" / name, adapter_target / name)
        if not lora or merge:
            model = load_pretrained(AutoModelForCausalLM, policy_dir)
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if lora and merge:
            tokenizer.save_pretrained(tmp / "adapter")
        GenerationConfig(**generation).save_pretrained(tmp)
        adapter_base = (
            _adapter_base(adapter_target, output_dir / adapter_target.relative_to(tmp)) if lora else (None, False)
        )
        write_model_card(
            tmp,
            title=f"{info.model_name or 'RLHF policy'} ({info.algorithm.upper()})",
            metadata=card_metadata(info, lora=lora, merge=merge),
            body=_card_body(info, lora=lora, merged=merge, name=str(output_dir), adapter_base=adapter_base),
        )
    return output_dir
