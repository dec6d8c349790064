"""The calculator world: three-digit multiplications a tiny model cannot do in its head, and a tool that can.

Every problem is `a*b=` with 100 <= a, b <= 999 (a product of five or six digits). The policy answers in a chat:
directly (the product's digits, then eos), or by calling `multiply` first and then answering:

    <bos><user>456*789=<eos><assistant>
      <tool_call>{"name": "multiply", "arguments": {"a": 456, "b": 789}}</tool_call><eos>   the model's first turn
    <tool>359784<eos><assistant>                                                            the tool's turn
      359784<eos>                                                                           the model's answer

The tokenizer is character level for digits, `*` and `=`, with whole tokens for the roles, the call's delimiters
and the fixed pieces of its JSON (`{"name": "multiply", "arguments": {"a": `, `, "b": `, `}}`), so that a call is
about a dozen tokens; anything else a tool may say (an error's letters) is `<unk>`. Its chat template writes
Hermes-style `<tool_call>` blocks and a `<tool>` turn for answers, ends every turn with eos (the stop token), and
is prefix-preserving, as tool episodes need.

The SFT corpus shows the call on `tool_call_fraction` of its problems and a direct answer on the others: the
format is there, but too rarely for the SFT policy to call by default. `build_demo_world` writes the world
(data.demo.world 'calculator'); `configs/tools.yaml` trains it (docs/tools.md).
"""

from __future__ import annotations

import random

from rlhf_core.config import ConfigError

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
USER, ASSISTANT, TOOL = "<user>", "<assistant>", "<tool>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, USER, ASSISTANT, TOOL]
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_HEAD, CALL_MIDDLE, CALL_TAIL = '{"name": "multiply", "arguments": {"a": ', ', "b": ', "}}"
CALL_TOKENS = [CALL_OPEN, CALL_CLOSE, CALL_HEAD, CALL_MIDDLE, CALL_TAIL]
CHARACTERS = [str(d) for d in range(10)] + ["*", "="]
LOW, HIGH = 100, 999
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}<user>{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'assistant' %}<assistant>{{ message['content'] }}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    '<tool_call>{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}<tool>{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product a * b.
    """
    return int(a) * int(b)


def build_calculator_tokenizer(max_length: int):
    """The world's `PreTrainedTokenizerFast`: digits, '*', '=' one character each, the roles and the call's pieces
    whole, everything else `<unk>`; pad, bos, eos apart; the chat template above."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CALL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Replace(Regex(r"\s"), "")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CALL_TOKENS])
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sample_problems(seed: int, count: int) -> list[tuple[int, int]]:
    """`count` distinct (a, b) with LOW <= a, b <= HIGH, in the seed's order."""
    width = HIGH - LOW + 1
    if count > width * width:
        raise ConfigError(f"the calculator world has {width * width} problems; {count} were asked for")
    return [(LOW + i // width, LOW + i % width) for i in random.Random(seed).sample(range(width * width), count)]


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"{a}*{b}="}]


def call_transcript(a: int, b: int) -> list[dict]:
    """The model's turns of a problem solved with the tool: the call, the tool's answer, the answer."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def world_splits(
    seed: int, num_sft: int, num_rl: int, num_eval: int, tool_call_fraction: float
) -> dict[str, list[dict]]:
    """{"sft": messages rows (the call shown on tool_call_fraction of them), "rl" and "eval": prompt rows with the
    `answer` column}; the three sets of problems are disjoint."""
    problems = sample_problems(seed, num_eval + num_sft + num_rl)
    held_out, sft, rl = problems[:num_eval], problems[num_eval : num_eval + num_sft], problems[num_eval + num_sft :]
    shown = set(random.Random(seed + 1).sample(range(len(sft)), round(tool_call_fraction * len(sft))))
    corpus = [
        {
            "messages": question(a, b)
            + (call_transcript(a, b) if i in shown else [{"role": "assistant", "content": str(a * b)}])
        }
        for i, (a, b) in enumerate(sft)
    ]

    def prompts(pairs):
        return [{"prompt": question(a, b), "answer": str(a * b)} for a, b in pairs]

    return {"sft": corpus, "rl": prompts(rl), "eval": prompts(held_out)}
