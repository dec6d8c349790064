"""Token-length percentiles and the table `rlhf validate` prints, pinned by hand."""

from __future__ import annotations

import pytest

from rlhf_core.data.lengths import length_table, measure, percentile


def test_nearest_rank_percentiles_by_hand():
    values = [5, 1, 4, 2, 3, 10, 9, 8, 7, 6]  # sorted: 1..10
    assert percentile(values, 50) == 5  # ceil(0.5 * 10) = 5th smallest
    assert percentile(values, 95) == 10  # ceil(9.5) = 10th
    assert percentile(values, 10) == 1 and percentile(values, 100) == 10
    assert percentile([7], 50) == 7 == percentile([7], 95)
    twenty = list(range(1, 21))
    assert (percentile(twenty, 50), percentile(twenty, 95)) == (10, 19)
    # the loop's definition, for every q: the smallest value with at least q% of the values at or below it
    for q in range(1, 101):
        expected = min(v for v in twenty if sum(w <= v for w in twenty) >= q / 100 * len(twenty))
        assert percentile(twenty, q) == expected
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 0)


def test_measure_counts_the_rows_over_the_limit_and_what_happens_to_them():
    lengths = [40, 60, 80, 100, 520, 700]
    drop = measure("prompts", "prompt", lengths, limit=512, action="drop")
    assert (drop.rows, drop.p50, drop.p95, drop.longest, drop.over, drop.kept) == (6, 80, 700, 700, 2, 4)
    assert drop.limit_field == "data.max_prompt_length" and drop.effect() == "2 dropped"
    cut = measure("prefs", "preference", lengths, limit=1024, action="truncate")
    assert (cut.over, cut.kept, cut.effect(), cut.limit_field) == (0, 6, "none over", "data.max_length")
    assert measure("prompts", "prompt", lengths, limit=100, action="truncate").effect() == "2 truncated"
    assert measure("empty", "text", [], limit=10, action="drop").rows == 0
    with pytest.raises(ValueError, match="unknown table kind"):
        measure("x", "images", [1], limit=1, action="drop")


def test_the_table_lines_up_and_names_what_it_did_not_measure():
    rows = [
        measure("preference", "preference", [100, 200, 300], limit=1024, action="truncate"),
        measure("prompts", "prompt", [40, 600], limit=512, action="drop"),
    ]
    text = length_table(rows, {"sft": "a hub data set", "eval_prompts": "a hub data set"}, "2048 tokens (config.json)")
    lines = text.splitlines()
    assert lines[0] == "Token lengths of the data, against the limits:"
    assert lines[1].split() == ["table", "rows", "p50", "p95", "max", "limit", "over", "the", "limit"]
    assert lines[2].split() == ["preference", "3", "200", "300", "300", "data.max_length", "1024", "none", "over"]
    assert lines[3].split() == ["prompts", "2", "40", "600", "600", "data.max_prompt_length", "512", "1", "dropped"]
    assert len({line.index("data.") for line in lines[2:4]}) == 1  # the limit column lines up
    assert lines[4] == "  sft, eval_prompts: not measured here (a hub data set)"
    assert lines[5] == "The policy's context: 2048 tokens (config.json)."
    only_skipped = length_table([], {"prompts": "the demo world is built by the data stage"}, "128 tokens").splitlines()
    assert len(only_skipped) == 3 and "table" not in only_skipped[1]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen2.5-instruct", "llama-3-instruct", "gpt2"])
def test_a_prompt_is_counted_as_the_rollout_encodes_it_on_real_tokenizer_shapes(name, tmp_path):
    """The limit counts what the policy is fed: the templated prompt as `tokenize_prompts` encodes it (Llama 3's
    template writes bos and the tokenizer would add another: counted once), plain text where there is no template."""
    import json

    from rlhf_core.config import DatasetSpec
    from rlhf_core.data.tables import apply_length_policy, load_table, row_lengths
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rollout.generation import tokenize_prompts
    from tests.fixtures.real_shapes import build_family, family, is_chat

    tokenizer = load_tokenizer(str(build_family(name, tmp_path)))
    questions = ["Tell me about the cat.", "Tell me about a dog. a dog runs in the park. Tell me about the queen."]
    chat = is_chat(family(name))
    rows = [{"prompt": [{"role": "user", "content": q}] if chat else q} for q in questions]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_table(DatasetSpec(path=str(path)), "prompt", field="data.prompts", tokenizer=tokenizer)
    fed = [len(ids) for ids in tokenize_prompts(tokenizer, list(ds["prompt"]), 10**6)]
    assert row_lengths(ds, "prompt", tokenizer) == fed
    if name == "llama-3-instruct":
        first = tokenize_prompts(tokenizer, list(ds["prompt"]), 10**6)[0]
        assert first.count(tokenizer.bos_token_id) == 1
    _, measured = apply_length_policy(ds, "prompt", tokenizer, max_length=64, max_prompt_length=min(fed), action="drop")
    assert (measured.longest, measured.over, measured.kept) == (max(fed), 1, 1)
