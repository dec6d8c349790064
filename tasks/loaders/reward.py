"""A registered reward model as `mlflow models serve` and `mlflow.pyfunc.load_model` run it.

A reward-model version is saved with MLflow's transformers flavor, so `mlflow.transformers.load_model` still
gives its model and tokenizer back, and with this file as its python_function loader (copied into the version's
`code/` folder under `MODULE_IN_VERSION` by tasks/registry/logged_model.py `LoaderFlavor`, as
tasks/loaders/policy.py is for policies). It imports nothing of this repository.

A request is `{"dataframe_records": [{"prompt": ..., "completion": ...}, ...]}` and, optionally per record,
`prompt_ids` and `completion_ids` (lists of token ids: this model's tokenizer must be the one that made them).
The answer is one record per input, `{"score": float}`: the score head read at the last token of prompt +
completion, as the pipeline's in-process reward model reads it (`rlhf_core/models/forward.py` head_per_token:
not the classifier's own pooling, which with pad == eos reads the token before the eos). Without ids, the
prompt is tokenized as the tokenizer does by default (no second BOS after a rendered one) and the completion
without special tokens, then joined. A bad request is answered 400 with one sentence.
"""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

# this file's module name inside a version (its code/ folder and MLmodel's loader_module): its name before
# tasks/loaders/, kept so that the versions registered before and after name their loader alike
MODULE_IN_VERSION = "served_reward"

# the widths a request may lay its records out in, as the RL stage holds its rollout (bit-equal scores)
WIDTH_PARAMS = ("prompt_width", "completion_width")


def score_signature():
    """No input schema (`records_of` checks the inputs; MLflow's enforcement would drop the id lists), a score
    out, and the per-request WIDTH_PARAMS (0: the longest prompt and completion of the request)."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    params = ParamSchema([ParamSpec(name, "long", 0) for name in WIDTH_PARAMS])
    return ModelSignature(inputs=None, outputs=Schema([ColSpec("double", "score")]), params=params)


def _load_pyfunc(path, model_config=None):
    import mlflow.transformers
    import torch

    components = mlflow.transformers.load_model(str(path), return_type="components")
    model = components["model"]
    if torch.cuda.is_available():
        model = model.to("cuda")
    return ServedReward(model.eval(), components["tokenizer"])


def bad_request(message: str) -> MlflowException:
    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


def records_of(data) -> list[dict]:
    """The request's records: a table (dataframe_records or split) or a list of mappings, each with a prompt and a
    completion string and, optionally, both prompt_ids and completion_ids."""
    import pandas as pd

    records = data.to_dict("records") if isinstance(data, pd.DataFrame) else data
    if not isinstance(records, list) or not records:
        raise bad_request("inputs must be a non-empty list of records with prompt and completion")
    for index, record in enumerate(records):
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "completion")):
            raise bad_request(f"record {index} must hold a prompt and a completion string")
        ids = [_ids(record.get(k)) for k in ("prompt_ids", "completion_ids")]
        if (ids[0] is None) != (ids[1] is None):
            raise bad_request(f"record {index} has one of prompt_ids and completion_ids: give both or neither")
        if ids[0] is not None and not ids[0] + ids[1]:
            raise bad_request(f"record {index}'s prompt_ids and completion_ids are both empty")
        record["ids"] = (ids[0], ids[1]) if ids[0] is not None else None
    return records


def _ids(value) -> list[int] | None:
    """A list of token ids from a record's cell (a list, a NumPy array, or nothing: NaN, None)."""
    if value is None or isinstance(value, float):
        return None
    try:
        ids = [int(i) for i in list(value)]
    except (TypeError, ValueError):
        raise bad_request(f"token ids must be a list of integers, got {str(value)[:40]}") from None
    return ids


class ServedReward:
    """Scores for the scoring server: a request's records in one forward pass, laid out as the RL stage holds a
    rollout (prompts left-padded, completions right-padded; `layout`), so that the scores of the same ids in
    the same widths are the in-process reward model's bit for bit on the same machine."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.limit = getattr(model.config, "max_position_embeddings", None)

    def predict(self, data, params=None):
        import pandas as pd

        records = records_of(data)
        pairs = [r["ids"] if r["ids"] is not None else self._encode(r) for r in records]
        widths = [_width(params, name) for name in WIDTH_PARAMS]
        for index, (prompt, completion) in enumerate(pairs):
            if self.limit is not None and len(prompt) + len(completion) > self.limit:
                raise bad_request(
                    f"record {index} has {len(prompt) + len(completion)} tokens; this model reads at most {self.limit}"
                )
        return pd.DataFrame({"score": self._scores(pairs, *widths)})

    def _encode(self, record: dict) -> tuple[list[int], list[int]]:
        bos = self.tokenizer.bos_token
        rendered_bos = bool(bos) and record["prompt"].startswith(bos)
        prompt = self.tokenizer(record["prompt"], add_special_tokens=not rendered_bos)["input_ids"]
        completion = self.tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        if not prompt + completion:
            raise bad_request("a record's prompt and completion are both empty")
        return list(prompt), list(completion)

    def _scores(self, pairs: list[tuple[list[int], list[int]]], prompt_width: int, completion_width: int):
        import torch

        input_ids, mask, last = layout(pairs, prompt_width, completion_width)
        device = self.model.device
        backbone = getattr(self.model, self.model.base_model_prefix)
        with torch.no_grad():
            hidden = backbone(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                position_ids=(mask.cumsum(1) - 1).clamp(min=0).to(device),
                use_cache=False,
            ).last_hidden_state
            per_token = self.model.score(hidden).squeeze(-1).float()
        return per_token[torch.arange(len(pairs), device=device), last.to(device)].tolist()


def _width(params: dict | None, name: str) -> int:
    value = (params or {}).get(name, 0) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"params.{name} must be a whole number of tokens (0: the longest of the request)")
    return value


def layout(pairs: list[tuple[list[int], list[int]]], prompt_width: int = 0, completion_width: int = 0):
    """(input_ids, attention_mask, last position) of (prompt ids, completion ids) pairs: prompts left-padded to
    prompt_width, completions right-padded to completion_width (0: the longest; a shorter width is refused), the
    score read at each completion's last token (a prompt's last one when the completion is empty)."""
    import torch

    longest = max(len(p) for p, _ in pairs), max(len(c) for _, c in pairs)
    for name, width, need in zip(WIDTH_PARAMS, (prompt_width, completion_width), longest):
        if width and width < need:
            raise bad_request(f"params.{name} {width} is shorter than a record's {need} tokens")
    width_p, width_c = prompt_width or longest[0], completion_width or longest[1]
    input_ids = torch.zeros((len(pairs), width_p + width_c), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (prompt, completion) in enumerate(pairs):
        start = width_p - len(prompt)
        input_ids[row, start : width_p + len(completion)] = torch.tensor(prompt + completion, dtype=torch.long)
        mask[row, start : width_p + len(completion)] = 1
    last = torch.tensor([width_p + len(c) - 1 for _, c in pairs])
    return input_ids, mask, last
