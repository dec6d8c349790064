"""Helpers of the test_real_shapes_*.py modules: stop tokens, pads and chat formats of four real model
families, on offline stand-ins of their checkouts (built by tests/fixtures/real_shapes.py; the
`family_root` and `one_thread` fixtures are in tests/integration/conftest.py).

The fixtures copy what decides how a response ends: Qwen2.5 base (pad == eos), Qwen2.5-Instruct and
Llama-3-Instruct (two stop ids in generation_config; Llama has no pad), GPT-2 (bos == eos, no pad).
"""

from __future__ import annotations

from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from tests.fixtures.real_shapes import build_family


def load(root, name):
    path = build_family(name, root)  # already built: reused
    return load_tokenizer(str(path)), load_causal_lm(str(path)).eval()


def ids_of(tokenizer, tokens):
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]
