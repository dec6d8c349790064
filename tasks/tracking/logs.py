"""What the pipeline logs to an MLflow run: metrics, figures, artifacts, tables, dataset inputs, tags, its
description, and links to its artifacts. Every write is skipped on the processes of a data-parallel stage other
than rank 0 (`tasks.tracking.store.writes`).

Numbers are rounded where they are logged, for the person who reads them: a metric to `METRIC_DIGITS`
significant digits (MLflow's charts and tables otherwise show a float32 mean as 0.10000000149011612), a table's
floats to `TABLE_DIGITS`. The full values stay in the stage's own files (its evaluation Parquet files,
metrics.json). A table is a CSV artifact: MLflow's UI shows a .csv file as a table, a .json or .parquet one not at
all."""

from __future__ import annotations

import csv
import io
import json
import math
import numbers
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import mlflow
from mlflow.entities import LoggedModelOutput, Metric
from mlflow.tracking import MlflowClient

from rlhf_core.config.redaction import redact
from tasks.tracking.store import writes

METRIC_DIGITS, TABLE_DIGITS = 6, 4


def rounded(value: float, digits: int) -> float:
    """`value` to `digits` significant digits, never rounded left of the decimal point (a count stays exact);
    inf and nan as they are."""
    value = float(value)
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))


def log_metrics(run_id: str, metrics: dict[str, float], step: int) -> None:
    """Log a metric dict at `step` to the given run, each value to METRIC_DIGITS significant digits."""
    if not writes():
        return
    now = int(time.time() * 1000)
    batch = [Metric(k, rounded(v, METRIC_DIGITS), now, step) for k, v in metrics.items()]
    MlflowClient().log_batch(run_id, metrics=batch)


def log_figure(run_id: str, figure, artifact_file: str) -> None:
    """Log a matplotlib figure as a PNG artifact of the run."""
    if not writes():
        return
    MlflowClient().log_figure(run_id, figure, artifact_file)


def log_artifact(run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    if not writes():
        return
    MlflowClient().log_artifact(run_id, str(path), artifact_path)


def _shown(value):
    """A table cell as it is shown: a float (Python's or NumPy's; not a bool or an int) to TABLE_DIGITS
    significant digits."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return rounded(value, TABLE_DIGITS)
    return value


def table_csv(rows: list[dict]) -> str:
    """Rows as CSV text (RFC 4180): a header of every key in the order first seen, a cell holding a comma, a quote
    or a line break quoted (a completion's newlines survive), a float to TABLE_DIGITS significant digits, a list
    or dict as JSON, None empty."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = io.StringIO()
    writer = csv.writer(out)  # QUOTE_MINIMAL with \r\n rows: a cell with \r or \n is quoted
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(key)) for key in columns])
    return out.getvalue()


def _cell(value):
    if getattr(value, "ndim", 0) > 0:  # a NumPy array (a list column read back from Parquet)
        value = value.tolist()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return _shown(value)


def log_table(run_id: str, rows: list[dict], artifact_file: str) -> None:
    """Log rows as a table artifact of the run (a new file per call; nothing is overwritten), floats to
    TABLE_DIGITS significant digits: a `.csv` artifact_file as CSV (`table_csv`), which MLflow's UI shows as a
    table; any other name in MLflow's own table format (`MlflowClient.log_table`: JSON, which its UI does not
    preview)."""
    if not writes() or not rows:
        return
    if artifact_file.endswith(".csv"):
        MlflowClient().log_text(run_id, table_csv(rows), artifact_file)
        return
    columns = {key: [_shown(row.get(key)) for row in rows] for key in rows[0]}
    MlflowClient().log_table(run_id, data=columns, artifact_file=artifact_file)


