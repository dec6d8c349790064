"""Users' feedback read from MLflow: the traces a served policy wrote (tasks/loaders/policy.py) with their
assessments, as `AnsweredPrompt`s that rlhf_core/data/feedback.py turns into rows, and the cut-off of the last
training on them, kept in the registry.

A `traces:<experiment>` source reads every trace of that experiment a served policy wrote (tag `rlhf.kind` =
policy). A tracking server that does not answer is a `FeedbackUnreachable` (one sentence) raised from the
connection error, so the data stage's transient-I/O retries take it first.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import mlflow
from mlflow.tracking import MlflowClient

from rlhf_core.config.errors import UserError
from rlhf_core.config.redaction import redact
from rlhf_core.data.feedback import AnsweredPrompt, Assessment
from tasks.runtime.retry import is_transient

POLICY_TRACES = "tags.`rlhf.kind` = 'policy'"
CUTOFF_TAG = "feedback_until.{experiment}"  # on the policy's registered model: epoch ms of the last training's read


def cutoff_tag(experiment: str) -> str:
    """The registered model's tag for `experiment`'s cut-off (characters a tag key cannot hold become _)."""
    return CUTOFF_TAG.format(experiment=re.sub(r"[^\w.\- /]", "_", experiment))


class FeedbackUnreachable(UserError):
    """The tracking server did not answer while the feedback was read; the message is one sentence."""


def _answer(trace) -> AnsweredPrompt:
    """One traced answer: the root `generate` span's prompt and completions, the version's tags, the feedback."""
    root = next((s for s in trace.data.spans if s.parent_id is None), None)
    inputs = root.inputs if root is not None and isinstance(root.inputs, dict) else {}
    outputs = root.outputs if root is not None and isinstance(root.outputs, dict) else {}
    listed = outputs.get("completions")
    completions: tuple[str, ...] = ()
    ends: tuple[str | None, ...] = ()
    if isinstance(listed, list) and all(isinstance(c, dict) and isinstance(c.get("completion"), str) for c in listed):
        ordered = sorted(listed, key=lambda c: c.get("index", 0))
        if [c.get("index", i) for i, c in enumerate(ordered)] == list(range(len(ordered))):
            completions = tuple(c["completion"] for c in ordered)
            ends = tuple(_end(c) for c in ordered)
    tags = trace.info.tags
    name, version = tags.get("rlhf.model_name"), tags.get("rlhf.model_version")
    return AnsweredPrompt(
        trace_id=trace.info.trace_id,
        prompt=inputs.get("prompt") if isinstance(inputs.get("prompt"), str) else "",
        completions=completions,
        model=f"{name}/{version}" if name and version else "",
        time_ms=int(trace.info.request_time),
        assessments=tuple(_assessment(a) for a in trace.info.assessments if type(a).__name__ == "Feedback"),
        ends=ends,
    )


def _end(completion: dict) -> str | None:
    """The stop token that ended a traced completion; "" at the length limit; None when it stopped on a token the
    trace does not name."""
    if completion.get("finish_reason") != "stop":
        return ""
    token = completion.get("stop_token")
    return token if isinstance(token, str) and token else None


def _assessment(feedback) -> Assessment:
    return Assessment(
        id=feedback.assessment_id,
        name=feedback.name,
        value=feedback.value,
        time_ms=int(feedback.create_time_ms or 0),
        metadata=dict(feedback.metadata or {}),
        valid=feedback.valid is not False,
    )


@contextmanager
def _server_answers(field: str, what: str) -> Iterator[None]:
    """A transient failure inside becomes FeedbackUnreachable (one sentence naming `field`), raised from it."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        if not is_transient(err):
            raise
        uri = redact(mlflow.get_tracking_uri())
        raise FeedbackUnreachable(
            f"{field}.path: the MLflow tracking server at {uri} did not answer while {what}"
        ) from err


def answered_prompts(experiment: str, field: str) -> list[AnsweredPrompt]:
    """Every answer a served policy traced in `experiment`, with its feedback; a missing experiment is a
    one-sentence UserError naming `field`."""
    with _server_answers(field, f"reading the feedback in experiment '{experiment}'"):
        found = MlflowClient().get_experiment_by_name(experiment)
        if found is None:
            raise UserError(
                f"{field}.path: there is no MLflow experiment '{experiment}' at {redact(mlflow.get_tracking_uri())}; "
                f"serve the policy with MLFLOW_EXPERIMENT_NAME={experiment} to record its answers there (docs/feedback.md)"
            )
        traces = mlflow.search_traces(
            locations=[found.experiment_id], filter_string=POLICY_TRACES, return_type="list", include_spans=True
        )
    return [_answer(trace) for trace in traces]


def last_cutoff(model_name: str, experiment: str, field: str) -> int | None:
    """The cut-off (epoch ms) of the last training on `experiment`'s feedback, kept as a tag of the policy's
    registered model; None before the first."""
    from mlflow.exceptions import MlflowException

    with _server_answers(field, f"reading the last training's cut-off from the registered model {model_name}"):
        try:
            tags = MlflowClient().get_registered_model(model_name).tags
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
    value = tags.get(cutoff_tag(experiment))
    return int(value) if value and value.isdigit() else None


def record_cutoffs(model_name: str, cutoffs: dict[str, int]) -> None:
    """Keep each experiment's cut-off on the policy's registered model, once the training on it is registered."""
    client = MlflowClient()
    for experiment, until_ms in cutoffs.items():
        client.set_registered_model_tag(model_name, cutoff_tag(experiment), str(until_ms))
