"""Stop tokens and pads of four real model families, on offline stand-ins of their checkouts.

The fixtures (tests/fixtures/real_shapes.py) copy what decides how a response ends: Qwen2.5 base
(pad == eos), Qwen2.5-Instruct and Llama-3-Instruct (two stop ids in generation_config; Llama has
no pad), GPT-2 (bos == eos, no pad). Pinned here: each family's special-token layout, the stop ids
`stop_token_ids` takes from generation_config, the tokenizer and rl.stop_token(s), the one-sentence errors
for stop tokens, pads and eos that do not exist (before the first training step), and the exported
generation_config keeping every stop id.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, GenerationConfig

from rlhf_core.config import GRPOConfig, PPOConfig, RLConfig, RunConfig
from rlhf_core.models.loading import ModelSourceError, load_causal_lm, load_tokenizer, stop_token_ids
from rlhf_core.rl.inputs import rl_inputs
from tests.fixtures.real_shapes import (
    FAMILIES,
    TokenCountReward,
    build_family,
    build_without_special_tokens,
    family,
    is_chat,
    prompts_and_answers,
)
from tests.integration.real_shapes_common import ids_of, load

pytestmark = pytest.mark.usefixtures("one_thread")

INSTRUCT = [f for f in FAMILIES if is_chat(family(f))]


def one_sentence(message: str) -> bool:
    return "\n" not in message and message.strip() == message and message.replace("e.g. ", "").count(". ") == 0


RAW = {  # as the hub checkouts ship them: (tokenizer class, eos, pad, bos), before load_tokenizer borrows a pad
    "qwen2.5": ("Qwen2Tokenizer", "<|endoftext|>", "<|endoftext|>", None),
    "qwen2.5-instruct": ("Qwen2Tokenizer", "<|im_end|>", "<|endoftext|>", None),
    "llama-3-instruct": ("TokenizersBackend", "<|eot_id|>", None, "<|begin_of_text|>"),  # PreTrainedTokenizerFast in v5
    "gpt2": ("GPT2Tokenizer", "<|endoftext|>", None, "<|endoftext|>"),
}


EXPECTED = {  # (stop tokens in order, pad token after load_tokenizer, generation_config eos is a list)
    "qwen2.5": (["<|endoftext|>"], "<|endoftext|>", False),
    "qwen2.5-instruct": (["<|im_end|>", "<|endoftext|>"], "<|endoftext|>", True),
    "llama-3-instruct": (["<|end_of_text|>", "<|eot_id|>"], "<|eot_id|>", True),
    "gpt2": (["<|endoftext|>"], "<|endoftext|>", False),
}


FOREIGN = {
    "qwen2.5": "<|eot_id|>",
    "qwen2.5-instruct": "<|eot_id|>",
    "llama-3-instruct": "<|im_end|>",
    "gpt2": "<|im_end|>",
}


@pytest.mark.parametrize("name", FAMILIES)
def test_fixtures_have_the_families_special_token_layout(family_root, name):
    path = build_family(name, family_root)
    raw = AutoTokenizer.from_pretrained(path)
    assert (type(raw).__name__, raw.eos_token, raw.pad_token, raw.bos_token) == RAW[name]
    specials = family(name).specials
    assert ids_of(raw, specials) == list(range(len(raw) - len(specials), len(raw)))  # after the ordinary vocabulary
    model = load_causal_lm(str(path))
    assert (
        model.config.vocab_size >= len(raw)
        and type(model).__name__
        == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[family(name).arch]
    )
    assert (raw.chat_template is not None) == (name != "gpt2")
    if name == "llama-3-instruct":
        assert raw("hi")["input_ids"][0] == raw.bos_token_id  # the tokenizer prepends <|begin_of_text|>
    else:
        assert raw.bos_token_id not in raw("hi")["input_ids"] or raw.bos_token_id is None


@pytest.mark.parametrize("name", FAMILIES)
def test_stop_token_ids_come_from_generation_config_and_tokenizer(family_root, name):
    tok, model = load(family_root, name)
    stops, pad, is_list = EXPECTED[name]
    assert tok.pad_token == pad  # Qwen ships pad; Llama 3 and GPT-2 borrow eos (load_tokenizer)
    gen = model.generation_config
    assert isinstance(gen.eos_token_id, list) == is_list
    assert stop_token_ids(tok, gen) == tuple(ids_of(tok, stops))
    # the pad id plays no part: equal to a stop id in every one of these families once loaded
    assert tok.pad_token_id in stop_token_ids(tok, gen)
    # without a generation config the tokenizer's eos alone
    assert stop_token_ids(tok, None) == (tok.eos_token_id,)
    assert stop_token_ids(tok, gen, stop_token="none") == ()
    # a named stop, and more stops added without repeats
    extra = "<|im_end|>" if name.startswith("qwen") else stops[-1]
    assert stop_token_ids(tok, gen, stop_token=extra) == (tok.convert_tokens_to_ids(extra),)
    assert stop_token_ids(tok, gen, stop_tokens=[stops[0], extra]) == tuple(dict.fromkeys(ids_of(tok, [*stops, extra])))


def test_qwen_base_can_stop_on_im_end_too(family_root):
    """Qwen2.5 base knows the ChatML tokens although its eos is <|endoftext|>: rl.stop_tokens adds one."""
    tok, model = load(family_root, "qwen2.5")
    assert stop_token_ids(tok, model.generation_config, stop_tokens=["<|im_end|>"]) == tuple(
        ids_of(tok, ["<|endoftext|>", "<|im_end|>"])
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_a_stop_token_the_tokenizer_does_not_know_is_named(family_root, name):
    tok, model = load(family_root, name)
    gen = model.generation_config
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_tokens\[0\]: '" + FOREIGN[name].replace("|", r"\|")) as err:
        stop_token_ids(tok, gen, stop_tokens=[FOREIGN[name]])
    assert one_sentence(str(err.value))
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_tokens\[1\]"):
        stop_token_ids(tok, gen, stop_tokens=[tok.eos_token, FOREIGN[name]])
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_token: ") as err:
        stop_token_ids(tok, gen, stop_token=FOREIGN[name])
    assert one_sentence(str(err.value))


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_an_unknown_stop_token_stops_training_before_the_first_step(family_root, tmp_path, algorithm):
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo
    from rlhf_core.rl.ppo import train_ppo

    tok, policy = load(family_root, "llama-3-instruct")
    prompts = [q for q, _ in prompts_and_answers()]
    rl = RLConfig(algorithm=algorithm, total_steps=1, batch_size=4, response_length=4, stop_tokens=["<|im_end|>"])
    steps = []
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_tokens\[0\]: '<\|im_end\|>' is not a token") as err:
        if algorithm == "ppo":
            _, ref = load(family_root, "llama-3-instruct")
            train_ppo(
                rl_inputs(
                    policy,
                    tok,
                    prompts,
                    tmp_path / "out",
                    value=TokenCountReward(),
                    reference=ref,
                    reward_model=TokenCountReward(),
                    rl=rl,
                    ppo=PPOConfig(),
                    run=RunConfig(device="cpu"),
                    max_prompt_length=16,
                    on_step=steps.append,
                    show_progress=False,
                )
            )
        else:
            reward = function_reward("len", 1.0, lambda prompts, completions, **_: [float(len(c)) for c in completions])
            train_grpo(
                rl_inputs(
                    policy,
                    tok,
                    [{"prompt": p} for p in prompts],
                    tmp_path / "out",
                    reference=None,
                    rewards=[reward],
                    rl=rl,
                    grpo=GRPOConfig(num_generations=2),
                    run=RunConfig(device="cpu"),
                    max_prompt_length=16,
                    on_step=steps.append,
                    show_progress=False,
                )
            )
    assert one_sentence(str(err.value))
    assert steps == [] and not list(tmp_path.glob("out/checkpoint-*"))


def test_a_tokenizer_with_neither_pad_nor_eos_fails_to_load(tmp_path):
    path = build_without_special_tokens(tmp_path)
    raw = AutoTokenizer.from_pretrained(path)
    assert raw.pad_token is None and raw.eos_token is None
    with pytest.raises(ModelSourceError, match="has no pad token and no eos token to borrow") as err:
        load_tokenizer(str(path))
    assert "\n" not in str(err.value)


def test_stop_token_eos_with_no_eos_anywhere_is_named(tmp_path):
    """A tokenizer with a pad but no eos, and a model whose configs name none: 'eos' cannot work."""
    path = build_without_special_tokens(tmp_path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = "<|endoftext|>"  # the fixture's only special token, here a pad and nothing more
    gen = load_causal_lm(str(path)).generation_config
    assert gen.eos_token_id is None and tok.eos_token_id is None
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_token is 'eos' but neither") as err:
        stop_token_ids(tok, gen)
    assert "\n" not in str(err.value)
    assert stop_token_ids(tok, gen, stop_token="none") == ()
    assert stop_token_ids(tok, gen, stop_token="<|endoftext|>") == (tok.pad_token_id,)


def test_an_unknown_stop_text_with_a_newline_is_reported_on_one_line(family_root):
    """A stop text holding a newline (here two words, no single token under any lookup) is quoted as a
    Python literal, so the one-sentence error stays on one line."""
    tok, model = load(family_root, "gpt2")
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_tokens\[0\]") as err:
        stop_token_ids(tok, model.generation_config, stop_tokens=["the end\n"])
    assert "\n" not in str(err.value)


def test_a_stop_token_written_as_its_text_is_found_in_a_byte_level_vocabulary(family_root):
    """GPT-2, Qwen and Llama 3 use byte-level BPE, whose vocabulary spells a newline 'Ċ' and a leading
    space 'Ġ'. rl.stop_tokens: ["\\n"] (stop at the end of a line, a common choice for GPT-2
    completions) is one token of the tokenizer: found by encoding the text when it is not a vocabulary
    key; either spelling works."""
    tok, model = load(family_root, "gpt2")
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1 and tok.convert_ids_to_tokens(newline) == ["Ċ"]
    assert stop_token_ids(tok, model.generation_config, stop_tokens=["Ċ"]) == (tok.eos_token_id, newline[0])
    assert stop_token_ids(tok, model.generation_config, stop_tokens=["\n"]) == (tok.eos_token_id, newline[0])


@pytest.mark.parametrize("name", INSTRUCT)
def test_exported_generation_config_keeps_every_stop_id(family_root, name):
    """The exported generation_config keeps every id the run stopped on (both ids of an instruct model,
    and rl.stop_tokens), so transformers' generate, and a later RL run from the export, stop as the
    trained policy learned to; not the tokenizer's eos alone."""
    from rlhf_core.models.export import generation_settings

    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    base = model.generation_config.to_diff_dict()
    settings = generation_settings(tokenizer=tok, max_new_tokens=8, stop_token_ids=stops, base_defaults=base)
    exported = GenerationConfig(**settings)
    assert len(stops) == 2 and set(stop_token_ids(tok, exported)) == set(stops)
    # the base's own inference defaults, not RL's sampling settings
    for key in ("do_sample", "temperature", "top_p", "top_k"):
        assert getattr(exported, key) == getattr(model.generation_config, key)
