"""rlhf_core/storage/saving.py: atomic directories (replace only what we created) and published modes that follow the umask."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from rlhf_core.storage.ownership import (
    ATOMIC_CREATOR,
    MARKER,
    OwnershipError,
    is_owned,
    read_marker,
)
from rlhf_core.storage.saving import atomic_dir
from tests.fixtures.user_files import filled, tree_hash


def test_atomic_dir_refuses_to_replace_a_directory_it_did_not_create(tmp_path):
    target = filled(tmp_path / "checkpoint-2")
    before = tree_hash(tmp_path)
    with pytest.raises(OwnershipError, match=r"^refusing to replace .*checkpoint-2: it is a non-empty directory"):
        with atomic_dir(target) as tmp:
            (tmp / "weights").write_text("new")
    assert tree_hash(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # no temporary left behind


def test_atomic_dir_marks_what_it_creates_and_replaces_only_that(tmp_path):
    target = tmp_path / "export"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("1")
    assert is_owned(target) and read_marker(target)["created_by"] == ATOMIC_CREATOR
    with atomic_dir(target) as tmp:
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_saved_files_follow_the_umask(tmp_path):
    # safetensors writes 0600 files and mkdtemp makes 0700 directories; the published modes follow the umask
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "ckpt") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "policy").mkdir(mode=0o700)
            save_file({"w": torch.zeros(2)}, str(tmp / "policy" / "model.safetensors"))
        os.umask(0o027)
        with atomic_dir(tmp_path / "private") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    ckpt = tmp_path / "ckpt"
    assert (mode(ckpt), mode(ckpt / "policy")) == (0o755, 0o755)
    assert {mode(p) for p in ckpt.rglob("*") if p.is_file()} == {0o644}
    assert mode(tmp_path / "private" / "model.safetensors") == 0o640 and mode(tmp_path / "private") == 0o750
