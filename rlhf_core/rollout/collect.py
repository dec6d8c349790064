"""The rollout phase of an RL step: sample responses, mark where they stop, and read their log-probabilities
under the policy and the reference; plus the completion statistics TRL logs for a rollout."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlhf_core.models.forward import over_micro_batches, response_logprobs
from rlhf_core.rl_math import INVALID_LOGPROB, response_mask
from rlhf_core.rollout.engines import LoopEngine, RolloutEngine
from rlhf_core.rollout.episodes import EpisodeRecord, ToolRollout
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.training.timing import PhaseTimer


@dataclass
class Rollout:
    """One batch of experience: everything PPO or GRPO needs, detached."""

    query_ids: torch.Tensor  # (B, Q) left-padded
    query_mask: torch.Tensor  # (B, Q)
    responses: torch.Tensor  # (B, R) right-padded after the stop token
    resp_mask: torch.Tensor  # (B, R)
    last_index: torch.Tensor  # (B,) index of the last real response token
    logprobs: torch.Tensor | None  # (B, R) policy at sampling time; None when not asked for
    ref_logprobs: torch.Tensor | None  # (B, R)
    has_stop: torch.Tensor  # (B,) bool: the response ended with a stop token (else it ran to response_length)
    behaviour_logprobs: torch.Tensor | None = None  # (B, R) the rollout engine's own (vllm); None: the policy sampled
    model_tokens: torch.Tensor | None = None  # (B, R) 1: the model sampled it, 0: a tool's turn; None: all are
    episodes: EpisodeRecord | None = None  # a tool rollout's transcripts and counts (`episodes.py`)

    def model_mask(self) -> torch.Tensor:
        """The real response tokens the model sampled: a tool episode's tool turns left out. (B, R)"""
        return self.resp_mask if self.model_tokens is None else self.resp_mask * self.model_tokens

    def trained_mask(self, mask_truncated: bool) -> torch.Tensor:
        """The response tokens the loss sees: the model's, or with `mask_truncated` (the GRPO family's
        mask_truncated_completions) none of a response that ran to the length limit without a stop. (B, R)"""
        mask = self.model_mask()
        return mask * self.has_stop.unsqueeze(1).long() if mask_truncated else mask


@dataclass
class RolloutBatch:
    """What the rollout phase of an RL step hands on: the sampled responses and every score of them."""

    rollout: Rollout
    scores: torch.Tensor  # (B, F) each reward source's score (PPO: F = 1, the reward model); NaN: the source abstained
    penalty: torch.Tensor | None = None  # (B,) rl.missing_eos_penalty where a response never stopped, else 0
    values: torch.Tensor | None = None  # (B, R) the value model's, at sampling time (PPO)
    rows: list[dict] = field(default_factory=list)  # each response's prompt row (reward functions read its columns)
    completions: list[str] = field(default_factory=list)  # decoded, when a reward function needs the text

    def __len__(self) -> int:
        return self.scores.shape[0]

    def sequence_scores(self) -> torch.Tensor:
        """The one score per response of a single-source rollout, minus the penalty. (B,)"""
        scores = self.scores[:, 0]
        return scores if self.penalty is None else scores - self.penalty


def missing_stop_penalty(rollout: Rollout, penalty: float | None) -> torch.Tensor | None:
    """rl.missing_eos_penalty on each response that ran to the length limit without a stop token. (B,)"""
    return None if penalty is None else penalty * (~rollout.has_stop).float()


def reference_context(policy, ref_model):
    """With no separate reference (LoRA), the policy with its adapters disabled is the reference."""
    if ref_model is None:
        return policy.disable_adapter()
    return nullcontext()


def context_length(policy) -> int | None:
    """The longest sequence the policy's config says it takes (max_position_embeddings), None when it says none."""
    config = getattr(policy, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None)


@dataclass(frozen=True)
class SamplingSpec:
    """How a stage's rollouts are sampled, whichever engine samples them and whenever: the sampling settings, what
    stops and pads a response, the group size (completions per prompt), and tool episodes (the rows filled in per
    batch)."""

    settings: SamplingSettings
    pad_token_id: int
    stop_token_ids: tuple[int, ...] = ()
    prompt_repeats: int = 1
    tools: ToolRollout | None = None
    max_tokens: int | None = None  # rl.max_tokens_per_micro_batch: our decode loop's rows x (prompt + response)


