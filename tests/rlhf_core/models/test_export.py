"""The exported policy: files, policy-only weights, a model card that parses, and that it loads and generates."""

import json
import os
import warnings
from contextlib import chdir

import pytest
import torch
from safetensors import safe_open

from rlhf_core.models.card import read_front_matter
from rlhf_core.models.export import ExportInfo, export_policy, generation_settings
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.storage.saving import save_hf_dir

INFO = ExportInfo(
    algorithm="ppo",
    steps=60,
    base_model="demo",
    reward_model="models:/demo-reward-model/2",
    datasets=["prefs.jsonl", "prompts.jsonl"],
    eval_metrics={"eval/vader_compound_mean": 0.5, "eval/kl_mean": 5.7},
    hyperparameters={"rl.learning_rate": 0.002},
    model_name="demo-policy",
    policy_start="models:/demo-policy/1",
    source_checkpoint="models:/demo-policy-checkpoints/7",
    license="apache-2.0",
    eval_dataset="demo",
)


def load_card(path):
    """huggingface_hub's parse of an exported card, failing on any warning or log record it emits."""
    import logging

    from huggingface_hub import ModelCard

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hub_logger = logging.getLogger("huggingface_hub")
    hub_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            card = ModelCard.load(path)
    finally:
        hub_logger.removeHandler(handler)
    assert [str(w.message) for w in caught] == [] and [r.getMessage() for r in records] == []
    return card


def generation(tok):
    return generation_settings(tokenizer=tok, max_new_tokens=6)


def tensor_names(path):
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def greedy(model, tok):
    ids = tok(["the food was"], return_tensors="pt")
    return model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)


@pytest.fixture
def policy_dir(smoke_world, tmp_path):
    model, tok = load_causal_lm(str(smoke_world.base_model)), load_tokenizer(str(smoke_world.tokenizer))
    save_hf_dir(model, tok, tmp_path / "checkpoint-2" / "policy")
    return tmp_path / "checkpoint-2" / "policy", model, tok


def test_full_export_holds_the_policy_only_with_card_and_generation_config(policy_dir, tmp_path):
    src, model, tok = policy_dir
    out = export_policy(src, tmp_path / "export", INFO, generation=generation(tok), merge=False)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "tokenizer.json"} <= names
    assert not any(n.startswith("adapter") for n in names)
    # exactly the causal LM's tensors: no value head, no score head, no optimizer state
    saved = tensor_names(out / "model.safetensors")
    assert saved <= set(model.state_dict()) and not any("score" in n or "value" in n for n in saved)
    card = read_front_matter(out / "README.md")
    assert (
        card["base_model"] == "demo" and card["base_model_relation"] == "finetune" and card["tags"] == ["rlhf", "ppo"]
    )
    assert card["license"] == "apache-2.0" and card["datasets"] == ["prefs.jsonl", "prompts.jsonl"]
    assert "reward_model" not in card and "eval_results" not in card and "rlhf" not in card
    body = (out / "README.md").read_text()
    assert "AutoModelForCausalLM.from_pretrained" in body and "60 steps" in body
    # the lineage is in the body, not in base_model
    assert "`models:/demo-reward-model/2`" in body and "`models:/demo-policy-checkpoints/7`" in body
    assert "`models:/demo-policy/1`" in body
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == 6 and gen["do_sample"] is False and gen["eos_token_id"] == tok.eos_token_id
    assert not {"temperature", "top_k", "top_p"} & set(gen)
    loaded = load_causal_lm(str(out))
    assert torch.equal(greedy(loaded, tok), greedy(model, tok))
    assert not list(tmp_path.glob(".export-*"))  # the temporary sibling is gone


