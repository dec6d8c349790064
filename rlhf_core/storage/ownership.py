"""Owned writes: the pipeline replaces or deletes only directories it created.

Every directory the pipeline creates carries a marker file, `.rlhf-owned`, a small JSON document
saying what created it, when, and by which process. `training.atomic_dir` writes it into each
directory it fills (checkpoints, SFT and reward saves, exports) and refuses to replace an existing
directory without it; the pipeline writes it into `run.output_dir` when it first uses it.

`check_output_dir` is the check made before any work: it refuses an output path that is the
filesystem root, the home directory, the working directory, the same as or an ancestor of the run
directory or of an input, or an existing non-empty directory without the marker.

`remove_orphan_temps` deletes the hidden temporary directories of `atomic_dir` that a killed run
left behind, recognised by the marker they carry from their creation.

Directories made by runs before markers existed have none: such a non-empty `run.output_dir` is
refused with a sentence asking for an empty or new directory (nothing in it is touched).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from rlhf_core.config.errors import UserError

MARKER = ".rlhf-owned"
# created_by of the directories atomic_dir (rlhf_core/storage/saving.py) fills. It names no importable function
# (atomic_dir moved): it is an identifier on disk, written into the markers of earlier runs and compared by
# remove_orphan_temps and prune_checkpoints to recognise what they may remove, so it keeps its old spelling
ATOMIC_CREATOR = "rlhf_core.training.atomic_dir"
GLOB_CHARS = "*?["

logger = logging.getLogger(__name__)


class OwnershipError(UserError):
    """An output path the pipeline must not write into, replace or delete."""


def host_id() -> str:
    """This machine, as a short hash of its name: markers travel with checkpoints into registries and
    exports, so they carry no host name."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]


def marker_payload(created_by: str, **extra) -> dict:
    return {
        "created_by": created_by,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": host_id(),
        "pid": os.getpid(),
        **extra,
    }


def write_marker(directory: str | Path, created_by: str, **extra) -> Path:
    """Write `<directory>/.rlhf-owned` (the directory must exist); return its path."""
    path = Path(directory) / MARKER
    path.write_text(json.dumps(marker_payload(created_by, **extra)) + "\n")
    return path


def is_owned(directory: str | Path) -> bool:
    """True when `directory` carries the pipeline's marker."""
    return (Path(directory) / MARKER).is_file()


