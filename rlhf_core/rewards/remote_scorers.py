"""The three kinds of reward served elsewhere (grpo.rewards entries with a `kind`), each a scorer called as a
reward function is, fn(prompts=, completions=, **dataset_columns), over `RemoteCaller` (remote.py):

- reward_model: `mlflow models serve` of a reward-model version (tasks/loaders/reward.py), `batch_size`
  completions per request (null: all of them) as `dataframe_records` of prompt, completion and, with token_ids,
  prompt_ids and completion_ids (the very tokens sampled) with the rollout's widths as params, so the scores
  are the in-process reward model's;
- judge: an OpenAI-compatible endpoint asked `template` (greedy, max_tokens), its answer parsed to a number in
  score_range or a label of labels;
- http: one JSON POST per completion ({"prompt", "completion", **columns}), the score at score_path.

What cannot be scored becomes what the source's on_failure says (`apply_failure_policy`): the stage fails with
one sentence, the completion stays `Unscored` (its group is dropped: sources.py), or it gets failure_score."""

from __future__ import annotations

import re

from rlhf_core.config import PipelineConfig, reads_grpo_rewards
from rlhf_core.config.rewards import TEMPLATE_FIELDS, RewardSource, template_fields
from rlhf_core.rewards.remote import (
    RemoteCaller,
    RemoteRewardError,
    RequestPolicy,
    SourceStats,
    Unscored,
    credential_headers,
)

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def endpoint(source: RewardSource, url: str) -> str:
    """The URL requests go to: a judge's base URL (…/v1) gets its api's path; any other is taken as it is."""
    if source.kind != "judge":
        return url
    path = "/chat/completions" if source.api == "chat" else "/completions"
    return url if url.rstrip("/").endswith(path) else url.rstrip("/") + path


def judge_question(template: str, prompt: str, completion: str, row: dict) -> str:
    """The template filled with the prompt, the completion and the row's columns."""
    return template.format_map({**row, "prompt": prompt, "completion": completion})


def judge_body(source: RewardSource, question: str) -> dict:
    """An OpenAI chat or completions request asking `question`, greedy unless request_params say otherwise."""
    body = {"model": source.judge_model, "max_tokens": source.max_tokens, "temperature": 0.0, **source.request_params}
    if source.api == "chat":
        return {**body, "messages": [{"role": "user", "content": question}]}
    return {**body, "prompt": question}


def judge_answer(answer: dict, api: str) -> str:
    """The text of the first choice of an OpenAI chat or completions answer."""
    choice = answer["choices"][0]
    text = choice["message"]["content"] if api == "chat" else choice["text"]
    if not isinstance(text, str):
        raise ValueError(f"the judge's answer is {type(text).__name__}, not text")
    return text


def parse_judge(text: str, score_range: list[float] | None, labels: dict[str, float] | None) -> float:
    """The score a judge's answer gives: its first number, within score_range; or its first word (case and
    punctuation ignored) as a key of labels. ValueError (a parse failure) otherwise: nothing is guessed."""
    if labels is not None:
        words = re.findall(r"[\w-]+", text.lower())
        keys = {key.lower(): value for key, value in labels.items()}
        if not words or words[0] not in keys:
            raise ValueError(f"the judge answered {text.strip()[:80]!r}, none of the labels {sorted(labels)}")
        return float(keys[words[0]])
    found = _NUMBER.search(text)
    if found is None:
        raise ValueError(f"the judge answered {text.strip()[:80]!r}, which holds no number")
    value = float(found.group())
    low, high = score_range
    if not low <= value <= high:
        raise ValueError(f"the judge's score {value:g} is outside score_range [{low:g}, {high:g}]")
    return value


def json_at(answer, path: str) -> float:
    """The number at `path` (keys and list indices joined by dots) in a JSON answer; ValueError when absent."""
    value = answer
    for part in path.split("."):
        if isinstance(value, list) and part.lstrip("-").isdigit():
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise ValueError(f"the answer has no {path}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path} is {value!r:.40}, not a number")
    return float(value)


def model_scores(answer, expected: int) -> list[float]:
    """A served reward model's scores: {"predictions": [{"score": x}, ...]} (or bare numbers), one per record."""
    rows = answer.get("predictions") if isinstance(answer, dict) else answer
    if not isinstance(rows, list) or len(rows) != expected:
        raise ValueError(f"expected {expected} predictions, got {str(rows)[:80]}")
    scores = [row.get("score") if isinstance(row, dict) else row for row in rows]
    for score in scores:
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise ValueError(f"a prediction's score is {score!r:.40}, not a number")
    return [float(s) for s in scores]


