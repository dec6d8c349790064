"""Tool calls in a chat template's words: reading the calls out of a model turn, the token ids of the tools' turn
that follow it, and whether a template can carry a tool episode at all.

A model turn is parsed by the tokenizer's own `parse_response` when it has a response template (transformers'
response parsing, what TRL sets for the templates it knows); otherwise by the Hermes format that Qwen2.5, Qwen3,
Hermes and the demo's calculator world write: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
the rest of the turn its content. A turn whose calls do not parse is plain content, as TRL's `parse_response`
falls back to, and ends the episode.

The tools' turn is cut from the template exactly as TRL 1.16's `_get_tool_suffix_ids` cuts it: a dummy user turn
and an assistant turn calling the first tool, rendered without and with the tool messages (the second with the
generation prompt); the first cut after its last eos; the rest of the second are the ids appended to the episode.
That needs a prefix-preserving template (an earlier turn rendered the same whatever follows), which
`tool_template_problem` checks up front.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from contextlib import contextmanager

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _ids(tokenizer, messages: list[dict], kwargs: dict, **flags) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **flags, **kwargs)
    return list(out)


def _dummy_call(name: str) -> list[dict]:
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]


def tool_suffix_ids(tokenizer, tool_messages: list[dict], kwargs: dict | None = None) -> list[int]:
    """The token ids of `tool_messages` (role tool) as the template writes them after an assistant turn, with the
    generation prompt of the next assistant turn."""
    kwargs = kwargs or {}
    dummy = _dummy_call(tool_messages[0]["name"])
    with _quiet_transformers():  # the dummy conversation may outrun a small model's context: it is never run
        prefix = _ids(tokenizer, dummy, kwargs, add_generation_prompt=False)
        full = _ids(tokenizer, dummy + tool_messages, kwargs, add_generation_prompt=True)
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if eos:  # a template's whitespace after the end of turn (ChatML's newline) comes back with the suffix
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template rewrites the assistant turn when a tool turn follows it")
    return full[len(prefix) :]


def template_name(tokenizer) -> str:
    """How a sentence names a tokenizer's template: its model's path or name."""
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def tool_template_problem(tokenizer, kwargs: dict | None = None) -> str | None:
    """Why the tokenizer's chat template cannot carry tool episodes, in words that end a sentence; None when it can.

    It must render a call and its answer (TRL's `supports_tool_calling` test), keep earlier turns as they were
    when later ones follow (prefix-preserving, as `tool_suffix_ids` needs), and have a way to read calls back."""
    name = template_name(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        return f"the tokenizer of {name} has no chat template to write tool turns with"
    probe = {"name": "probe_tool_a8f3", "arguments": {"probe_key_b9d4": "probe_value_d6e7"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": probe}]},
        {"role": "tool", "name": probe["name"], "content": "probe_answer_c4f9"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **(kwargs or {}))
    except Exception as err:  # jinja's TemplateError, or a TypeError of a template that wants other arguments
        return f"the chat template of {name} cannot render a tool call and its answer ({type(err).__name__}: {err})"
    if not all(s in text for s in ("probe_tool_a8f3", "probe_key_b9d4", "probe_value_d6e7", "probe_answer_c4f9")):
        return f"the chat template of {name} drops tool calls or tool answers when it renders them"
    try:
        tool_suffix_ids(tokenizer, [{"role": "tool", "name": "dummy", "content": "dummy"}], kwargs)
    except ValueError:
        return (
            f"the chat template of {name} is not prefix-preserving: it rewrites earlier turns when a tool turn follows"
        )
    if not has_native_parser(tokenizer) and "<tool_call>" not in str(tokenizer.chat_template):
        return (
            f"the chat template of {name} writes tool calls in a format this pipeline cannot read back: give the "
            "tokenizer a response_template (transformers' response parsing) or use a template with <tool_call> blocks"
        )
    return None


@contextmanager
def _quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def has_native_parser(tokenizer) -> bool:
    """The tokenizer parses its own responses (transformers' response_template or legacy response_schema)."""
    return any(getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema"))


def _without_end_tokens(tokenizer, content: str) -> str:
    """Content without the special tokens a response template left at its end: the stop token that ended the turn
    when it is not the template's own end (Llama's <|end_of_text|> beside <|eot_id|>), as TRL strips eos."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    specials = [t for t in {*tokenizer.all_special_tokens, *(str(a) for a in added if a.special)} if t]
    while stripped := next((t for t in specials if content.endswith(t)), None):
        content = content.removesuffix(stripped)
    return content


def _plain(tokenizer, ids: Sequence[int]) -> dict:
    return {"role": "assistant", "content": tokenizer.decode(list(ids), skip_special_tokens=True)}


def _valid_calls(calls) -> list[dict] | None:
    """Calls as {"type": "function", "function": {"name", "arguments"}}, or None when one is malformed."""
    if not isinstance(calls, list):
        return None
    out = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return None
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, dict):
            return None
        out.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


def parse_turn(tokenizer, ids: Sequence[int], prefix: Sequence[int] | None = None, tools: list | None = None) -> dict:
    """A model turn's token ids as an assistant message: {"role", "content"} and "tool_calls" when it calls tools.
    `prefix`: the ids before the turn (a response template anchors on them); `tools`: what the turn may call."""
    if has_native_parser(tokenizer):
        try:
            if getattr(tokenizer, "response_template", None) is not None and prefix is not None:
                parsed = tokenizer.parse_response(list(ids), prefix=list(prefix), tools=tools)
            else:
                parsed = tokenizer.parse_response(list(ids))
        except (ValueError, TypeError):
            return _plain(tokenizer, ids)
        if not isinstance(parsed, dict):
            return _plain(tokenizer, ids)
        message = {"role": "assistant", "content": _without_end_tokens(tokenizer, str(parsed.get("content") or ""))}
        if parsed.get("tool_calls"):
            calls = _valid_calls(parsed["tool_calls"])
            if calls is None:
                return _plain(tokenizer, ids)
            message["tool_calls"] = calls
        return message
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    blocks = HERMES_CALL.findall(text)
    if not blocks:
        return {"role": "assistant", "content": text}
    try:
        calls = _valid_calls([json.loads(block) for block in blocks])
    except json.JSONDecodeError:
        calls = None
    if calls is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": HERMES_CALL.sub("", text).strip(), "tool_calls": calls}


def transcript_events(transcript: list[dict]) -> list[str]:
    """An episode as a reader follows it, one entry per event: what the model said, each call it made
    (`-> name {"arg": value}`), each tool's answer (`<- name: answer`)."""
    events = []
    for message in transcript:
        if message.get("role") == "tool":
            events.append(f"<- {message.get('name', 'tool')}: {message.get('content', '')}")
            continue
        if str(message.get("content") or "").strip():
            events.append(str(message["content"]).strip())
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            events.append(f"-> {function.get('name')} {json.dumps(function.get('arguments', {}), sort_keys=True)}")
    return events


def transcript_text(transcript: list[dict]) -> str:
    """An episode as text, one line per event (`transcript_events`): what a judge or a served scorer reads."""
    return "\n".join(transcript_events(transcript))


# between the events of a transcript on one line: a table shows a cell's first line only (MLflow's logged tables
# give each row one line's height), and the first line of an episode is its call
EVENT_SEPARATOR = " ⏎ "
# said wherever transcripts are shown (the pipeline's summary, the console, the stage run's description)
TRANSCRIPT_LEGEND = (
    "Tool episodes: -> is a call the model made (the tool and its arguments), <- the tool's answer, "
    "⏎ the next event; the last part is the model's final answer."
)


def transcript_line(transcript: list[dict]) -> str:
    """An episode on one line, its events (`transcript_events`) between EVENT_SEPARATOR: what a table cell shows."""
    return EVENT_SEPARATOR.join(transcript_events(transcript))


def holds_transcripts(rows: Sequence[dict]) -> bool:
    """Whether evaluation rows are tool episodes' (their `tool_calls` column): a table of them needs the legend."""
    return any("tool_calls" in row for row in rows)
