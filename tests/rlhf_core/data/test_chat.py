import pytest
from trl.data_utils import extract_prompt as trl_extract_prompt
from trl.data_utils import maybe_apply_chat_template

from rlhf_core.data.chat import (
    assistant_messages,
    detect_format,
    encode,
    end_at_turn_end,
    extract_prompt,
    message_problem,
    render_completions,
    render_messages,
    render_prompt,
    supply_chat_template,
)
from rlhf_core.models.loading import load_tokenizer
from tests.fixtures.real_shapes import CHATML_TEMPLATE, build_family

USER = [{"role": "user", "content": "Hi"}]
HELLO = [{"role": "assistant", "content": "Hello"}]
BYE = [{"role": "assistant", "content": "Bye"}]
CHATML_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
CHATML_PROMPT = CHATML_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
LLAMA_PROMPT = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        name: load_tokenizer(str(build_family(name, root))) for name in ("qwen2.5-instruct", "llama-3-instruct", "gpt2")
    }


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"prompt": "The sky is"}, "standard"),
        ({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, "standard"),
        ({"text": "The sky is blue."}, "standard"),
        ({"prompt": USER}, "conversational"),
        ({"prompt": USER, "chosen": HELLO, "rejected": BYE}, "conversational"),
        ({"chosen": USER + HELLO, "rejected": USER + BYE}, "conversational"),
        ({"messages": USER + HELLO}, "conversational"),
        ({"prompt": USER, "completion": HELLO}, "conversational"),
    ],
)
def test_detect_format_as_trl(row, expected):
    assert detect_format(row) == expected


def test_prompt_gets_the_generation_prompt(tokenizers):
    assert render_prompt(tokenizers["qwen2.5-instruct"], USER) == CHATML_PROMPT
    assert render_prompt(tokenizers["llama-3-instruct"], USER) == LLAMA_PROMPT


def test_an_assistant_turn_at_the_end_of_a_prompt_is_continued(tokenizers):
    text = render_prompt(tokenizers["qwen2.5-instruct"], USER + [{"role": "assistant", "content": "Well,"}])
    assert text == CHATML_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nWell,"


def test_preference_completions_are_the_conversation_minus_the_prompt(tokenizers):
    prompt, (chosen, rejected) = render_completions(tokenizers["qwen2.5-instruct"], USER, [HELLO, BYE])
    assert (prompt, chosen, rejected) == (CHATML_PROMPT, "Hello<|im_end|>\n", "Bye<|im_end|>\n")
    prompt, (chosen, rejected) = render_completions(tokenizers["llama-3-instruct"], USER, [HELLO, BYE])
    assert (prompt, chosen, rejected) == (LLAMA_PROMPT, "Hello<|eot_id|>", "Bye<|eot_id|>")


def test_messages_render_the_whole_conversation(tokenizers):
    text = render_messages(tokenizers["qwen2.5-instruct"], USER + HELLO)
    assert text == CHATML_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    # training text ends at the turn's end, where generation stops
    assert end_at_turn_end(text).endswith("Hello<|im_end|>")


def test_chat_template_kwargs_reach_the_template(tokenizers):
    tok = tokenizers["qwen2.5-instruct"]
    saved = tok.chat_template
    tok.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        assert render_prompt(tok, USER, {"greeting": "Yo "}) == "Yo Hi"
    finally:
        tok.chat_template = saved


@pytest.mark.parametrize(
    "chosen, rejected",
    [
        (USER + HELLO, USER + BYE),
        ("The sky is blue.", "The sky is green."),
    ],
)
def test_implicit_prompt_is_extracted_as_trl(chosen, rejected):
    expected = trl_extract_prompt({"chosen": chosen, "rejected": rejected})
    assert extract_prompt(chosen, rejected) == (expected["prompt"], expected["chosen"], expected["rejected"])