def apply_failure_policy(source: RewardSource, values: list, *, field: str, stats: SourceStats) -> list:
    """Each Unscored value as `on_failure` says, counted in the stats: fail raises one sentence; drop_group keeps
    it (its group is dropped); score gives failure_score."""
    failed = [(i, v) for i, v in enumerate(values) if isinstance(v, Unscored)]
    stats.add(failures=len(failed), parse_failures=sum(v.parse_failure for _, v in failed))
    if not failed:
        return values
    index, first = failed[0]
    if source.on_failure == "fail":
        raise RemoteRewardError(
            f"reward {source.name} could not score completion {index} of {len(values)} ({len(failed)} failed): "
            f"{first.reason}; {field}.on_failure is fail (drop_group or score go on)"
        )
    if source.on_failure == "score":
        return [source.failure_score if isinstance(v, Unscored) else v for v in values]
    return values


class RemoteScorer:
    """A served source as a reward function: fn(prompts=, completions=, **columns) -> a score or Unscored per
    completion, after its failure policy. `field` names its grpo.rewards entry; `url` its endpoint (a URL the
    stage started, for a reward model it serves itself)."""

    def __init__(self, source: RewardSource, url: str, *, field: str, post=None):
        self.source, self.field = source, field
        self.stats = SourceStats(source.name)
        headers = credential_headers(source.api_key_env, source.headers_env, field=field)
        policy = RequestPolicy(source.timeout_s, source.max_retries, source.backoff_s, source.max_concurrency)
        extra = {"post": post} if post is not None else {}
        self.caller = RemoteCaller(endpoint(source, url), policy, headers, self.stats, **extra)

    @property
    def wants_ids(self) -> bool:
        return self.source.kind == "reward_model" and self.source.token_ids

    def __call__(self, prompts, completions, *, widths: tuple[int, int] | None = None, **columns) -> list:
        """`widths`: the rollout's prompt and completion widths, with token ids (a reward model lays its batch out
        in them, as the trainer holds it)."""
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
        texts = [plain_text(p) for p in prompts], [plain_text(c) for c in completions]
        if self.source.kind == "reward_model":
            values = self._model(*texts, rows, widths)
        elif self.source.kind == "judge":
            questions = [judge_question(self.source.template, p, c, r) for p, c, r in zip(*texts, rows)]
            values = self.caller.call_all(
                [judge_body(self.source, q) for q in questions],
                lambda a: parse_judge(judge_answer(a, self.source.api), self.source.score_range, self.source.labels),
            )
        else:
            bodies = [{**_plain(r), "prompt": p, "completion": c} for p, c, r in zip(*texts, rows)]
            values = self.caller.call_all(bodies, lambda a: json_at(a, self.source.score_path))
        return apply_failure_policy(self.source, values, field=self.field, stats=self.stats)

    def _model(self, prompts: list[str], completions: list[str], rows: list[dict], widths) -> list:
        records = []
        for prompt, completion, row in zip(prompts, completions, rows):
            record = {"prompt": prompt, "completion": completion}
            if self.wants_ids and "prompt_ids" in row:
                record.update(prompt_ids=row["prompt_ids"], completion_ids=row["completion_ids"])
            records.append(record)
        size = self.source.batch_size or len(records)
        chunks = [records[i : i + size] for i in range(0, len(records), size)]
        params = (
            {"params": dict(zip(("prompt_width", "completion_width"), widths))} if widths and self.wants_ids else {}
        )
        answers = self.caller.call_all(
            [{"dataframe_records": chunk, **params} for chunk in chunks],
            lambda a: a,  # read per chunk below: the count is the chunk's
        )
        values = []
        for chunk, answer in zip(chunks, answers):
            if isinstance(answer, Unscored):
                values += [answer] * len(chunk)
                continue
            try:
                values += model_scores(answer, len(chunk))
            except ValueError as err:
                values += [Unscored(f"the answer holds no scores: {err}", parse_failure=True)] * len(chunk)
        return values


def remote_entries(cfg: PipelineConfig) -> list[tuple[int, RewardSource]]:
    """The sources served elsewhere of the GRPO family and online DPO with their index in grpo.rewards (PPO reads
    its reward model in-process, offline DPO none)."""
    if not reads_grpo_rewards(cfg.rl.algorithm):
        return []
    return [(i, r) for i, r in enumerate(cfg.grpo.rewards) if r.remote]


def entry_scorer(i: int, source: RewardSource) -> RemoteScorer:
    """The scorer of grpo.rewards[i] at its url; RemoteRewardError when it has none (its server was not started)."""
    if source.url is None:
        raise RemoteRewardError(f"grpo.rewards[{i}] ({source.name}) has no url: its server was not started")
    return RemoteScorer(source, source.url, field=f"grpo.rewards[{i}]")


def missing_template_columns(source: RewardSource, columns: set[str]) -> list[str]:
    """The names a judge template uses that neither the prompt rows' columns nor prompt/completion provide."""
    if source.kind != "judge" or source.template is None:
        return []
    return [name for name in template_fields(source.template) if name not in TEMPLATE_FIELDS and name not in columns]


def plain_text(value) -> str:
    """A prompt or completion as text: a message list (conversational rows) as its messages' contents."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in value)
    return str(value)


def _plain(row: dict) -> dict:
    """A row's JSON-ready columns (environments and other objects left out)."""
    return {k: v for k, v in row.items() if isinstance(v, (str, int, float, bool, list, dict, type(None)))}
