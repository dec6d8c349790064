"""TRL's dataset formats and chat templates: detect a row's format, turn conversational rows into text.

TRL's types (https://huggingface.co/docs/trl/dataset_formats) map onto the pipeline's three kinds:
preference (explicit or implicit prompt), prompt-only, and SFT text (text, prompt/completion, messages).
A row is conversational when one of its fields holds a list of messages ({"role": ..., "content": ...}),
as `trl.data_utils.is_conversational` decides; the template is applied as `trl.data_utils.apply_chat_template`
does, so prompts end with the generation prompt and prompt + completion is the whole templated conversation.
"""

from __future__ import annotations

import re
from itertools import takewhile
from typing import Any, Literal

from rlhf_core.config.errors import UserError

Format = Literal["standard", "conversational"]
CONVERSATIONAL_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
# the column a conversational prompt table keeps its original messages in (reward functions receive them)
PROMPT_MESSAGES = "prompt_messages"

ACCEPTED = {
    "preference": "preference with an explicit prompt (prompt, chosen, rejected) or an implicit one "
    "(chosen, rejected), each either strings (standard) or lists of {role, content} messages (conversational)",
    "prompt": "prompt-only (prompt), a string (standard) or a list of {role, content} messages (conversational)",
    "text": "language modeling (text: a string, or messages: a list of {role, content} messages) or "
    "prompt-completion (prompt, completion: strings or message lists)",
}


def is_message_list(value: Any) -> bool:
    """A conversational value: a non-empty list whose first item is a dict with a role (TRL's test)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def detect_format(row: dict[str, Any]) -> Format:
    """'conversational' when one of TRL's keys holds a message list (as `trl.data_utils.is_conversational`)."""
    return "conversational" if any(is_message_list(row.get(k)) for k in CONVERSATIONAL_KEYS) else "standard"


def message_problem(value: Any) -> str | None:
    """Why `value` is not a list of {role, content} messages with string roles and contents; None when it is."""
    if not isinstance(value, list) or not value:
        return f"holds {type(value).__name__ if value is not None else 'no value'}, not a non-empty list of messages"
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            return f"message {j} is not an object with a string `role`"
        if not isinstance(msg.get("content"), str):
            return f"message {j} has no string `content`"
    return None


def shown_prompt(prompt: str) -> str:
    """A templated prompt as a reader wants it: the text of its turns, without special tokens or role lines
    (`<bos><|im_start|>user\\nthe movie was<|im_end|>...` -> `the movie was`); plain text passes unchanged."""
    text = re.sub(r"<\|[^|>]+\|>|<bos>|<eos>|<s>|</s>|<user>|<assistant>|<system>|<tool>", "\n", prompt)
    lines = [line.strip() for line in text.splitlines()]
    return " ".join(line for line in lines if line and line not in ("user", "assistant", "system"))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _template(tokenizer, messages: list[dict], kwargs: dict, tools: list | None = None, **flags) -> str:
    # tools or None: some templates (Llama 3) write their tool boilerplate for an empty list
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **flags, **kwargs)


def render_prompt(tokenizer, prompt: list[dict], kwargs: dict | None = None, tools: list | None = None) -> str:
    """The templated prompt: the generation prompt added after a user or tool turn, an assistant turn continued.
    `tools` (callables or JSON schemas): what the template shows the model it may call (grpo.tools)."""
    last = prompt[-1]["role"]
    if last in ("user", "tool"):
        flags = {"add_generation_prompt": True, "continue_final_message": False}
    elif last == "assistant":
        flags = {"add_generation_prompt": False, "continue_final_message": True}
    else:
        raise UserError(f"the last message of a prompt has role '{last}'; it must be user, tool or assistant")
    return _template(tokenizer, prompt, kwargs or {}, tools, **flags)


def _common_prefix(a: str, b: str) -> str:
    if b.startswith(a):  # the usual case (the prompt's template is a prefix of the conversation's), in C
        return a
    return "".join(x for x, _ in takewhile(lambda x: x[0] == x[1], zip(a, b)))