@pytest.mark.parametrize("family", ["qwen2.5-instruct", "llama-3-instruct"])
@pytest.mark.parametrize(
    "row",
    [
        {"prompt": USER},
        {"prompt": USER, "chosen": HELLO, "rejected": BYE},
        {"prompt": USER, "completion": HELLO},
        {"prompt": [{"role": "system", "content": "Be brief."}] + USER, "chosen": HELLO, "rejected": BYE},
    ],
)
def test_templated_text_equals_trls(tokenizers, family, row):
    tok = tokenizers[family]
    expected = maybe_apply_chat_template(row, tok)
    completions = [row[k] for k in ("chosen", "rejected", "completion") if k in row]
    prompt, texts = (
        render_completions(tok, row["prompt"], completions) if completions else (render_prompt(tok, row["prompt"]), [])
    )
    assert prompt == expected["prompt"]
    assert texts == [expected[k] for k in ("chosen", "rejected", "completion") if k in row]


def test_messages_equal_trls_text(tokenizers):
    tok = tokenizers["llama-3-instruct"]
    assert render_messages(tok, USER + HELLO) == maybe_apply_chat_template({"messages": USER + HELLO}, tok)["text"]


def test_templated_text_gets_no_second_bos_and_plain_text_is_unchanged(tokenizers):
    tok = tokenizers["llama-3-instruct"]
    templated = render_prompt(tok, USER)
    ids = encode(tok, [templated, "Tell me about the cat."])
    assert ids[0] == tok(templated, add_special_tokens=False)["input_ids"]
    assert ids[0].count(tok.bos_token_id) == 1
    assert ids[1] == tok(["Tell me about the cat."])["input_ids"][0]
    assert encode(tok, ["a b", "c"]) == tok(["a b", "c"])["input_ids"]


def test_supply_chat_template_from_a_string_or_a_file(tokenizers, tmp_path):
    tok = tokenizers["gpt2"]
    supply_chat_template(tok, CHATML_TEMPLATE)
    assert tok.chat_template == CHATML_TEMPLATE
    tok.chat_template = None
    (tmp_path / "t.jinja").write_text(CHATML_TEMPLATE)
    supply_chat_template(tok, str(tmp_path / "t.jinja"))
    assert render_prompt(tok, USER) == CHATML_PROMPT
    supply_chat_template(tok, "{{ 'other' }}")  # a tokenizer's own template wins
    assert tok.chat_template == CHATML_TEMPLATE
    tok.chat_template = None


@pytest.mark.parametrize(
    "value, problem",
    [
        ("text", "holds str, not a non-empty list of messages"),
        ([], "holds list, not a non-empty list of messages"),
        ([{"content": "x"}], "message 0 is not an object with a string `role`"),
        ([{"role": "user"}], "message 0 has no string `content`"),
    ],
)
def test_message_problems(value, problem):
    assert message_problem(value) == problem
    assert message_problem(USER) is None


def test_assistant_messages():
    assert assistant_messages(["a"]) == [[{"role": "assistant", "content": "a"}]]


@pytest.mark.parametrize(
    ("prompt", "full", "shared"),
    [
        (
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n",
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        ),
        # a template that renders the generation prompt differently from the finished turn (DeepSeek-R1's <think>)
        ("User: Hi\nAssistant: <think>\n", "User: Hi\nAssistant: Hello", "User: Hi\nAssistant: "),
        ("abc", "", ""),
    ],
)
def test_the_shared_prefix_of_a_prompt_and_its_conversation(prompt, full, shared):
    from rlhf_core.data.chat import _common_prefix

    assert _common_prefix(prompt, full) == shared


def test_shown_prompt_keeps_the_users_text_of_a_templated_prompt():
    from rlhf_core.data.chat import shown_prompt

    assert shown_prompt("<bos><|im_start|>user\nthe movie was<|im_end|>\n<|im_start|>assistant\n") == "the movie was"
    assert shown_prompt("<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>") == "Hi there"
    assert shown_prompt("plain text prompt") == "plain text prompt"
    assert shown_prompt("<bos><user>456*789=<eos><assistant>") == "456*789="  # the calculator world's template


def test_final_answer_is_the_last_assistant_message_of_a_transcript():
    from rlhf_core.data.chat import final_answer

    transcript = [
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "name": "f", "content": "42"},
        {"role": "assistant", "content": "The answer is 42"},
    ]
    assert final_answer(transcript) == "The answer is 42"
    assert final_answer("plain") == "plain" and final_answer([{"role": "tool", "content": "1"}]) == ""
