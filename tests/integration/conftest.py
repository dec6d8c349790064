"""Fixtures of the integration tests: the four model families of tests/fixtures/real_shapes.py, and one thread."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.real_shapes import FAMILIES, build_family


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run several times faster on one thread when the CPU is shared (no spinning workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for name in FAMILIES:
        build_family(name, root)
    return root
