"""The demo world's tokenizer and model, shaped like the chat models people align.

The tokenizer is word level, with a ChatML-like chat template that ends each turn with `<|im_end|>`;
its pad token is its eos (`<|endoftext|>`, as Qwen2.5 base). The model is a tiny randomly initialized
Llama that stops on two ids (`<|im_end|>` and `<|endoftext|>`, as Qwen2.5-Instruct's generation_config).
Decoding puts a space where words meet.
"""

from __future__ import annotations

from rlhf_core.config import DemoModelConfig

UNK, BOS, EOS = "<unk>", "<bos>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # a turn's start and end (the first stop id)
SPECIAL_TOKENS = [UNK, BOS, EOS, IM_START, IM_END]
# ChatML with the bos written by the template (as Llama 3's): the policy answers after '<|im_start|>assistant'
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROLES = ["system", "user", "assistant"]  # in the vocabulary even when no row of the world uses one


def train_word_tokenizer(texts: list[str], max_length: int):
    """A word-level chat tokenizer as a HF fast tokenizer: lower-cased, whitespace split, bos prepended to
    plain text, `<|im_start|>`/`<|im_end|>` special, pad == eos, CHAT_TEMPLATE, and a decoder that joins
    words with spaces (without one, decoded words run together: "waswas")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(texts, trainer=trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    # special tokens are matched in raw text before the split ("<|im_start|>user" is two tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # " ".join(words); no word starts with ##
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=UNK,
        model_max_length=max_length,
        extra_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_demo_model(tokenizer, cfg: DemoModelConfig, seed: int):
    """A randomly initialized tiny LlamaForCausalLM sized by `cfg`, matched to `tokenizer`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # no pad id in the model config (as Qwen2.5's): with one, the embedding's padding_idx would start
        # the eos (== pad) row at zero and give it no gradient, so the token everything ends on would be blank
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # two stop ids, the end of turn first, as an instruct model's generation_config
    stops = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id
    )
    return model
