"""A registered policy as `mlflow models serve` and `mlflow.pyfunc.load_model` run it.

A policy version is saved with MLflow's transformers flavor (`mlflow.transformers.load_model` gives its model and
tokenizer back) and with this file as its python_function loader, which registration (tasks/registry/logged_model.py
`LoaderFlavor`) copies into the version's `code/` folder as `MODULE_IN_VERSION`. It imports nothing of this
repository, so a version serves wherever its requirements are installed (keep it so: a test loads it alone).

A request is `{"inputs": [prompt, ...], "params": {...}}`, each prompt a string as the client renders it
(a chat template applied), params the signature's (`generation_signature`), n among them: 1 to 16 completions
per prompt, each generated alone (greedy: n copies). The answer is one record per completion, by prompt, then index:

- completion: the new text only, "" when the model stopped at once (never the prompt echoed back);
- finish_reason: "stop" (a stop token ended it) or "length" (max_new_tokens did);
- prompt_tokens, completion_tokens: the counts the model saw and wrote;
- truncated_prompt_tokens: how many tokens were cut from the prompt's left (after its BOS token, which is
  kept) to leave max_new_tokens of room in the model's context; 0 when it fitted;
- index: the completion's among its prompt's n (0..n-1); trace_id: its prompt's trace, "" when not traced.

Temperature 0 means greedy decoding (as in OpenAI's API and vLLM). A bad request raises
MlflowException(INVALID_PARAMETER_VALUE): the scoring server answers 400 with one sentence and no stack trace.

Tracing, opt-in: with MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME (made when missing) or MLFLOW_EXPERIMENT_ID
set, each prompt of a request answered is one trace there (a failed request: none): a root span "generate" (LLM)
timed by the generation, inputs {"prompt", "params" (n included)}, outputs {"completions": [{"index",
"completion", "finish_reason", "completion_tokens", "stop_token" (its text, "" at the length limit)}, ...],
"prompt_tokens", "truncated_prompt_tokens"}, tags rlhf.kind "policy", rlhf.model_name and rlhf.model_version
(asked of the registry at load; left out, in one warning, when not found), nothing else of the request or the
environment. The experiment is found at load: the trace id is made here, MLflow sends the trace from its queue. A
trace it could not store is counted and said in one line (`TraceLosses`); the answer goes out regardless. The load
sets `TRACE_ENV_DEFAULTS` (short HTTP retries) where the environment sets none. No experiment: no tracing.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

# this file's module name inside a version (its code/ folder and MLmodel's loader_module): its name before
# tasks/loaders/, kept so that the versions registered before and after name their loader alike
MODULE_IN_VERSION = "served_policy"

DEFAULT_MAX_NEW_TOKENS = 32  # when the generation_config sets no max_new_tokens
OUTPUT_COLUMNS = (
    ("completion", "string"),
    ("finish_reason", "string"),
    ("prompt_tokens", "long"),
    ("completion_tokens", "long"),
    ("truncated_prompt_tokens", "long"),
    ("index", "long"),
    ("trace_id", "string"),
)
MAX_N = 16  # completions per prompt


# the per-request generation params: name -> (MLflow type, Python type, default where the generation_config sets none)
GENERATION_PARAMS = {
    "max_new_tokens": ("long", int, DEFAULT_MAX_NEW_TOKENS),
    "temperature": ("double", float, 1.0),
    "top_p": ("double", float, 1.0),
    "do_sample": ("boolean", bool, False),
    "n": ("long", int, 1),
}

# MLflow's HTTP settings when tracing, where the environment sets none: a dead server costs a trace seconds (not
# the minutes of MLflow's 7 retries with back-off and 120 s timeout), and loading too
TRACE_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
# where MLflow says a trace was not stored: its exporter, and its queue's worker
EXPORT_LOGGERS = ("mlflow.tracing.export.mlflow_v3", "mlflow.tracing.export.async_export_queue")
NOT_STORED = ("Failed to send trace to MLflow backend", "Failed to log trace to the trace server")
UNREACHABLE = ("Max retries exceeded", "Connection refused", "Failed to establish", "timed out", "ConnectionError")
_log = logging.getLogger(__name__)


def generation_defaults(generation_config) -> dict:
    """GENERATION_PARAMS' defaults as `generation_config` sets them (greedy, temperature 1.0, top_p 1.0 where it
    sets none): the signature's defaults and what a request without params gets."""
    defaults = {}
    for name, (_, kind, fallback) in GENERATION_PARAMS.items():
        found = getattr(generation_config, name, None)
        defaults[name] = kind(fallback if found is None else found)
    return defaults