@pytest.fixture
def lora_policy_dir(smoke_world, tmp_path):
    from peft import LoraConfig, TaskType, get_peft_model

    base, tok = load_causal_lm(str(smoke_world.base_model)), load_tokenizer(str(smoke_world.tokenizer))
    model = get_peft_model(
        base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():  # a trained adapter: B is zero at initialization, which would hide a missing merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    save_hf_dir(model, tok, tmp_path / "checkpoint-2" / "policy")
    return tmp_path / "checkpoint-2" / "policy", model, tok


def adapter_on_its_base(adapter_dir):
    """peft's PeftModel on the base adapter_config.json names, a relative path joined with the adapter's directory."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    base = PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(adapter_dir / base), str(adapter_dir)).eval()


def test_lora_export_is_an_adapter_that_loads_on_its_base(lora_policy_dir, tmp_path, smoke_world):
    from peft import AutoPeftModelForCausalLM

    src, model, tok = lora_policy_dir
    out = export_policy(src, tmp_path / "export", INFO, generation=generation(tok), merge=False)
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "generation_config.json", "README.md"} <= names
    assert "model.safetensors" not in names
    # a local base is named by its path relative to the export directory, never an absolute path
    relative = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert relative == os.path.relpath(smoke_world.base_model.resolve(), out.resolve())
    assert not os.path.isabs(relative)
    card = read_front_matter(out / "README.md")
    assert card["tags"] == ["rlhf", "ppo", "lora"] and card["library_name"] == "peft"
    assert card["base_model"] == "demo" and card["base_model_relation"] == "adapter"
    assert f"load with the base at `{relative}` from this directory" in (out / "README.md").read_text()
    load_card(out / "README.md")
    expected = greedy(model, tok)
    on_base = adapter_on_its_base(out)
    assert torch.equal(greedy(on_base, tok), expected)
    with chdir(out):  # from_pretrained resolves the relative base against the current directory
        assert torch.equal(greedy(AutoPeftModelForCausalLM.from_pretrained("."), tok), expected)
        assert torch.equal(greedy(load_causal_lm("."), tok), expected)  # transformers loads base + adapter


def test_lora_export_with_merge_has_the_merged_model_and_the_adapter(lora_policy_dir, tmp_path, smoke_world):
    src, model, tok = lora_policy_dir
    out = export_policy(src, tmp_path / "export", INFO, generation=generation(tok), merge=True)
    assert (out / "model.safetensors").is_file() and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert not any("lora" in n for n in tensor_names(out / "model.safetensors"))
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(greedy(merged, tok), greedy(model, tok))
    card = read_front_matter(out / "README.md")
    assert card["base_model_relation"] == "finetune" and card["library_name"] == "transformers"
    assert card["tags"] == ["rlhf", "ppo", "lora"]
    # the adapter in adapter/ names the base relative to adapter/, and on that base it gives the merged logits
    relative = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert not os.path.isabs(relative) and (out / "adapter" / relative).resolve() == smoke_world.base_model.resolve()
    on_base = adapter_on_its_base(out / "adapter")
    ids = tok(["the food was"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**ids).logits, model(**ids).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(merged(**ids).logits, on_base(**ids).logits, atol=1e-4, rtol=1e-4)


def test_the_card_is_one_huggingface_hub_reads_as_written(policy_dir, tmp_path):
    src, _, tok = policy_dir
    out = export_policy(src, tmp_path / "export", INFO, generation=generation(tok), merge=False)
    data = load_card(out / "README.md").data
    assert data.base_model == "demo" and data.base_model_relation == "finetune" and data.license == "apache-2.0"
    assert data.datasets == ["prefs.jsonl", "prompts.jsonl"] and data.tags == ["rlhf", "ppo"]
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.model_name == "demo-policy"
    results = {r.metric_name: r for r in data.eval_results}
    assert set(results) == {"eval/vader_compound_mean", "eval/kl_mean"}
    vader = results["eval/vader_compound_mean"]
    assert (vader.task_type, vader.dataset_name, vader.dataset_type) == ("text-generation", "demo", "demo")
    assert (vader.metric_type, vader.metric_value) == ("vader_compound_mean", 0.5)
    assert results["eval/kl_mean"].metric_value == 5.7
    # and the metadata round-trips through the hub's own writer
    assert data.to_dict() == read_front_matter(out / "README.md")


def test_a_card_without_license_or_evaluation_omits_them(policy_dir, tmp_path):
    from dataclasses import replace

    src, _, tok = policy_dir
    info = replace(INFO, license=None, eval_metrics={})
    out = export_policy(src, tmp_path / "export", info, generation=generation(tok), merge=False)
    card = read_front_matter(out / "README.md")
    assert "license" not in card and "model-index" not in card
    assert load_card(out / "README.md").data.eval_results is None


class _Tok:
    eos_token_id, pad_token_id, bos_token_id = 2, 0, 1


def test_generation_settings_for_the_demo_are_greedy():
    """The demo base sets no sampling defaults: greedy, the run's response length, the run's stop ids."""
    settings = generation_settings(tokenizer=_Tok(), max_new_tokens=12, stop_token_ids=[2, 7])
    assert settings == {
        "do_sample": False,
        "max_new_tokens": 12,
        "eos_token_id": [2, 7],
        "pad_token_id": 0,
        "bos_token_id": 1,
    }
    from transformers import GenerationConfig

    GenerationConfig(**settings).validate(strict=True)


def test_generation_settings_keep_the_base_defaults_never_the_rl_sampling():
    base = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "eos_token_id": [5, 6],
        "bos_token_id": 9,
        "transformers_version": "4.40.0",
    }
    settings = generation_settings(tokenizer=_Tok(), max_new_tokens=12, stop_token_ids=[2], base_defaults=base)
    assert settings == {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "max_new_tokens": 12,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "bos_token_id": 1,
    }
    # a base that bounds the length keeps its bound; one without do_sample is greedy, its stray sampling keys dropped
    bounded = generation_settings(
        tokenizer=_Tok(), max_new_tokens=12, base_defaults={"max_length": 4096, "temperature": 0.2}
    )
    assert bounded["max_length"] == 4096 and "max_new_tokens" not in bounded
    assert bounded["do_sample"] is False and "temperature" not in bounded