def _dataset_source(source: str, split: str | None, revision: str | None):
    """An MLflow DatasetSource for a data.* path: 'demo' (made by code), a URL, a local path or glob, or a hub name."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if source == "demo":
        return CodeDatasetSource(tags={"rlhf.source": "demo"})
    if source.startswith(("http://", "https://")):
        return HTTPDatasetSource(url=source)
    local = Path(source).expanduser()
    if "://" in source or local.exists() or local.parent.is_dir() and any(c in source for c in "*?["):
        try:
            return resolve_dataset_source(source if "://" in source else str(local.resolve()))
        except mlflow.exceptions.MlflowException:
            return CodeDatasetSource(tags={"rlhf.source": source})
    return HuggingFaceDatasetSource(path=source, split=split, revision=revision)


def log_datasets(run_id: str, datasets: list[dict]) -> None:
    """Log each prepared table as an MLflow dataset input of the run.

    Each entry: name (the config field, e.g. data.preference), source (the user's path, hub name or
    'demo'; credentials are masked here), digest (the table's fingerprint), context (training or
    evaluation), and optionally split, revision and rows (recorded as input tags).
    """
    if not writes() or not datasets:
        return
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = []
    for entry in datasets:
        source = _dataset_source(redact(str(entry["source"])), entry.get("split"), entry.get("revision"))
        dataset = MetaDataset(source, name=entry["name"], digest=entry["digest"])
        tags = [InputTag(MLFLOW_DATASET_CONTEXT, entry["context"])]
        tags += [InputTag(f"rlhf.{k}", str(entry[k])) for k in ("rows", "split") if entry.get(k) is not None]
        inputs.append(DatasetInput(dataset=dataset._to_mlflow_entity(), tags=tags))
    MlflowClient().log_inputs(run_id, datasets=inputs)


def set_run_tags(run_id: str, tags: dict[str, str]) -> None:
    if not writes():
        return
    client = MlflowClient()
    for key, value in tags.items():
        client.set_tag(run_id, key, str(value))


DESCRIPTION = "mlflow.note.content"  # the tag MLflow's UI shows (and edits) as a run's description


def describe_run(run_id: str, text: str, keep: bool = False) -> None:
    """Set the run's description, the Markdown its page in MLflow's UI shows first. keep: `text` goes above
    what the description says already (a guard rollback's sentence on an RL stage run), once."""
    if not writes():
        return
    if keep:
        existing = MlflowClient().get_run(run_id).data.tags.get(DESCRIPTION, "")
        if text in existing:
            return
        text = f"{text}\n\n{existing}" if existing else text
    set_run_tags(run_id, {DESCRIPTION: text})


def stage_runs(parent_run_id: str) -> dict[str, str]:
    """Stage name (tag `rlhf.stage`) -> the id of its newest FINISHED stage run under `parent_run_id` (a stage
    reused whole has none: its empty run was deleted)."""
    client = MlflowClient()
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time ASC"],
        max_results=1000,
    )
    return {r.data.tags["rlhf.stage"]: r.info.run_id for r in runs if "rlhf.stage" in r.data.tags}


def ui_page(fragment: str, label: str) -> str | None:
    """A Markdown link to the MLflow UI page `#/<fragment>` when the tracking server is http(s), else None."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return None
    return f"[{label}]({redact(uri).rstrip('/')}/#/{fragment})"


def artifact_link(run_id: str, artifact_path: str) -> str:
    """Where a person opens a run's artifact, as Markdown: a link to the MLflow UI's page when the tracking
    server is http(s), else the file's path on this machine as code (an http page cannot open file:// links)."""
    run = MlflowClient().get_run(run_id)
    page = ui_page(f"experiments/{run.info.experiment_id}/runs/{run_id}/artifacts/{artifact_path}", artifact_path)
    if page:
        return page
    location = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path}"
    if location.startswith("file:"):
        location = unquote(urlparse(location).path)
    return f"`{location}`"


def run_link(run_id: str) -> str:
    """The run's MLflow UI page as a Markdown link on a server, else its id and the store to open it from."""
    run = MlflowClient().get_run(run_id)
    page = ui_page(f"experiments/{run.info.experiment_id}/runs/{run_id}", f"run {run.info.run_name}")
    return page or f"run `{run.info.run_name}` ({run_id}) in `{redact(mlflow.get_tracking_uri())}`"


def version_link(uri: str) -> str:
    """A model version (models:/name/N) as a link to its MLflow UI page on a server, else as code."""
    name, version = uri.removeprefix("models:/").rsplit("/", 1)
    return ui_page(f"models/{name}/versions/{version}", uri) or f"`{uri}`"


def link_model(run_id: str, uri: str, step: int) -> None:
    """List the model version `uri` (models:/name/N) among the run's logged models, and name it in the tag
    `rlhf.candidate`: the pipeline's run links to the candidate its export stage registered."""
    if not writes():
        return
    client = MlflowClient()
    name, version = uri.removeprefix("models:/").rsplit("/", 1)
    found = client.get_model_version(name, version)
    # a version registered from a logged model's URI (models:/m-...) names it in its source
    model_id = found.model_id or (
        found.source.removeprefix("models:/") if found.source.startswith("models:/m-") else None
    )
    if model_id:
        client.log_outputs(run_id, [LoggedModelOutput(model_id, step)])
    client.set_tag(run_id, "rlhf.candidate", uri)
