"""rlhf_core/demo/models.py: the demo's word-level chat tokenizer and tiny Llama load with the Auto classes and are
shaped as Qwen2.5's."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tokenizer_and_model_load_with_auto_classes(smoke_world):
    tokenizer = AutoTokenizer.from_pretrained(smoke_world.tokenizer)
    ids = tokenizer("the food was great .").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
    # words are decoded with spaces where they meet
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the food was great ."
    assert tokenizer.decode(ids[1:3]) + " " + tokenizer.decode(ids[3:]) == "the food was great ."
    # Qwen2.5 base's shape: pad == eos; ChatML-like turns whose end is the first of two stop ids
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and tokenizer.eos_token == "<|endoftext|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the food was"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<bos><|im_start|>user\nthe food was<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tokenizer(chat, add_special_tokens=False).input_ids
    assert chat_ids.count(tokenizer.bos_token_id) == 1 and tokenizer.unk_token_id not in chat_ids
    assert tokenizer.decode(chat_ids, skip_special_tokens=True) == "user the food was assistant"
    model = AutoModelForCausalLM.from_pretrained(smoke_world.base_model)
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == [im_end, tokenizer.eos_token_id]
    assert (smoke_world.base_model / "model.safetensors").is_file()