@dataclass
class Sampled:
    """What an engine sampled for a batch, before any score: the prompts as sampled (a tool episode renders its
    own), the responses and where they stop, the engine's log-probs of them (the behaviour policy's; None: the policy
    that trains sampled them), and a tool rollout's marks and record. Made by `sample`, in the step or ahead on a
    generator apart (`ahead.py`)."""

    query_ids: torch.Tensor  # (B, Q)
    query_mask: torch.Tensor
    responses: torch.Tensor  # (B, R)
    resp_mask: torch.Tensor
    last_index: torch.Tensor  # (B,)
    has_stop: torch.Tensor  # (B,)
    behaviour_logprobs: torch.Tensor | None = None  # (B, R)
    model_tokens: torch.Tensor | None = None  # (B, R) tool rollouts
    record: EpisodeRecord | None = None

    def to(self, device) -> Sampled:
        moved = {
            name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in vars(self).items()
        }
        return Sampled(**moved)


def sample(
    engine: RolloutEngine,
    policy,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    spec: SamplingSpec,
    *,
    seed: int | None = None,
    rows: list[dict] | None = None,
) -> Sampled:
    """One batch sampled on `engine`: a completion of each row of `query_ids` (spec.prompt_repeats of each prompt
    in a row), or with spec.tools a tool episode of each of `rows` (the prompt rows). `seed`: the batch's base
    seed (an engine apart seeds its requests with it; our loop draws from torch's generator). The engines sample
    without gradients."""
    generate = {
        "pad_token_id": spec.pad_token_id,
        "stop_token_ids": spec.stop_token_ids,
        "prompt_repeats": spec.prompt_repeats,
        "seed": seed,
    }
    if spec.tools is None:
        parts = []
        for rows in generation_parts(engine, len(query_ids), query_ids.shape[1] + spec.settings.response_length, spec):
            parts.append(engine.generate(policy, query_ids[rows], query_mask[rows], spec.settings, **generate))
        responses, behaviour = joined(parts, spec.pad_token_id)
        resp_mask, last_index, has_stop = response_mask(responses, spec.stop_token_ids)
        return Sampled(query_ids, query_mask, responses, resp_mask, last_index, has_stop, behaviour)
    tools = replace(spec.tools, rows=rows)
    played = tools.play(engine, policy, spec.settings, query_ids.device, **generate)
    last_index = (played.resp_mask.sum(1) - 1).clamp(min=0)
    return Sampled(
        played.query_ids,
        played.query_mask,
        played.responses,
        played.resp_mask,
        last_index,
        played.has_stop,
        played.behaviour_logprobs,
        played.model_tokens,
        played.record,
    )


