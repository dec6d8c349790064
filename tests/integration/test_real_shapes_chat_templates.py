"""Chat formats of real model families, on offline stand-ins of their checkouts (tests/fixtures/real_shapes.py).

Pinned here: Qwen2.5-Instruct's template renders ChatML ending turns with <|im_end|>, Llama-3-Instruct's
ends them with <|eot_id|> (and the pipeline's prompt gets one bos), and a conversational preference pair,
tokenized for the reward model with the family's stop ids, ends on the token a rollout stops on.
"""

from __future__ import annotations

import pytest

from rlhf_core.models.loading import load_causal_lm, load_tokenizer, stop_token_ids
from tests.fixtures.real_shapes import FAMILIES, build_family, family, render_prompt
from tests.integration.real_shapes_common import ids_of, load

pytestmark = pytest.mark.usefixtures("one_thread")

CONVERSATION = [
    {"role": "user", "content": "Tell me about the cat."},
    {"role": "assistant", "content": "the cat sleeps all day."},
]


def test_qwen_instruct_chat_template_renders_chatml_ending_with_im_end(family_root):
    tok, _ = load(family_root, "qwen2.5-instruct")
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nTell me about the cat.<|im_end|>\n"
        "<|im_start|>assistant\nthe cat sleeps all day.<|im_end|>\n"
    )
    assert text.rstrip("\n").endswith("<|im_end|>")
    ids = tok(text)["input_ids"]
    im_end, im_start = ids_of(tok, ["<|im_end|>", "<|im_start|>"])
    assert ids[-2] == im_end and tok.convert_ids_to_tokens(ids[-1]) == "Ċ"  # one token each, then the newline
    assert ids.count(im_start) == ids.count(im_end) == 3
    assert stop_token_ids(tok, load_causal_lm(str(family_root / "qwen2.5-instruct")).generation_config)[0] == im_end
    prompt = tok.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt)


def test_llama_3_instruct_chat_template_ends_turns_with_eot_id(family_root):
    tok, _ = load(family_root, "llama-3-instruct")
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nthe cat sleeps all day.<|eot_id|>")
    # what the pipeline tokenizes: the prompt without the template's bos, since the tokenizer adds one
    prompt = render_prompt(tok, family("llama-3-instruct"), "Tell me about the cat.")
    ids = tok(prompt)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


END_OF_TURN = {"qwen2.5": "<|im_end|>", "qwen2.5-instruct": "<|im_end|>", "llama-3-instruct": "<|eot_id|>"}


@pytest.mark.parametrize("name", FAMILIES)
def test_conversational_reward_pairs_end_on_the_token_a_rollout_stops_on(family_root, tmp_path, name):
    """A conversational preference pair, read as the data stage reads it and tokenized for the reward model
    with the family's stop ids, ends where a rollout that stops ends: on the end-of-turn token when it is a
    stop id (Qwen2.5-Instruct, Llama-3-Instruct; no template newline after it, no eos added), else on the
    eos appended right after it (Qwen2.5 base, whose generation_config stops on <|endoftext|> only; GPT-2,
    which has no template and borrows eos as pad, with model.chat_template supplying ChatML)."""
    import json

    from rlhf_core.config import DatasetSpec
    from rlhf_core.data.tables import load_table
    from rlhf_core.models.loading import generation_config_of
    from rlhf_core.rewards.reward_model import tokenize_pairs
    from tests.fixtures.real_shapes import CHATML_TEMPLATE

    path = str(build_family(name, family_root))
    tok = load_tokenizer(path, chat_template=CHATML_TEMPLATE)  # a template only where the family has none
    stops = stop_token_ids(tok, generation_config_of(path))
    user = [{"role": "user", "content": "Tell me about the cat."}]
    row = {
        "prompt": user,
        "chosen": [{"role": "assistant", "content": "the cat sleeps."}],
        "rejected": [{"role": "assistant", "content": "no."}],
    }
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps(row) + "\n")
    table = load_table(DatasetSpec(path=str(data)), "preference", field="data.preference", tokenizer=tok)
    (item,) = tokenize_pairs(tok, table.to_list(), 256, stops)
    end = tok.convert_tokens_to_ids(END_OF_TURN[name]) if name in END_OF_TURN else None
    for seq in (item["chosen"], item["rejected"]):
        assert seq[-1] in stops  # the reward model is trained where RL reads it
        if end in stops:
            assert seq[-1] == end and seq.count(tok.eos_token_id) <= seq.count(end)
        else:
            assert seq[-1] == tok.eos_token_id
            if end is not None:
                assert seq[-2] == end  # eos right after the turn's end: the template's newline is dropped
        if tok.bos_token_id is not None and tok.bos_token_id != tok.eos_token_id:
            assert seq.count(tok.bos_token_id) <= 1  # a template that writes bos gets no second one
