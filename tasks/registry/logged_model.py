"""A checkpoint logged as a model of its stage run: the first half of a registration, whose second half
(tasks/registry/registration.py) makes a registered version of the logged model."""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from types import ModuleType

import mlflow
from mlflow.entities import LoggedModelStatus
from mlflow.tracking import MlflowClient

# imported here, on the importing (main) thread: resolved first on the registration thread while the training
# thread loads its models, transformers' lazy modules imported each other half-way and failed with
# "cannot import name 'AutoModelForCausalLM'" (a stage resumed by a fresh process registers at once)
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_core.models.loading import MODEL_BUILDING, load_pretrained
from rlhf_core.storage.checkpoints import link_identical_files
from tasks.loaders import policy as policy_loader
from tasks.loaders import reward as reward_loader

# Packages a logged model needs to load again. Listed explicitly because MLflow's inference of
# default requirements looks for torchvision, which has no CPU build in our registries.
MODEL_REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors", "accelerate")

# MLflow runs the example once when the version is logged (short). The caller's random state is restored
# afterwards, which is only right on the thread that trains: a registration on the background thread
# (tasks/reporting/registrar.py) logs no example.
INPUT_EXAMPLE = (["Hello"], {"max_new_tokens": 2})


def model_requirements() -> list[str]:
    """MODEL_REQUIREMENTS pinned to the installed versions: what every logged model lists."""
    return [f"{pkg}=={metadata.version(pkg)}" for pkg in MODEL_REQUIREMENTS]


@lru_cache(maxsize=1)
def warm_up() -> None:
    """Pay a process's one-time costs of its first registration ahead of it (about a second on 2 cores:
    importing MLflow's transformers flavor and PEFT, which the flavor checks for, and MLflow's map of every
    installed package, which it builds to compare a model's requirements with the environment). A stage runs
    this on its registration thread while it trains (tasks/reporting/registrar.py). Never raises: a failure here
    only means the first registration pays the cost itself."""
    try:
        import mlflow.transformers  # noqa: F401
        import peft  # noqa: F401
        from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

        warn_dependency_requirement_mismatches(model_requirements())
    except Exception as err:  # noqa: BLE001
        logging.getLogger(__name__).debug("registry warm-up skipped: %s", err)


def log_checkpoint(checkpoint_dir: Path, *, task: str, tags: dict[str, str], run_id: str, input_example: bool):
    """Log a Hugging Face checkpoint directory as a logged model of the run `run_id`; its ModelInfo.

    The logged model is named `<stage>-step-<step>` from `tags` and carries the run's metrics of that step.
    On a local artifact store its weights are the checkpoint's files under a second name, not a copy.
    A logged model whose logging fails is marked FAILED.
    """
    loader = AutoModelForSequenceClassification if task == "text-classification" else AutoModelForCausalLM
    with MODEL_BUILDING:  # beside training, whose model loading imports transformers' lazy modules too
        model = load_pretrained(loader, checkpoint_dir)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    requirements = model_requirements()
    with _flavor_log_quiet():
        signature = _signature(task, model, input_example)
        logged = _initialize_logged_model(run_id, tags)
        try:
            with _random_state_kept() if input_example else nullcontext():
                loader = policy_loader if task == "text-generation" else reward_loader
                info = mlflow.models.Model.log(
                    artifact_path=None,
                    flavor=LoaderFlavor(loader),
                    transformers_model={"model": model, "tokenizer": tokenizer},
                    name=logged.name,
                    model_id=logged.model_id,
                    task=task,
                    pip_requirements=requirements,
                    step=_step_of(tags),  # the run's metrics of this step become the logged model's (MLflow: 0)
                    run_id=run_id,  # passed on to mlflow.models.Model.log
                    **signature,
                )
        except BaseException:
            mlflow.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
    link_identical_files(local_artifact_dir(info.model_id), checkpoint_dir)
    return info


def loader_module(loader: ModuleType) -> str:
    """The name a python_function loader (tasks/loaders/policy.py, tasks/loaders/reward.py) has in a version: its
    file's name before tasks/loaders/ (`served_policy`, `served_reward`), so that versions registered before and
    after read alike (`check_servable` compares it)."""
    return loader.MODULE_IN_VERSION


class LoaderFlavor:
    """What `mlflow.models.Model.log(flavor=...)` saves a checkpoint with: MLflow's transformers flavor (so
    `mlflow.transformers.load_model` still gives the model and tokenizer back), with `loader` copied into the
    version's code/ folder, under `loader_module(loader)`, as its python_function loader."""

    def __init__(self, loader: ModuleType):
        self.loader, self.__name__ = loader, loader.__name__  # the name MLflow records as the flavor's

    def save_model(self, path, mlflow_model=None, **kwargs):
        import mlflow.transformers
        from mlflow.models import Model

        mlflow_model = mlflow_model if mlflow_model is not None else Model()
        with tempfile.TemporaryDirectory() as tmp:
            copy = shutil.copyfile(self.loader.__file__, Path(tmp) / f"{loader_module(self.loader)}.py")
            code_paths = [*(kwargs.pop("code_paths", None) or []), str(copy)]
            mlflow.transformers.save_model(path=path, mlflow_model=mlflow_model, code_paths=code_paths, **kwargs)
        mlflow_model.flavors["python_function"]["loader_module"] = loader_module(self.loader)
        mlflow_model.save(str(Path(path) / "MLmodel"))


def local_artifact_dir(model_id: str | None) -> Path | None:
    """The directory of a logged model's artifacts when the artifact store is this machine's disk."""
    if not model_id:
        return None
    location = mlflow.get_logged_model(model_id).artifact_location or ""
    if not location.startswith("file:"):
        return None
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(location).path))


def _signature(task: str, model, input_example: bool) -> dict:
    """A text-generation model's signature (tasks/loaders/policy.py) and, with input_example, INPUT_EXAMPLE; a
    reward model's (tasks/loaders/reward.py)."""
    if task != "text-generation":
        return {"signature": reward_loader.score_signature()}
    signature = {"signature": policy_loader.generation_signature(model.generation_config)}
    if input_example:
        signature["input_example"] = INPUT_EXAMPLE
    return signature


def _initialize_logged_model(run_id: str, tags: dict[str, str]):
    """The logged model, created in its run's experiment: log_model would put one logged on a thread without an
    active run (the registration thread) in the Default experiment."""
    run = MlflowClient().get_run(run_id)
    return mlflow.initialize_logged_model(
        name=f"{tags.get('stage', 'model')}-step-{tags.get('step', '0')}",
        source_run_id=run_id,
        experiment_id=run.info.experiment_id,
        params=dict(run.data.params),
    )


def _step_of(tags: dict[str, str]) -> int:
    """The training step a checkpoint's tags name (0 when none)."""
    step = str(tags.get("step", "0"))
    return int(step) if step.isdigit() else 0


@contextmanager
def _flavor_log_quiet():
    """MLflow's transformers flavor logs errors only: local checkpoints have no hub model card or license to find."""
    flavor_log = logging.getLogger("mlflow.transformers")
    level = flavor_log.level
    flavor_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        flavor_log.setLevel(level)


@contextmanager
def _random_state_kept():
    """Restore Python's, NumPy's and torch's (CPU and CUDA) random states on exit."""
    import numpy as np
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