def generation_parts(engine: RolloutEngine, n_rows: int, width: int, spec: SamplingSpec) -> list[slice]:
    """The rows generated at a time: all of them; on our decode loop with spec.max_tokens, as many whole groups as
    keep rows x `width` (prompt + response_length) tokens of KV cache within it."""
    group = spec.prompt_repeats
    rows = n_rows if spec.max_tokens is None else max(1, spec.max_tokens // (width * group)) * group
    if not isinstance(engine, LoopEngine) or rows >= n_rows:
        return [slice(0, n_rows)]
    return [slice(start, start + rows) for start in range(0, n_rows, rows)]


def joined(parts: list, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (responses, behaviour log-probs or None) of the parts generated apart, padded to one width."""
    if len(parts) == 1:
        return parts[0]
    longest = max(part[0].shape[1] for part in parts)
    responses = torch.cat([F.pad(part[0], (0, longest - part[0].shape[1]), value=pad_token_id) for part in parts])
    if parts[0][1] is None:
        return responses, None
    return responses, torch.cat([F.pad(part[1], (0, longest - part[1].shape[1])) for part in parts])


class Passes(NamedTuple):
    """The forward passes a sampled batch gets: the policy's log-probs of it (the "old" ones; see
    `rl/engine_correction.py old_logprobs_at_sampling`) and the reference's."""

    policy: bool = True
    reference: bool = True


BOTH = Passes()


@torch.no_grad()
def score_sampled(
    policy,
    ref_model,
    sampled: Sampled,
    temperature: float,
    passes: Passes = BOTH,
    timer: PhaseTimer | None = None,
    plan: list[list[int]] | None = None,
) -> Rollout:
    """The rollout of a sampled batch: its log-probs under the policy and the reference as `passes` asks (each
    None when not asked), on the policy's device, micro-batch by micro-batch of `plan` (rows; None: one).
    `ref_model` None: the policy with its adapters disabled. `timer` times the phases policy_logprobs and
    reference."""
    timer = timer or PhaseTimer(enabled=False)
    policy.eval()
    s = sampled.to(next(policy.parameters()).device)
    args = (s.query_ids, s.query_mask, s.responses, s.resp_mask)
    logprobs = ref_logprobs = None

    def logprobs_of(model):
        return lambda *rows: response_logprobs(model, *rows, temperature)[0]

    if passes.policy:
        with timer("policy_logprobs"):
            logprobs = over_micro_batches(logprobs_of(policy), plan, *args)
    if passes.reference:
        with timer("reference"), reference_context(policy, ref_model):
            ref_logprobs = over_micro_batches(logprobs_of(ref_model or policy), plan, *args)
    behaviour = s.behaviour_logprobs
    if behaviour is not None:
        behaviour = behaviour.masked_fill(s.resp_mask == 0, INVALID_LOGPROB)
    return Rollout(*args, s.last_index, logprobs, ref_logprobs, s.has_stop, behaviour, s.model_tokens, s.record)


@torch.no_grad()
def collect_rollout(
    policy,
    ref_model,
    query_ids,
    query_mask,
    spec: SamplingSpec,
    *,
    engine: RolloutEngine | None = None,
    passes: Passes = BOTH,
    **request,
) -> Rollout:
    """`sample` on `engine` (our decode loop when None), then `score_sampled`: one rollout of `query_ids`.
    `request`: the batch's `seed` and, for tool episodes, its prompt `rows` (see `sample`)."""
    policy.eval()
    sampled = sample(engine or LoopEngine(), policy, query_ids, query_mask, spec, **request)
    return score_sampled(policy, ref_model, sampled, spec.settings.temperature, passes)


def tool_metrics(rollout: Rollout) -> dict[str, torch.Tensor]:
    """A tool rollout's statistics as 0-d tensors (none without tools): TRL's tools/call_frequency (calls per
    episode) and tools/failure_frequency (failed calls per call), the failed calls, the model's turns per episode,
    the share of episodes stopped at grpo.max_tool_calls with calls unanswered, and the share of response tokens
    that are the tools'."""
    record = rollout.episodes
    if record is None:
        return {}
    count, calls, failures = len(record.calls), sum(record.calls), sum(record.failures)
    tokens = rollout.resp_mask.sum().float()

    def scalar(value: float) -> torch.Tensor:
        return torch.tensor(float(value), device=tokens.device)

    return {
        "tools/call_frequency": scalar(calls / count),
        "tools/failure_frequency": scalar(failures / calls if calls else 0.0),
        "tools/failures": scalar(failures),
        "tools/turns": scalar(sum(record.turns) / count),
        "tools/hit_max_calls": scalar(sum(record.hit_limit) / count),
        "tools/token_share": (tokens - rollout.model_mask().sum().float()) / tokens.clamp(min=1.0),
    }


def completion_metrics(rollout: Rollout) -> dict[str, torch.Tensor]:
    """TRL's completion statistics of a rollout, as 0-d tensors: lengths in tokens (stop token included),
    the fraction that never stopped, and the mean length of those that did (0 when none did). A tool episode's
    length counts the model's tokens only, as TRL's."""
    lengths = rollout.model_mask().sum(1).float()
    stopped = rollout.has_stop.float()
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": 1.0 - stopped.mean(),
        "completions/mean_terminated_length": (lengths * stopped).sum() / stopped.sum().clamp(min=1.0),
    }
