"""`make venv` installs the torch build a user asks for: TORCH_INDEX names the index that serves it, and empty
(CI here) leaves the choice to pip's configuration (this machine's CPU wheel on disk). Read from make's dry run
of a fresh environment, so nothing is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def torch_install_line(tmp_path: Path, *variables: str) -> str:
    """The pip command of `make venv` that installs torch, for a venv that does not exist yet."""
    out = subprocess.run(
        ["make", "-n", "-B", "-C", str(REPO), "venv", f"VENV={tmp_path / 'venv'}", *variables],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    [line] = [line for line in out.splitlines() if "pip install" in line and "torch==" in line]
    return line


def test_without_torch_index_pip_configuration_picks_the_build(tmp_path):
    line = torch_install_line(tmp_path)
    assert "torch==2.13.0" in line and "--index-url" not in line and "--extra-index-url" not in line


@pytest.mark.parametrize("flavour", ["cpu", "cu130"])
def test_torch_index_names_the_build_and_pypi_serves_the_rest(tmp_path, flavour):
    index = f"https://download.pytorch.org/whl/{flavour}"
    line = torch_install_line(tmp_path, f"TORCH_INDEX={index}")
    assert f"--index-url {index} --extra-index-url https://pypi.org/simple" in line
    assert "torch==2.13.0" in line
