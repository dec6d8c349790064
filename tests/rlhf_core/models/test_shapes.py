"""rlhf_core/models/shapes.py: a model's shape without its weights, counted by hand (the demo's Llama, Qwen2) or on
the meta device, pinned against the models built for real: their parameters, PEFT's trainable adapters, the
sequence classifier's."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

from rlhf_core.config import DemoModelConfig, LoraSettings, ModelConfig
from rlhf_core.demo.models import build_demo_model, train_word_tokenizer
from rlhf_core.models.shapes import (
    DEMO_VOCAB,
    FALLBACK_CHUNK_TOKENS,
    Precision,
    ShapeReader,
    activation_bytes,
    config_dtype,
    demo_shape,
    kv_cache_bytes,
    layer_activation_bytes,
    llama_shape,
    logits_bytes,
    logits_chunk_tokens,
    shape_of_config,
)

SMALL_QWEN = dict(
    vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


# Qwen2.5-0.5B's public shape: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936, tied
QWEN_05B = llama_shape(151936, 896, 24, 14, 2, 4864, attention_bias=True)
TINY = llama_shape(100, 16, 2, 4, 2, 32)  # head size 4, KV width 8


def qwen(tied: bool) -> Qwen2Config:
    return Qwen2Config(**SMALL_QWEN, tie_word_embeddings=tied)


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def linears(model) -> tuple:
    head = model.get_output_embeddings()
    return tuple(
        (name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    )


def test_the_demo_model_is_counted_by_hand():
    tokenizer = train_word_tokenizer(["the cat sat on the mat", "a dog ran"], 64)
    demo = DemoModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    model = build_demo_model(tokenizer, demo, seed=0)
    shape = demo_shape(demo, len(tokenizer))
    assert shape.parameters == numel(model)
    assert shape.linears == linears(model)
    assert (shape.tied, shape.kv_heads, shape.head_dim, shape.dtype) == (True, 4, 8, "float32")


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_by_hand_and_on_the_meta_device_match_the_built_model(tied):
    model = Qwen2ForCausalLM(qwen(tied))
    by_hand = llama_shape(320, 64, 3, 4, 2, 176, tied=tied, attention_bias=True)
    on_meta = shape_of_config(qwen(tied))
    assert by_hand.parameters == on_meta.parameters == numel(model)
    assert by_hand.linears == on_meta.linears == linears(model)
    assert by_hand == on_meta
    assert on_meta.lm_head_parameters == (0 if tied else 320 * 64)


@pytest.mark.parametrize("tied", [True, False])
def test_the_sequence_classifier_drops_the_lm_head_for_a_score_head(tied):
    config = qwen(tied)
    config.num_labels = 1
    classifier = AutoModelForSequenceClassification.from_config(config)
    assert llama_shape(320, 64, 3, 4, 2, 176, tied=tied, attention_bias=True).classifier_parameters == numel(classifier)


@pytest.mark.parametrize(
    "targets",
    [
        ["q_proj", "v_proj"],
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ["self_attn.o_proj", "down_proj"],
    ],
)
def test_lora_trainable_parameters_are_peft_s(targets):
    from peft import get_peft_model

    from rlhf_core.models.loading import lora_config

    lora = LoraSettings(enabled=True, r=4, target_modules=targets)
    model = get_peft_model(Qwen2ForCausalLM(qwen(True)), lora_config(lora, "CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert llama_shape(320, 64, 3, 4, 2, 176, attention_bias=True).lora_parameters(lora) == trainable
    # by hand for q and v: r x (in + out) per layer, 3 layers
    if targets == ["q_proj", "v_proj"]:
        assert trainable == 3 * (4 * (64 + 64) + 4 * (64 + 32))


def test_the_dtype_is_the_config_s_only_for_auto():
    config = qwen(True)
    config.dtype = torch.bfloat16
    assert config_dtype(config, "auto") == "bfloat16"
    assert config_dtype(config, "float32") == "float32"
    config.dtype = None
    assert config_dtype(config, "auto") == "float32"


def test_sources_are_read_offline_or_said_unknown(tmp_path):
    config = qwen(False)
    config.dtype = "bfloat16"
    config.save_pretrained(tmp_path / "local")
    read = ShapeReader(ModelConfig(base=str(tmp_path / "local"), torch_dtype="auto"), tmp_path / "world", "reviews")
    local = read(str(tmp_path / "local"), "model.base")
    assert local.parameters == numel(Qwen2ForCausalLM(qwen(False))) and local.dtype == "bfloat16"
    assert read("no-such-org/no-such-model", "reward.base") == (
        "reward.base no-such-org/no-such-model is not in the local Hugging Face cache (nothing is downloaded)"
    )
    assert read("models:/rm/3", "grpo.rewards[0].model").startswith("grpo.rewards[0].model models:/rm/3 is a registry")
    assert read(str(tmp_path / "local"), "model.base") is local  # each source read once


def test_the_demo_vocabulary_is_the_built_world_s_else_the_world_s_usual(tmp_path):
    read = ShapeReader(ModelConfig(), tmp_path, "arithmetic")
    assert read("demo", "model.base").vocab == DEMO_VOCAB["arithmetic"]
    (tmp_path / "base_model").mkdir()
    (tmp_path / "base_model" / "config.json").write_text(json.dumps({"vocab_size": 2213}))
    assert ShapeReader(ModelConfig(), tmp_path, "reviews")("demo", "model.base").vocab == 2213


def test_qwen_05b_parameters_and_kv_cache_by_hand():
    # 151936 x 896 tied embedding; per layer q 896x896+896, k and v 896x128+128, o 896x896, MLP 3 x 896 x 4864,
    # two norms; the final norm
    per_layer = 896 * 896 + 896 + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
    assert QWEN_05B.parameters == 151936 * 896 + 24 * per_layer + 896 == 494_032_768
    # 32 completions x 768 tokens x 24 layers x (k, v) x 2 KV heads x 64 x 2 bytes
    assert kv_cache_bytes(QWEN_05B, 32, 768, 2) == 32 * 768 * 24 * 2 * 2 * 64 * 2 == 301_989_888


def test_one_layer_s_activations_by_hand():
    # norms 16 x 16 bytes; attention 5 x 16 + 3 x 8 + 2 x 16 (GQA's repeated k, v); MLP 4 x 32; 4 bytes each
    assert layer_activation_bytes(TINY, Precision(4)) == 16 * 16 + 4 * (5 * 16 + 3 * 8 + 2 * 16 + 4 * 32) == 1312
    # autocast: the norms stay float32 and add the projections' 16-bit inputs; the rest at 2 bytes
    assert layer_activation_bytes(TINY, Precision(4, autocast=True)) == 26 * 16 + 2 * 264
    whole, kept = activation_bytes(TINY, Precision(4), 10, False), activation_bytes(TINY, Precision(4), 10, True)
    assert whole == 10 * (2 * 1312 + 4 * 16 * 4)
    assert kept == 10 * (2 * 16 * 4 + 2 * 1312 + 4 * 16 * 4)  # each layer's input; one layer recomputed, its gradients
    assert activation_bytes(QWEN_05B, Precision(4), 10, True) < activation_bytes(QWEN_05B, Precision(4), 10, False) / 5


def test_logits_are_one_chunk_of_three_float32_copies():
    chunk = logits_chunk_tokens()
    assert logits_bytes(QWEN_05B, 10 * chunk) == 3 * chunk * 151936 * 4
    assert logits_bytes(QWEN_05B, 100) == 3 * 100 * 151936 * 4
    assert logits_bytes(QWEN_05B, 10 * chunk, chunked=False) == 3 * 10 * chunk * 151936 * 4


def test_the_fallback_chunk_is_forward_s_constant():
    from rlhf_core.models import forward

    assert getattr(forward, "LOGITS_CHUNK_TOKENS", FALLBACK_CHUNK_TOKENS) == FALLBACK_CHUNK_TOKENS
