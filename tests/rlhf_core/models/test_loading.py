"""rlhf_core/models/loading.py: loading models and tokenizers with one-sentence errors, pad and stop tokens."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rlhf_core.models.loading import ModelSourceError, ensure_pad_token, load_causal_lm, load_tokenizer


def test_missing_directory_is_one_sentence(tmp_path):
    with pytest.raises(ModelSourceError, match=r"model.base: directory .*nope does not exist"):
        load_causal_lm(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="is not a Hugging Face model directory"):
        load_causal_lm(str(tmp_path / "empty"))


def test_unknown_hub_name_fails_offline_with_the_field():
    with pytest.raises(ModelSourceError, match="model.base: could not load 'no-such-org/no-such-model'"):
        load_causal_lm("no-such-org/no-such-model")


def test_pad_token_borrowed_from_eos_or_refused(smoke_world):
    tokenizer = AutoTokenizer.from_pretrained(smoke_world.tokenizer)
    tokenizer.pad_token = None
    ensure_pad_token(tokenizer, "x")
    assert tokenizer.pad_token == tokenizer.eos_token
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ModelSourceError, match="has no pad token and no eos token to borrow"):
        ensure_pad_token(tokenizer, "my-tokenizer")
    assert load_tokenizer(str(smoke_world.tokenizer)).pad_token == "<|endoftext|>"  # the demo's pad is its eos


def test_a_stop_token_unknown_to_a_word_level_tokenizer_is_not_taken_for_its_unk(smoke_world):
    from rlhf_core.models.loading import ModelSourceError, load_tokenizer, stop_token_ids

    tok = load_tokenizer(str(smoke_world.tokenizer))
    assert len(tok.encode("<|eot_id|>", add_special_tokens=False)) == 1  # the unk id
    with pytest.raises(
        ModelSourceError, match=r"^rl\.stop_tokens\[0\]: '<\|eot_id\|>' is not a token of the policy's tokenizer"
    ):
        stop_token_ids(tok, None, stop_tokens=["<|eot_id|>"])
    assert stop_token_ids(tok, None, stop_tokens=["<|im_end|>"]) == (
        tok.eos_token_id,
        tok.convert_tokens_to_ids("<|im_end|>"),
    )
    assert stop_token_ids(tok, None, stop_tokens=[tok.eos_token]) == (tok.eos_token_id,)


def test_lora_config_is_the_policy_and_reward_model_adapters_as_before():
    from peft import LoraConfig, TaskType

    from rlhf_core.config import LoraSettings
    from rlhf_core.models.loading import lora_config

    lora = LoraSettings(enabled=True, r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"])
    common = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    assert lora_config(lora, "CAUSAL_LM") == LoraConfig(task_type=TaskType.CAUSAL_LM, **common)
    # the reward model's new score head is trained whole beside its adapters
    assert lora_config(lora, "SEQ_CLS") == LoraConfig(task_type=TaskType.SEQ_CLS, modules_to_save=["score"], **common)
    assert lora_config(lora, "CAUSAL_LM").modules_to_save is None