def generation_signature(generation_config):
    """Prompt strings in (checked by `prompts_of`), OUTPUT_COLUMNS out, and GENERATION_PARAMS per request with
    the defaults of `generation_defaults`."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    defaults = generation_defaults(generation_config)
    params = ParamSchema(
        [ParamSpec(name, mlflow_type, defaults[name]) for name, (mlflow_type, _, _) in GENERATION_PARAMS.items()]
    )
    outputs = Schema([ColSpec(dtype, name) for name, dtype in OUTPUT_COLUMNS])
    # no input schema: MLflow's enforcement of one would turn `"inputs": 5` into the prompt "5"; `prompts_of`
    # checks the inputs instead
    return ModelSignature(inputs=None, outputs=outputs, params=params)


def _load_pyfunc(path, model_config=None):
    """The python_function loader: `path` is the version's directory."""
    import mlflow.transformers
    import torch

    components = mlflow.transformers.load_model(str(path), return_type="components")
    model = components["model"]
    if torch.cuda.is_available():
        model = model.to("cuda")
    return ServedPolicy(model.eval(), components["tokenizer"], traces_from_environment(path))


class RefusedRequest(MlflowException):
    """A bad request: the scoring server answers 400 whose message is this one sentence, no stack trace.

    The server rewrites the message of an exception raised in predict to "Failed to predict data '<the whole
    request>'. Error: <message>" (thousands of characters for a long prompt); this one keeps its sentence."""

    @property
    def message(self) -> str:
        return self._sentence

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_sentence"):
            self._sentence = value


def bad_request(message: str) -> RefusedRequest:
    return RefusedRequest(message, error_code=INVALID_PARAMETER_VALUE)


def prompts_of(data) -> list[str]:
    """The request's prompts as a list of strings: a string, a list of strings, or a one-column table."""
    import numpy as np
    import pandas as pd

    if isinstance(data, pd.DataFrame):
        if data.shape[1] != 1:
            raise bad_request(f"inputs must be one column of prompt strings, got columns {list(data.columns)}")
        values = data.iloc[:, 0].tolist()
    elif isinstance(data, (pd.Series, np.ndarray)):
        values = list(np.asarray(data).reshape(-1))
    elif isinstance(data, (str, list, tuple)):
        values = [data] if isinstance(data, str) else list(data)
    else:
        raise bad_request(f"inputs must be a prompt string or a list of them, got {type(data).__name__}")
    for index, value in enumerate(values):
        if not isinstance(value, str):
            value = value.item() if isinstance(value, np.generic) else value
            raise bad_request(f"inputs[{index}] must be a prompt string, got {type(value).__name__} {value!r:.40}")
    if not values:
        raise bad_request("inputs must hold at least one prompt string")
    return values


