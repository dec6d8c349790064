"""The exported policy: files, policy-only weights, a model card that parses, and that it loads and generates."""

import json

import pytest
import torch
from safetensors import safe_open

from rlhf_core.export import ExportInfo, export_policy, generation_settings
from rlhf_core.model_card import read_front_matter
from rlhf_core.models import load_causal_lm, load_tokenizer
from rlhf_core.saving import save_hf_dir

INFO = ExportInfo(
    algorithm="ppo",
    steps=60,
    base_model="models:/demo-policy/1",
    reward_model="models:/demo-reward-model/2",
    datasets=["prefs.jsonl", "prompts.jsonl"],
    eval_metrics={"eval/vader_compound_mean": 0.5, "eval/kl_mean": 5.7},
    hyperparameters={"rl.learning_rate": 0.002},
    model_name="demo-policy",
)


def generation(tok):
    return generation_settings(tokenizer=tok, max_new_tokens=6, temperature=0.7, top_k=0, top_p=1.0)


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
    assert card["base_model"] == "models:/demo-policy/1" and card["tags"] == ["rlhf", "ppo"]
    assert card["reward_model"] == "models:/demo-reward-model/2" and card["datasets"] == [
        "prefs.jsonl",
        "prompts.jsonl",
    ]
    assert card["eval_results"]["eval/vader_compound_mean"] == 0.5
    body = (out / "README.md").read_text()
    assert "AutoModelForCausalLM.from_pretrained" in body and "60 steps" in body
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == 6 and gen["temperature"] == 0.7 and gen["eos_token_id"] == tok.eos_token_id
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


def test_lora_export_is_an_adapter_that_loads_on_its_base(lora_policy_dir, tmp_path, smoke_world):
    from peft import AutoPeftModelForCausalLM

    src, model, tok = lora_policy_dir
    out = export_policy(src, tmp_path / "export", INFO, generation=generation(tok), merge=False)
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "generation_config.json", "README.md"} <= names
    assert "model.safetensors" not in names
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        smoke_world.base_model
    )
    assert read_front_matter(out / "README.md")["tags"] == ["rlhf", "ppo", "lora"]
    expected = greedy(model, tok)
    assert torch.equal(greedy(AutoPeftModelForCausalLM.from_pretrained(str(out)), tok), expected)
    assert torch.equal(greedy(load_causal_lm(str(out)), tok), expected)  # transformers loads base + adapter


def test_lora_export_with_merge_has_the_merged_model_and_the_adapter(lora_policy_dir, tmp_path):
    src, model, tok = lora_policy_dir
    out = export_policy(src, tmp_path / "export", INFO, generation=generation(tok), merge=True)
    assert (out / "model.safetensors").is_file() and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert not any("lora" in n for n in tensor_names(out / "model.safetensors"))
    merged = load_causal_lm(str(out))
    assert torch.equal(greedy(merged, tok), greedy(model, tok))
    ids = tok(["the food was"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**ids).logits, model(**ids).logits, atol=1e-4, rtol=1e-4)
