"""The arithmetic world: two-operand additions with a verifiable answer, for RL with verifiable rewards (RLVR).

Everything is offline and deterministic from a seed: a character-level digit tokenizer (15 tokens), a tiny
Llama sized by `DemoModelConfig` (`demo_models.build_demo_model`), and the 10,000 problems `a+b=` with
0 <= a, b <= 99, shuffled by the seed and cut into three disjoint splits:

    sft    {"text": "a+b=c"}            labelled pairs (the SFT trainer appends eos)
    rl     {"prompt": "a+b=", "answer": "c"}  RL prompts; the answer column is for the checker only
    eval   {"prompt": "a+b=", "answer": "c"}  held-out problems

The prompt is the raw text `a+b=` (the tokenizer has no chat template); the policy answers with the digits
of the sum and eos. `reward_functions.exact_match` checks the answer. `demo_world.build_demo_world` writes
the world (data.demo.world 'arithmetic') as the pipeline reads it.
"""

from __future__ import annotations

import random

from rlhf_core.config import ConfigError, DemoModelConfig

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
CHARACTERS = [str(d) for d in range(10)] + ["+", "="]
MAX_OPERAND = 99
MAX_LENGTH = 16  # bos + "99+99=198" + eos is 11 tokens


def build_digit_tokenizer(max_length: int = MAX_LENGTH):
    """A character-level `PreTrainedTokenizerFast` of '0'-'9', '+', '=' and <pad>, <bos>, <eos> (15 tokens).

    Spaces are dropped before splitting, bos is prepended to plain text, pad is distinct from eos, and
    decoding joins the characters without spaces ("57"). No chat template: prompts are the raw `a+b=`.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.normalizer = normalizers.Replace(Regex(r"\s"), "")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.decoder = decoders.Fuse()  # "5", "7" -> "57"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def build_arithmetic_model(tokenizer, cfg: DemoModelConfig, seed: int):
    """`build_demo_model` for the digit tokenizer: the tiny Llama, stopping on eos alone.

    `build_demo_model` adds the chat models' end-of-turn token as a first stop id; the digit tokenizer has
    none (it would come back as None), so the generation config is set to stop on eos only.
    """
    from rlhf_core.demo.models import build_demo_model

    model = build_demo_model(tokenizer, cfg, seed)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id]
    return model


def prompt_text(a: int, b: int) -> str:
    """The prompt of one problem: 'a+b='."""
    return f"{a}+{b}="


def all_problems() -> list[tuple[int, int]]:
    """Every (a, b) with 0 <= a, b <= MAX_OPERAND, in order (10,000 pairs)."""
    return [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]


def split_problems(seed: int, num_sft: int = 800, num_rl: int = 4000, num_eval: int = 200) -> dict:
    """The problems shuffled by `seed` and cut into disjoint {"sft", "rl", "eval"} lists of (a, b).

    The eval problems are cut first, then SFT, then RL, so a split's problems depend only on the seed and
    the sizes cut before it (a bigger RL set keeps the same eval and SFT problems).
    """
    problems = all_problems()
    sizes = {"num_sft": num_sft, "num_rl": num_rl, "num_eval": num_eval}
    if min(sizes.values()) < 0 or sum(sizes.values()) > len(problems):
        raise ConfigError(f"split sizes {sizes} must be non-negative and add up to at most {len(problems)}")
    random.Random(seed).shuffle(problems)
    eval_end, sft_end = num_eval, num_eval + num_sft
    return {
        "sft": problems[eval_end:sft_end],
        "rl": problems[sft_end : sft_end + num_rl],
        "eval": problems[:eval_end],
    }


def sft_rows(problems: list[tuple[int, int]]) -> list[dict]:
    """{"text": "a+b=c"} rows: the SFT corpus (`sft.tokenize_corpus` appends eos)."""
    return [{"text": prompt_text(a, b) + str(a + b)} for a, b in problems]


def prompt_rows(problems: list[tuple[int, int]]) -> list[dict]:
    """{"prompt": "a+b=", "answer": "c"} rows: RL prompts and eval problems (the answer is for the checker)."""
    return [{"prompt": prompt_text(a, b), "answer": str(a + b)} for a, b in problems]


def world_splits(seed: int, num_sft: int = 800, num_rl: int = 4000, num_eval: int = 200) -> dict[str, list[dict]]:
    """The rows of every split: {"sft": text rows, "rl": prompt rows, "eval": prompt rows}."""
    problems = split_problems(seed, num_sft=num_sft, num_rl=num_rl, num_eval=num_eval)
    return {"sft": sft_rows(problems["sft"]), "rl": prompt_rows(problems["rl"]), "eval": prompt_rows(problems["eval"])}