def read_marker(directory: str | Path) -> dict | None:
    """The marker's JSON, or None when there is none or it cannot be read."""
    try:
        return json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def claim_dir(directory: str | Path, created_by: str) -> Path:
    """Create `directory` (and parents) if needed and mark it ours unless already marked.

    Call only after `check_output_dir` accepted it: an existing non-empty unmarked directory is refused.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not is_owned(directory):
        write_marker(directory, created_by)
    return directory


def _resolved(path: str | Path) -> Path:
    # no ~ expansion: the pipeline writes to the path as given, so that is the path checked
    return Path(os.path.abspath(str(path))).resolve()


def _is_ancestor_or_same(parent: Path, child: Path) -> bool:
    return parent == child or parent in child.parents


def local_input_path(source: str | Path) -> Path | None:
    """The existing local path an input names (a glob: its fixed leading directories), else None.

    Hub names, models:/ URIs and paths that do not exist hold nothing an output could overwrite.
    """
    text = str(source)
    if "://" in text or text.startswith("models:/"):
        return None
    if any(c in text for c in GLOB_CHARS):
        parts = Path(text).parts
        fixed = []
        for part in parts:
            if any(c in part for c in GLOB_CHARS):
                break
            fixed.append(part)
        if not fixed:
            return None
        text = str(Path(*fixed))
    path = Path(text)
    return path if path.exists() else None


def check_output_dir(
    path: str | Path,
    *,
    field: str,
    inputs: Mapping[str, str | Path] | None = None,
    home: str | Path | None = None,
    cwd: str | Path | None = None,
) -> Path:
    """Refuse (OwnershipError) an output directory the pipeline must not write into; return it resolved.

    field: the config field named in the error. inputs: {description: path} the output must be neither
    nor contain (the run directory for the export, data files, model directories). home, cwd: default
    to the current ones. Refused: the filesystem root, the home directory, the working directory, the
    same as or an ancestor of an input, an existing file, an existing non-empty directory without the
    marker. Reads the filesystem, never writes it.
    """
    out = _resolved(path)
    home = _resolved(home if home is not None else Path.home())
    cwd = _resolved(cwd if cwd is not None else Path.cwd())
    if out.parent == out:
        raise OwnershipError(f"{field} {path} is the filesystem root; choose a new directory for the pipeline's output")
    if out == home:
        raise OwnershipError(f"{field} {path} is the home directory; choose a new directory for the pipeline's output")
    if out == cwd:
        raise OwnershipError(
            f"{field} {path} is the current working directory; choose a new directory for the pipeline's output"
        )
    for what, source in (inputs or {}).items():
        target = _resolved(source)
        if _is_ancestor_or_same(out, target):
            relation = "is" if out == target else "contains"
            raise OwnershipError(
                f"{field} {path} {relation} {what} {source}, which the pipeline must not overwrite; "
                "choose a separate directory for the output"
            )
    if out.exists() and not out.is_dir():
        raise OwnershipError(
            f"{field} {path} is an existing file, not a directory; choose a new directory for the pipeline's output"
        )
    if out.is_dir() and not is_owned(out) and any(out.iterdir()):
        raise OwnershipError(
            f"{field} {path} is a non-empty directory the pipeline did not create (it has no {MARKER} "
            "marker); choose an empty or new directory so nothing in it is overwritten or deleted"
        )
    return out


def pipeline_inputs(cfg, extra: Mapping[str, str | Path] | None = None) -> dict[str, Path]:
    """{config field: existing local path} of every input the config reads (data files, model directories)."""
    from rlhf_core.config import DEMO

    sources: dict[str, str | Path | None] = {
        "model.base": cfg.model.base,
        "model.tokenizer": cfg.model.tokenizer,
        "reward.base": cfg.reward.base,
        "data.preference.path": cfg.data.preference.path,
        "data.preference_eval.path": cfg.data.preference_eval.path,
        "data.prompts.path": cfg.data.prompts.path,
        "data.eval_prompts.path": cfg.data.eval_prompts.path,
        "run.accelerate_config": cfg.run.accelerate_config,
    }
    if cfg.sft.enabled:
        sources["sft.dataset.path"] = cfg.sft.dataset.path
    for i, reward in enumerate(getattr(cfg.grpo, "rewards", None) or []):
        if reward.model is not None:
            sources[f"grpo.rewards[{i}].model"] = reward.model
    sources.update(extra or {})
    found = {}
    for name, source in sources.items():
        if source is None or str(source) in (DEMO, "policy", "reward_stage"):
            continue
        local = local_input_path(source)
        if local is not None:
            found[name] = local
    return found


def check_pipeline_outputs(cfg, *, config_path: str | Path | None = None, claim: bool = True) -> None:
    """Check run.output_dir and the export directory before any work; then mark run.output_dir ours.

    Raises OwnershipError with one sentence naming the field and the path; writes nothing then.
    """
    extra = {"the config file": config_path} if config_path is not None else {}
    inputs = pipeline_inputs(cfg, extra)
    check_output_dir(cfg.run.output_dir, field="run.output_dir", inputs=inputs)
    check_output_dir(cfg.export_dir, field="export.output_dir", inputs={**inputs, "run.output_dir": cfg.run.output_dir})
    if claim:
        claim_dir(cfg.run.output_dir, "rlhf pipeline run.output_dir")
        remove_orphan_temps(cfg.run.output_dir)
        remove_orphan_temps(_resolved(cfg.export_dir).parent)


def _alive_here(marker: dict) -> bool:
    """True when the marker's writer may still be running: same host and its pid exists."""
    if marker.get("host") != host_id() or not isinstance(marker.get("pid"), int):
        return False
    return marker["pid"] == os.getpid() or pid_alive(marker["pid"])


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this machine (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _unmarked_empty_temp(path: Path) -> bool:
    """A directory named as `atomic_dir` names its temporaries (`.<name>-` + 8 random characters) that holds
    nothing, or only a marker file that is empty or cut short: what a kill leaves in the instant between
    creating the temporary and writing its marker."""
    if not re.fullmatch(r"\..+-[a-z0-9_]{8}", path.name):
        return False
    entries = list(path.iterdir())
    return not entries or (
        len(entries) == 1 and entries[0].name == MARKER and entries[0].is_file() and entries[0].stat().st_size < 4096
    )


def remove_orphan_temps(directory: str | Path) -> list[Path]:
    """Delete the temporary directories `atomic_dir` left in `directory` when a run was killed; return them.

    Only ours: hidden directories carrying the marker written by `atomic_dir`, whose writer process is
    no longer running on this host (a different host counts as not running). Anything else is left
    alone. A previous directory that `atomic_dir` had moved aside when the run was killed, and whose
    replacement never arrived, is put back first.
    """
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        if not path.name.startswith(".") or path.is_symlink() or not path.is_dir():
            continue
        marker = read_marker(path)
        if marker is None and _unmarked_empty_temp(path):
            # killed between creating the directory and finishing its marker: nothing in it to lose
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        if marker is None or marker.get("created_by") != ATOMIC_CREATOR or _alive_here(marker):
            continue
        name = marker.get("aside_of")
        if isinstance(name, str) and "/" not in name and (path / name).is_dir() and not (directory / name).exists():
            (path / name).rename(directory / name)
            logger.warning("put %s back: a save that was replacing it was interrupted", directory / name)
        shutil.rmtree(path, ignore_errors=True)
        logger.warning("removed %s, a temporary directory left by an interrupted save", path)
        removed.append(path)
    return removed