def render_completions(
    tokenizer, prompt: list[dict], completions: list[list[dict]], kwargs: dict | None = None
) -> tuple[str, list[str]]:
    """(templated prompt, each completion's text): the template of prompt + completion minus the prompt's,
    the prompt cut to what every full conversation shares (TRL's DeepSeek-R1 guard; usually a no-op)."""
    kwargs = kwargs or {}
    text = render_prompt(tokenizer, prompt, kwargs)
    full = [_template(tokenizer, prompt + c, kwargs) for c in completions]
    for f in full:
        text = _common_prefix(text, f)
    return text, [f[len(text) :] for f in full]


def render_messages(tokenizer, messages: list[dict], kwargs: dict | None = None) -> str:
    """A whole conversation as text (SFT messages, implicit-prompt preference completions)."""
    return _template(tokenizer, messages, kwargs or {})


def extract_prompt(chosen, rejected) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) from an implicit-prompt pair: the longest shared prefix (messages or
    characters), as `trl.data_utils.extract_prompt`, which also leaves a separating space to the completions."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def end_at_turn_end(text: str) -> str:
    """A templated conversation or completion without the whitespace a template writes after the last
    turn's end (ChatML's '<|im_end|>\\n'): generation stops at the end token, so training sequences end
    there too. The reward model is then read, and SFT's eos appended (or not, when it is the end token),
    right after it. (TRL keeps the whitespace; it is a token of its own in byte-level vocabularies.)"""
    return text.rstrip()


def encode(tokenizer, texts: list[str], **kwargs) -> list[list[int]]:
    """Token ids of `texts`; a text that starts with the tokenizer's bos (a chat template wrote it) is
    encoded without special tokens, as TRL encodes templated text, so bos is not doubled. Other texts
    are encoded exactly as `tokenizer(texts, **kwargs)` does."""
    bos = getattr(tokenizer, "bos_token", None)
    templated = [bool(bos) and t.startswith(bos) for t in texts]
    if not any(templated):
        return list(tokenizer(texts, **kwargs)["input_ids"])
    out: list[list[int] | None] = [None] * len(texts)
    for flag in (False, True):
        idx = [i for i, t in enumerate(templated) if t == flag]
        if not idx:
            continue
        extra = {"add_special_tokens": False} if flag else {}
        ids = tokenizer([texts[i] for i in idx], **{**kwargs, **extra})["input_ids"]
        for i, seq in zip(idx, ids):
            out[i] = list(seq)
    return out  # type: ignore[return-value]


def assistant_messages(completions: list[str]) -> list[list[dict[str, str]]]:
    """Completions as TRL hands them to reward functions for conversational prompts."""
    return [[{"role": "assistant", "content": c}] for c in completions]


def prompt_columns(rows: list[dict]) -> tuple[list[str], list[list[dict]] | None]:
    """(templated prompts, their message lists or None) of prompt-table rows: what generation reads and what
    reward and metric functions receive (message lists for a conversational table, as TRL hands them)."""
    messages = [row[PROMPT_MESSAGES] for row in rows] if rows and PROMPT_MESSAGES in rows[0] else None
    return [row["prompt"] for row in rows], messages


def extra_columns(rows: list[dict]) -> dict[str, list]:
    """The prompt rows' other dataset columns, by name: reward and metric functions' keyword arguments."""
    names = [k for k in (rows[0] if rows else {}) if k not in ("prompt", PROMPT_MESSAGES)]
    return {k: [row.get(k) for row in rows] for k in names}


def completion_text(completion: str | list[dict]) -> str:
    """A completion as text: itself, or the contents of a conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    return " ".join(str(m.get("content", "")) for m in completion)


def final_answer(completion: str | list[dict]) -> str:
    """What a completion finally answers: itself, or the content of its last assistant message (a tool episode's
    transcript ends with the model's answer after the tools' turns)."""
    if isinstance(completion, str):
        return completion
    said = [m for m in completion if m.get("role") == "assistant"]
    return str(said[-1].get("content", "")) if said else ""


def supply_chat_template(tokenizer, template: str | None) -> None:
    """Give `tokenizer` the template of model.chat_template (a file path or the template itself) when it has none."""
    from pathlib import Path

    if not template or has_chat_template(tokenizer):
        return
    path = Path(template).expanduser()
    is_file = len(template) < 4096 and "\n" not in template and "{" not in template and path.is_file()
    tokenizer.chat_template = path.read_text(encoding="utf-8") if is_file else template
