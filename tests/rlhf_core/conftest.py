"""Fixtures shared by tests/rlhf_core modules: `chat_tokenizer`, a tokenizer shaped as Qwen2.5-Instruct's (ChatML
template), built offline once per test module."""

import pytest

from rlhf_core.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from tests.fixtures.real_shapes import build_family

    return load_tokenizer(str(build_family("qwen2.5-instruct", tmp_path_factory.mktemp("fam"))))
