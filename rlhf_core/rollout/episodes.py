"""Tool episodes: a rollout of several turns, built in token ids (TRL 1.16's `_tool_call_loop`, verl's agent loop).

Each episode starts from its prompt rendered with the tools it may call (and the text its environment's reset
returned, appended to the last user message). Then, turn by turn, on whichever engine samples (our loop or vLLM,
which both continue from token ids): the model's turn is sampled up to a stop token, parsed for tool calls
(`data/tool_calls.py`), the calls are run (`tools.py`), and their answers are appended as the chat template's
tool turn, cut as token ids (`tool_suffix_ids`), never re-tokenized with what came before. The episode ends when a
turn calls nothing, when grpo.max_tool_calls rounds have run (the turn's calls then go unanswered: `hit_limit`),
when the answers would not leave one token of rl.response_length (they are dropped, as TRL drops them), or when a
turn runs out of tokens.

The response of an episode is every token after the prompt: the model's turns and the tools' turns. `model_tokens`
marks the model's: the loss, the KL, the entropy and the length metrics read only those, so a tool's answer is
read by the model (attended to) but never trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from rlhf_core.data.chat import encode, render_prompt
from rlhf_core.data.tool_calls import parse_turn, tool_suffix_ids, transcript_line, transcript_text
from rlhf_core.rl_math import INVALID_LOGPROB, response_mask
from rlhf_core.rollout.engines import RolloutEngine
from rlhf_core.rollout.generation import left_pad
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.tools import Toolbox, ToolError, ToolUse, run_turns

TURN_SEED_STRIDE = 65_537  # an engine's requests of turn t are seeded seed + t x stride (+ the row's offset)


@dataclass
class EpisodeRecord:
    """What the tensors of a tool rollout do not hold, one entry per row: the transcript (assistant and tool
    messages, as TRL hands rewards the completion), the calls made and failed, the model's turns, whether the
    episode stopped at grpo.max_tool_calls with calls unanswered, and its toolbox (its environment)."""

    transcripts: list[list[dict]]
    calls: list[int]
    failures: list[int]
    turns: list[int]
    hit_limit: list[bool]
    toolboxes: list[Toolbox]

    def select(self, rows: Sequence[int]) -> EpisodeRecord:
        return EpisodeRecord(*([getattr(self, f)[i] for i in rows] for f in self.__dataclass_fields__))

    @staticmethod
    def join(records: Sequence[EpisodeRecord]) -> EpisodeRecord:
        return EpisodeRecord(*([x for r in records for x in getattr(r, f)] for f in EpisodeRecord.__dataclass_fields__))

    def texts(self) -> list[str]:
        """Each transcript as lines a reader follows (`transcript_text`)."""
        return [transcript_text(t) for t in self.transcripts]

    def lines(self) -> list[str]:
        """Each transcript on one line (`transcript_line`), as tables show it."""
        return [transcript_line(t) for t in self.transcripts]

    @property
    def environments(self) -> list:
        return [box.environment for box in self.toolboxes]


@dataclass
class Episodes:
    query_ids: torch.Tensor  # (B, Q) left-padded: the prompts as the episodes began
    query_mask: torch.Tensor
    responses: torch.Tensor  # (B, R) model and tool tokens, right-padded with the pad id
    resp_mask: torch.Tensor  # (B, R) every real token, the tools' included
    model_tokens: torch.Tensor  # (B, R) 1 where the model sampled the token
    has_stop: torch.Tensor  # (B,) the last model turn ended with a stop token
    behaviour_logprobs: torch.Tensor | None  # (B, R) the engine's own, of the model's tokens; None: it has none
    record: EpisodeRecord


@dataclass
class ToolRollout:
    """What a rollout of tool episodes needs beyond the prompts' ids: the tools, each row's prompt row (its
    messages and columns), the tokenizer that renders and parses turns, and the lengths that bound an episode
    (`max_length`: the model's context, prompt and episode)."""

    tool_use: ToolUse
    tokenizer: object
    rows: list[dict]
    max_prompt_length: int
    max_length: int | None = None
    template_kwargs: dict | None = None

    def play(self, engine, policy, settings: SamplingSettings, device, **generate) -> Episodes:
        """Every row's episode played on `engine`; `generate`: pad_token_id, stop_token_ids, prompt_repeats, seed."""
        boxes = self.tool_use.toolboxes(self.rows)
        prompts = episode_prompts(self.tokenizer, self.rows, boxes, self.max_prompt_length, self.template_kwargs)
        return run_episodes(engine, policy, self, prompts, boxes, settings, device=device, **generate)


def episode_prompts(
    tokenizer, rows: Sequence[dict], toolboxes: Sequence[Toolbox], max_prompt_length: int, kwargs: dict | None = None
) -> list[list[int]]:
    """Each row's prompt ids, rendered from its messages with its tools and its environment's reset text, cut from
    the left at max_prompt_length as every prompt is."""
    texts = []
    for i, (row, box) in enumerate(zip(rows, toolboxes)):
        messages = row.get("prompt_messages")
        if messages is None:
            raise ToolError(
                f"prompt row {i} is plain text, and grpo.tools needs conversational prompts (lists of messages)"
            )
        if box.reset_text:
            messages = [dict(m) for m in messages]
            last = max(j for j, m in enumerate(messages) if m["role"] == "user")
            messages[last]["content"] = f"{messages[last]['content']}{box.reset_text}"
        texts.append(render_prompt(tokenizer, messages, kwargs, tools=box.schemas()))
    return [ids[-max_prompt_length:] for ids in encode(tokenizer, texts)]


class _Turns:
    """The growing episodes: token ids, which the model sampled, the engine's log-probs, the transcripts."""

    def __init__(self, count: int):
        self.ids: list[list[int]] = [[] for _ in range(count)]
        self.model: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[float]] = [[] for _ in range(count)]
        self.stopped = [False] * count
        self.record = EpisodeRecord(
            [[] for _ in range(count)], [0] * count, [0] * count, [0] * count, [False] * count, []
        )

    def add(self, i: int, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.ids[i] += ids
        self.model[i] += [int(model)] * len(ids)
        self.logprobs[i] += logprobs if logprobs is not None else [INVALID_LOGPROB] * len(ids)


def run_episodes(
    engine: RolloutEngine,
    policy,
    tools: ToolRollout,
    prompts: list[list[int]],
    toolboxes: list[Toolbox],
    settings: SamplingSettings,
    *,
    device=None,
    **generate,
) -> Episodes:
    """Play every prompt's episode to its end; rows of one prompt (a GRPO group) share the first turn's request.
    `tools`: the tools, tokenizer and lengths (tools.rows unused: `toolboxes` are the rows' own);
    `settings.response_length`: the episode's budget; `generate`: pad_token_id, stop_token_ids, and optionally
    prompt_repeats and seed (see `engines.RolloutEngine.generate`)."""
    tokenizer, pad_token_id, stop_token_ids = tools.tokenizer, generate["pad_token_id"], generate["stop_token_ids"]
    seed = generate.get("seed")
    budget, turns = settings.response_length, _Turns(len(prompts))
    turns.record.toolboxes = list(toolboxes)
    active, repeats, turn, logprobs = list(range(len(prompts))), generate.get("prompt_repeats", 1), 0, None
    while active:
        room = [budget - len(turns.ids[i]) for i in active]
        query_ids, query_mask = left_pad([prompts[i] + turns.ids[i] for i in active], pad_token_id)
        responses, logprobs = engine.generate(
            policy,
            query_ids.to(device),
            query_mask.to(device),
            replace(settings, response_length=max(room)),
            pad_token_id=pad_token_id,
            stop_token_ids=stop_token_ids,
            prompt_repeats=repeats,
            seed=None if seed is None else seed + turn * TURN_SEED_STRIDE,
        )
        mask, _, has_stop = response_mask(responses, stop_token_ids)
        calling = []
        for j, i in enumerate(active):
            length = int(mask[j].sum())
            n = min(length, room[j])
            ids = responses[j, :n].tolist()
            before = prompts[i] + turns.ids[i]
            turns.add(i, ids, True, logprobs[j, :n].tolist() if logprobs is not None else None)
            turns.stopped[i] = bool(has_stop[j]) and n == length
            turns.record.turns[i] += 1
            message = parse_turn(tokenizer, ids, before, toolboxes[i].schemas())
            turns.record.transcripts[i].append(message)
            if message.get("tool_calls"):
                if tools.tool_use.max_calls is not None and turn >= tools.tool_use.max_calls:
                    turns.record.hit_limit[i] = True
                else:
                    calling.append(i)
        active = _answer_calls(calling, turns, toolboxes, prompts, tools, budget)
        repeats, turn = 1, turn + 1
    return _episodes(prompts, turns, budget, pad_token_id, with_logprobs=logprobs is not None)


def _answer_calls(calling, turns, toolboxes, prompts, tools: ToolRollout, budget: int) -> list[int]:
    """Run the calling episodes' calls and append their answers; the episodes that go on (the answers fit)."""
    jobs = [(toolboxes[i], turns.record.transcripts[i][-1]["tool_calls"]) for i in calling]
    going_on, max_length = [], tools.max_length
    for i, answers in zip(calling, run_turns(jobs, tools.tool_use.timeout_s)):
        turns.record.calls[i] += len(answers)
        turns.record.failures[i] += sum(a.failed for a in answers)
        messages = [{"role": "tool", "name": a.name, "content": a.content} for a in answers]
        suffix = tool_suffix_ids(tools.tokenizer, messages, tools.template_kwargs)
        used = len(turns.ids[i]) + len(suffix)
        if used >= budget or (max_length is not None and len(prompts[i]) + used >= max_length):
            continue  # no room left for the model to read the answers and speak: dropped, as TRL drops them
        turns.record.transcripts[i] += messages
        turns.add(i, suffix, False)
        going_on.append(i)
    return going_on


def _episodes(prompts, turns: _Turns, budget: int, pad_token_id: int, *, with_logprobs: bool) -> Episodes:
    count = len(prompts)
    query_ids, query_mask = left_pad(prompts, pad_token_id)
    responses = torch.full((count, budget), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros((count, budget), dtype=torch.long)
    model_tokens = torch.zeros((count, budget), dtype=torch.long)
    logprobs = torch.full((count, budget), INVALID_LOGPROB, dtype=torch.float32)
    for i, ids in enumerate(turns.ids):
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        resp_mask[i, : len(ids)] = 1
        model_tokens[i, : len(ids)] = torch.tensor(turns.model[i], dtype=torch.long)
        logprobs[i, : len(ids)] = torch.tensor(turns.logprobs[i], dtype=torch.float32)
    has_stop = torch.tensor(turns.stopped, dtype=torch.bool)
    return Episodes(
        query_ids,
        query_mask,
        responses,
        resp_mask,
        model_tokens,
        has_stop,
        logprobs if with_logprobs else None,
        turns.record,
    )
