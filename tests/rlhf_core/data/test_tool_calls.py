"""Reading tool calls out of a model turn, the tool turn's ids, and refusing templates that cannot carry episodes."""

from __future__ import annotations

from rlhf_core.data.tool_calls import (
    TRANSCRIPT_LEGEND,
    holds_transcripts,
    parse_turn,
    tool_suffix_ids,
    tool_template_problem,
    transcript_line,
    transcript_text,
)
from rlhf_core.demo.calculator import build_calculator_tokenizer

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 456, "b": 789}}</tool_call>'


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_a_hermes_call_parses_into_an_assistant_message():
    tok = build_calculator_tokenizer(64)
    message = parse_turn(tok, ids(tok, CALL))
    assert message == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 456, "b": 789}}}],
    }
    assert parse_turn(tok, ids(tok, "359784")) == {"role": "assistant", "content": "359784"}


def test_a_malformed_call_is_plain_content():
    tok = build_calculator_tokenizer(64)
    broken = '<tool_call>{"name": "multiply", "arguments": {"a": 45}</tool_call>'  # a brace short
    message = parse_turn(tok, ids(tok, broken))
    assert "tool_calls" not in message and message["content"].startswith("<tool_call>")


def test_the_tool_turn_is_the_templates_suffix():
    tok = build_calculator_tokenizer(64)
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "359784"}])
    assert tok.convert_ids_to_tokens(suffix) == ["<tool>", "3", "5", "9", "7", "8", "4", "<eos>", "<assistant>"]


def test_templates_that_cannot_carry_episodes_are_named():
    tok = build_calculator_tokenizer(64)
    assert tool_template_problem(tok) is None
    tok.name_or_path = "my/model"
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert (
        tool_template_problem(tok)
        == "the chat template of my/model drops tool calls or tool answers when it renders them"
    )
    # marks the last turn: an assistant turn is written one way alone and another once a tool turn follows it
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if m['tool_calls'] %}<tool_call>{{ m['tool_calls'] | tojson }}"
        "</tool_call>{% endif %}{% if loop.last %}={% endif %}{{ eos_token }}{% endfor %}"
    )
    assert "is not prefix-preserving" in tool_template_problem(tok)
    tok.chat_template = None
    assert "has no chat template" in tool_template_problem(tok)


def test_transcript_text_reads_like_the_episode():
    transcript = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "name": "f", "content": "2"},
        {"role": "assistant", "content": "2"},
    ]
    assert transcript_text(transcript) == '-> f {"a": 1}\n<- f: 2\n2'
    # a table shows a cell's first line only: there the whole episode is one line, its events apart
    assert transcript_line(transcript) == '-> f {"a": 1} ⏎ <- f: 2 ⏎ 2'
    assert "->" in TRANSCRIPT_LEGEND and "<-" in TRANSCRIPT_LEGEND and "\n" not in TRANSCRIPT_LEGEND


def test_rows_of_tool_episodes_are_told_by_their_tool_calls_column():
    assert holds_transcripts([{"completion": "2"}, {"completion": "-> f {}", "tool_calls": 1}])
    assert not holds_transcripts([{"completion": "-> not a call"}]) and not holds_transcripts([])
