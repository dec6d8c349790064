"""A registered reward model as `mlflow models serve` and `mlflow.pyfunc.load_model` run it.

A reward-model version is saved with MLflow's transformers flavor, so `mlflow.transformers.load_model` still
gives its model and tokenizer back, and with this file as its python_function loader (copied into the version's
`code/` folder, as tasks/served_policy.py is for policies). It imports nothing of this repository.

A request is `{"dataframe_records": [{"prompt": ..., "completion": ...}, ...]}` and, optionally per record,
`prompt_ids` and `completion_ids` (lists of token ids: this model's tokenizer must be the one that made them).
The answer is one record per input, `{"score": float}`: the score head read at the last token of prompt +
completion, as the pipeline's in-process reward model reads it (`rlhf_core/models/forward.py` head_per_token:
not the classifier's own pooling, which with pad == eos reads the token before the eos). Without ids, the
prompt is tokenized as the tokenizer does by default (no second BOS after a rendered one) and the completion
without special tokens, then joined. A bad request is answered 400 with one sentence.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

LOADER_MODULE = Path(__file__).stem
BATCH = 16  # sequences per forward pass


def score_signature():
    """No input schema (`records_of` checks the inputs; MLflow's enforcement would drop the id lists), a score out."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    return ModelSignature(inputs=None, outputs=Schema([ColSpec("double", "score")]))


def save_model(path, mlflow_model=None, **kwargs):
    """MLflow's transformers save_model, with this file copied in as the python_function loader."""
    import mlflow.transformers
    from mlflow.models import Model

    mlflow_model = mlflow_model if mlflow_model is not None else Model()
    code_paths = [*(kwargs.pop("code_paths", None) or []), __file__]
    mlflow.transformers.save_model(path=path, mlflow_model=mlflow_model, code_paths=code_paths, **kwargs)
    mlflow_model.flavors["python_function"]["loader_module"] = LOADER_MODULE
    mlflow_model.save(str(Path(path) / "MLmodel"))


def log_model(**kwargs):
    """`mlflow.transformers.log_model`'s arguments; the version is saved by `save_model`."""
    from mlflow.models import Model

    return Model.log(artifact_path=None, flavor=sys.modules[__name__], **kwargs)


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
        record["ids"] = ids[0] + ids[1] if ids[0] is not None else None
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
    """Scores for the scoring server: BATCH sequences per forward pass, right-padded."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.limit = getattr(model.config, "max_position_embeddings", None)

    def predict(self, data, params=None):
        import pandas as pd

        records = records_of(data)
        sequences = [r["ids"] if r["ids"] is not None else self._encode(r) for r in records]
        for index, ids in enumerate(sequences):
            if self.limit is not None and len(ids) > self.limit:
                raise bad_request(f"record {index} has {len(ids)} tokens; this model reads at most {self.limit}")
        scores = []
        for start in range(0, len(sequences), BATCH):
            scores += self._scores(sequences[start : start + BATCH])
        return pd.DataFrame({"score": scores})

    def _encode(self, record: dict) -> list[int]:
        bos = self.tokenizer.bos_token
        rendered_bos = bool(bos) and record["prompt"].startswith(bos)
        prompt = self.tokenizer(record["prompt"], add_special_tokens=not rendered_bos)["input_ids"]
        completion = self.tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        if not prompt + completion:
            raise bad_request("a record's prompt and completion are both empty")
        return list(prompt) + list(completion)

    def _scores(self, sequences: list[list[int]]) -> list[float]:
        import torch

        width = max(len(ids) for ids in sequences)
        device = self.model.device
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids, device=device)
            mask[row, : len(ids)] = 1
        backbone = getattr(self.model, self.model.base_model_prefix)
        with torch.no_grad():
            hidden = backbone(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                use_cache=False,
            ).last_hidden_state
            per_token = self.model.score(hidden).squeeze(-1).float()
        last = mask.sum(1) - 1
        return per_token[torch.arange(len(sequences), device=device), last].tolist()
