"""A registered policy as `mlflow models serve` and `mlflow.pyfunc.load_model` run it.

A policy version is saved with MLflow's transformers flavor, so `mlflow.transformers.load_model` still
gives its model and tokenizer back, and with this file as its python_function loader: registration
(tasks/registry/logged_model.py `LoaderFlavor`) copies the file into the version (its `code/` folder) under
`MODULE_IN_VERSION` and names it there. It imports nothing of this repository,
so a version serves wherever its requirements are installed (keep it that way: a test loads it alone).

A request is `{"inputs": [prompt, ...], "params": {...}}`, each prompt a string as the client renders it
(a chat model's template applied), params the signature's (`generation_signature`). The answer is one
record per prompt:

- completion: the new text only, "" when the model stopped at once (never the prompt echoed back);
- finish_reason: "stop" (a stop token ended it) or "length" (max_new_tokens did);
- prompt_tokens, completion_tokens: the counts the model saw and wrote;
- truncated_prompt_tokens: how many tokens were cut from the prompt's left (after its BOS token, which is
  kept) to leave max_new_tokens of room in the model's context; 0 when it fitted.

Temperature 0 means greedy decoding (as in OpenAI's API and vLLM). A bad request raises MlflowException(INVALID_PARAMETER_VALUE): the scoring server answers 400 with one
sentence and no stack trace.
"""

from __future__ import annotations

import math

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
)


# the per-request generation params: name -> (MLflow type, Python type, default where the generation_config sets none)
GENERATION_PARAMS = {
    "max_new_tokens": ("long", int, DEFAULT_MAX_NEW_TOKENS),
    "temperature": ("double", float, 1.0),
    "top_p": ("double", float, 1.0),
    "do_sample": ("boolean", bool, False),
}


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
    return ServedPolicy(model.eval(), components["tokenizer"])


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
    elif isinstance(data, str):
        values = [data]
    elif isinstance(data, (list, tuple)):
        values = list(data)
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
    """Generation for the scoring server: one prompt at a time, the version's generation_config as defaults."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        config = model.generation_config
        self.defaults = generation_defaults(config)
        stop = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = {int(i) for i in (stop if isinstance(stop, (list, tuple)) else [stop]) if i is not None}
        self.context = context_length(model.config, tokenizer)

    def predict(self, data, params=None):
        import pandas as pd

        prompts = prompts_of(data)
        settings = generation_settings(params, self.defaults, self.context)
        rows = [self._complete(index, prompt, settings) for index, prompt in enumerate(prompts)]
        return pd.DataFrame(rows, columns=[name for name, _ in OUTPUT_COLUMNS])

    def _encode(self, prompt: str) -> tuple[list[int], bool]:
        """The prompt's ids, and whether the first is a BOS token (the rendered template already has one:
        no second is added)."""
        bos = self.tokenizer.bos_token
        rendered_bos = bool(bos) and prompt.startswith(bos)
        ids = self.tokenizer(prompt, add_special_tokens=not rendered_bos)["input_ids"]
        has_bos = bool(ids) and self.tokenizer.bos_token_id is not None and ids[0] == self.tokenizer.bos_token_id
        return list(ids), has_bos

    def _complete(self, index: int, prompt: str, settings: dict) -> dict:
        import torch

        ids, has_bos = self._encode(prompt)
        if not ids:
            raise bad_request(f"inputs[{index}] is empty and this tokenizer adds no start token to generate from")
        ids, cut = fit_prompt(ids, self.context - settings["max_new_tokens"], keep_first=has_bos)
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
            "prompt_tokens": len(ids),
            "completion_tokens": len(text_ids),
            "truncated_prompt_tokens": cut,
        }


def context_length(model_config, tokenizer) -> int:
    """The most tokens the model reads: its position embeddings, or the tokenizer's limit when smaller."""
    limits = [getattr(model_config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [int(n) for n in limits if isinstance(n, int) and 1 < n < 1_000_000]
    if not limits:
        raise bad_request("the model's config sets no max_position_embeddings to bound a prompt")
    return min(limits)