def generation_settings(params: dict | None, defaults: dict, context: int) -> dict:
    """The request's params over the version's defaults, checked: a sentence naming the param otherwise."""
    settings = {**defaults, **{k: v for k, v in (params or {}).items() if v is not None}}
    unknown = sorted(set(settings) - set(defaults))
    if unknown:
        raise bad_request(f"params {unknown} are not generation params of this model; use {sorted(defaults)}")
    new = settings["max_new_tokens"]
    if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new < context:
        raise bad_request(f"params.max_new_tokens must be an integer from 1 to {context - 1}, got {new!r}")
    n = settings["n"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad_request(f"params.n must be an integer from 1 to {MAX_N}, got {n!r}")
    if not isinstance(settings["do_sample"], bool):
        raise bad_request(f"params.do_sample must be true or false, got {settings['do_sample']!r}")
    temperature, top_p = settings["temperature"], settings["top_p"]
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise bad_request(f"params.temperature must be a number of at least 0 (0: greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise bad_request(f"params.top_p must be a number above 0 and at most 1, got {top_p!r}")
    if temperature == 0:  # as in OpenAI's API and vLLM: no randomness asked for
        settings["do_sample"] = False
    return settings


def fit_prompt(ids: list[int], budget: int, keep_first: bool) -> tuple[list[int], int]:
    """`ids` cut from the left to at most `budget` tokens (the first one kept when `keep_first`: a BOS
    token); returns the ids and how many were cut."""
    if len(ids) <= budget:
        return ids, 0
    head = ids[:1] if keep_first and budget > 1 else []
    kept = head + ids[len(ids) - (budget - len(head)) :]
    return kept, len(ids) - len(kept)


class ServedPolicy:
    """Generation for the scoring server: one prompt at a time, the version's generation_config as defaults, each
    prompt answered recorded by `traces` (None: not traced)."""

    def __init__(self, model, tokenizer, traces: Traces | None = None):
        self.model, self.tokenizer, self.traces = model, tokenizer, traces
        config = model.generation_config
        self.defaults = generation_defaults(config)
        stop = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = {int(i) for i in (stop if isinstance(stop, (list, tuple)) else [stop]) if i is not None}
        self.context = context_length(model.config, tokenizer)

    def predict(self, data, params=None):
        import pandas as pd

        prompts = prompts_of(data)
        settings = generation_settings(params, self.defaults, self.context)
        fitted = [self._fit(index, prompt, settings) for index, prompt in enumerate(prompts)]  # all checked first
        answers = [self._answer(ids, cut, settings) for ids, cut in fitted]
        rows = []
        for prompt, (answer, span) in zip(prompts, answers, strict=True):  # traced once every prompt is answered
            trace_id = self.traces.record(prompt, settings, answer, span) if self.traces else ""
            counts = {key: answer[key] for key in ("prompt_tokens", "truncated_prompt_tokens")}
            rows += [{**completion, **counts, "trace_id": trace_id} for completion in answer["completions"]]
        return pd.DataFrame(rows, columns=[name for name, _ in OUTPUT_COLUMNS])

    def _fit(self, index: int, prompt: str, settings: dict) -> tuple[list[int], int]:
        """The prompt's ids cut to leave max_new_tokens of room (`fit_prompt`, its BOS token kept: a rendered
        template's own, no second one added), and how many were cut."""
        bos = self.tokenizer.bos_token
        ids = list(self.tokenizer(prompt, add_special_tokens=not (bool(bos) and prompt.startswith(bos)))["input_ids"])
        if not ids:
            raise bad_request(f"inputs[{index}] is empty and this tokenizer adds no start token to generate from")
        has_bos = self.tokenizer.bos_token_id is not None and ids[0] == self.tokenizer.bos_token_id
        return fit_prompt(ids, self.context - settings["max_new_tokens"], keep_first=has_bos)

    def _answer(self, ids: list[int], cut: int, settings: dict) -> tuple[dict, tuple[int, int]]:
        """The n completions of one fitted prompt with its counts (a trace's outputs), and when generation
        started and ended (ns since the epoch)."""
        start = time.time_ns()
        completions = [{"index": i, **self._generate(ids, settings)} for i in range(settings["n"])]
        answer = {"completions": completions, "prompt_tokens": len(ids), "truncated_prompt_tokens": cut}
        return answer, (start, time.time_ns())

    def _generate(self, ids: list[int], settings: dict) -> dict:
        """One completion of `ids`: its text, finish_reason, completion_tokens and the stop token that ended it."""
        import torch

        sampling = {"temperature": settings["temperature"], "top_p": settings["top_p"]} if settings["do_sample"] else {}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.stop_ids or {0})
        inputs = torch.tensor([ids], device=self.model.device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=settings["max_new_tokens"],
                do_sample=settings["do_sample"],
                pad_token_id=pad,
                **sampling,
            )
        new = out[0, len(ids) :].tolist()
        stopped = next((i for i, token in enumerate(new) if token in self.stop_ids), None)
        text_ids = new if stopped is None else new[:stopped]
        return {
            "completion": self.tokenizer.decode(text_ids, skip_special_tokens=True),
            "finish_reason": "length" if stopped is None else "stop",
            "completion_tokens": len(text_ids),
            "stop_token": "" if stopped is None else self.tokenizer.decode([new[stopped]]),  # the trace's alone
        }


def context_length(model_config, tokenizer) -> int:
    """The most tokens the model reads: its position embeddings, or the tokenizer's limit when smaller."""
    limits = [getattr(model_config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [int(n) for n in limits if isinstance(n, int) and 1 < n < 1_000_000]
    if not limits:
        raise bad_request("the model's config sets no max_position_embeddings to bound a prompt")
    return min(limits)


def traces_from_environment(path) -> Traces | None:
    """The serving environment's tracing (the module docstring): None without MLFLOW_TRACKING_URI and an
    experiment variable, or when the experiment cannot be found or made (said in one warning)."""
    from mlflow.tracking import MlflowClient

    name, given_id = os.environ.get("MLFLOW_EXPERIMENT_NAME"), os.environ.get("MLFLOW_EXPERIMENT_ID")
    if not os.environ.get("MLFLOW_TRACKING_URI") or not (name or given_id):
        return None
    for variable, value in TRACE_ENV_DEFAULTS.items():
        os.environ.setdefault(variable, value)
    try:
        found = None if given_id else MlflowClient().get_experiment_by_name(name)
        experiment_id = given_id or (found.experiment_id if found else MlflowClient().create_experiment(name))
    except Exception as err:  # noqa: BLE001 (the tracking server down, a refusal: serve untraced)
        _log.warning("served policy: not tracing: experiment %r not found nor made (%s)", name, why(err, "tracking"))
        return None
    return Traces(experiment_id, {**version_tags(path), "rlhf.kind": "policy"}, TraceLosses.installed())


def version_tags(path) -> dict[str, str]:
    """rlhf.model_name and rlhf.model_version of the version in `path`, found in the registry by its MLmodel's
    run_id and model_id; {} (and one warning saying why) when not found."""
    from mlflow.models import Model
    from mlflow.tracking import MlflowClient

    found, reason = [], "its MLmodel names no run_id and model_id"
    for wait in (1, 2, 0):  # a busy registry (SQLite locked) asked again, 1 s and 3 s later
        try:
            meta = Model.load(str(path))
            if meta.run_id and meta.model_id:
                versions = MlflowClient().search_model_versions(f"run_id = '{meta.run_id}'")
                # a SQL store's search gives a version's model_id as None, and its source as models:/<model_id>
                found = [v for v in versions if meta.model_id in (v.model_id, v.source.removeprefix("models:/"))]
                reason = f"{len(found)} registered versions are its logged model {meta.model_id}"
            break
        except Exception as err:  # noqa: BLE001 (the registry down, a refusal: traces without the version)
            reason = f"the registry could not be read ({why(err, 'registry')})"
            time.sleep(wait)
    if len(found) == 1:
        return {"rlhf.model_name": found[0].name, "rlhf.model_version": str(found[0].version)}
    _log.warning("served policy: traces name no model version: %s", reason)
    return {}


class Traces:
    """A prompt answered as one MLflow trace in `experiment_id` with `tags` (the module docstring's contract)."""

    def __init__(self, experiment_id: str, tags: dict[str, str], losses: TraceLosses):
        self.experiment_id, self.tags, self.losses = str(experiment_id), tags, losses

    def record(self, prompt: str, settings: dict, answer: dict, span: tuple[int, int]) -> str:
        """The trace's id, made here (MLflow sends the trace later); "" and counted lost when MLflow made none."""
        import mlflow
        from mlflow.entities import SpanType
        from mlflow.entities.span import NoOpSpan

        inputs = {"prompt": prompt, "params": dict(settings)}
        where = {"experiment_id": self.experiment_id, "start_time_ns": span[0]}  # the generation's start
        try:
            root = mlflow.start_span_no_context("generate", SpanType.LLM, inputs=inputs, tags=self.tags, **where)
            if isinstance(root, NoOpSpan):
                raise RuntimeError("MLflow made no span (tracing disabled in this process?)")
            root.end(outputs=answer, end_time_ns=span[1])
            return root.trace_id
        except Exception as err:  # noqa: BLE001 (the answer goes out regardless)
            self.losses.lost(None, str(err))
            return ""


class TraceLosses(logging.Filter):
    """The traces MLflow could not store, counted (`count`) and each said in one line of ours: a filter on
    MLflow's `EXPORT_LOGGERS` that drops MLflow's own warning of it (which shows the tracking URI, credentials
    included) and finds the trace's id on the exporter's stack. One per process (`installed`)."""

    def __init__(self):
        super().__init__()
        self.count, self._lock = 0, threading.Lock()

    @classmethod
    def installed(cls) -> TraceLosses:
        """The process's one (known by name: a version's copy of this module and the repository's are two)."""
        loggers = [logging.getLogger(name) for name in EXPORT_LOGGERS]
        on = [f for logger in loggers for f in logger.filters if type(f).__name__ == cls.__name__]
        losses = on[0] if on else cls()
        for logger in (logger for logger in loggers if losses not in logger.filters):
            logger.addFilter(losses)
        return losses

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.getMessage().startswith(NOT_STORED):
            return True
        self.lost(_trace_id_on_stack(), record.getMessage())
        return False

    def lost(self, trace_id: str | None, detail: str) -> None:
        with self._lock:
            self.count = count = self.count + 1
        lost = f"{count} trace{'s' * (count != 1)} lost since start"
        said = (trace_id or "(id unknown)", why(detail, "tracking"), lost)
        _log.warning("served policy: trace %s was not stored (%s); %s", *said)


def _trace_id_on_stack() -> str | None:
    """The id of the trace MLflow's exporter failed to store: `trace` in its `_log_trace`, a frame below this
    call; None when not found."""
    frame = logging.currentframe()  # this function's
    while frame is not None:
        trace_id = getattr(getattr(frame.f_locals.get("trace"), "info", None), "trace_id", None)
        if isinstance(trace_id, str):
            return trace_id
        frame = frame.f_back
    return None


def why(error, server: str) -> str:
    """`error` said short: "<server> server unreachable", or its text on one line, no URL's user:password@."""
    text = " ".join(str(error).split())
    if any(word in text for word in UNREACHABLE):
        return f"{server} server unreachable"
    return re.sub(r"//[^/\s@]*@", "//", text)[:300]
