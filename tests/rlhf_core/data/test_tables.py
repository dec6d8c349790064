"""rlhf_core/data/tables.py: tables are loaded with the pipeline's columns, measured against the length limits and
fingerprinted."""

import pandas as pd
import pytest

from rlhf_core.config import ColumnMap, DatasetSpec
from rlhf_core.data.rows import DataValidationError
from rlhf_core.data.tables import apply_length_policy, count_checked_rows, fingerprint_rows, load_table
from rlhf_core.models.loading import load_tokenizer
from tests.fixtures.tables import BYE, CHATML_PROMPT, GOOD, HELLO, USER, load, write_jsonl


def test_limit(tmp_path):
    assert len(load(write_jsonl(tmp_path / "p.jsonl", GOOD), limit=2)) == 2


def test_missing_column_names_the_columns_and_the_config_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a"}])
    with pytest.raises(
        DataValidationError,
        match=r"has no column `rejected` \(columns are \['prompt', 'chosen'\]\); map it with data.preference.columns",
    ):
        load(path)


def test_prompt_and_text_kinds(tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a"}, {"prompt": ""}])
    with pytest.raises(DataValidationError, match="row 2 column `prompt` is empty"):
        load_table(DatasetSpec(path=str(prompts)), "prompt", field="data.prompts")
    text = write_jsonl(tmp_path / "text.jsonl", [{"body": "hello there"}])
    ds = load_table(DatasetSpec(path=str(text), columns=ColumnMap(text="body")), "text", field="sft.dataset")
    assert ds[0] == {"text": "hello there"}


def test_length_policy_counts_truncates_and_drops(tmp_path, smoke_world):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    rows = GOOD + [{"prompt": "the food was", "chosen": " great" * 30 + " .", "rejected": " awful ."}]
    ds = load(write_jsonl(tmp_path / "p.jsonl", rows))
    kept, report = apply_length_policy(
        ds, "preference", tokenizer, max_length=10, max_prompt_length=4, action="truncate"
    )
    assert (report.rows, report.over, report.kept, len(kept)) == (4, 1, 4, 4)
    assert report.longest == 35 and report.limit == 10  # bos + 3 prompt words + 30 x great + '.'
    assert report.sentence("p.jsonl") == (
        "p.jsonl: 1 of 4 rows are longer than data.max_length 10 tokens (the longest has 35) and will be truncated to it"
    )
    kept, report = apply_length_policy(ds, "preference", tokenizer, max_length=10, max_prompt_length=4, action="drop")
    assert (report.over, report.kept, len(kept)) == (1, 3, 3)
    assert "great great" not in " ".join(kept["chosen"])
    prompts = load_table(
        DatasetSpec(path=str(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a b"}, {"prompt": "a b c d e f"}]))),
        "prompt",
        field="x",
    )
    _, report = apply_length_policy(prompts, "prompt", tokenizer, max_length=10, max_prompt_length=4, action="drop")
    assert (report.over, report.longest, report.limit_field) == (1, 7, "data.max_prompt_length")  # bos + 6 words > 4


def test_fingerprint_depends_on_content_only(tmp_path):
    a = load(write_jsonl(tmp_path / "a.jsonl", GOOD))
    pd.DataFrame(GOOD).to_parquet(tmp_path / "b.parquet")
    b = load(tmp_path / "b.parquet")
    c = load(write_jsonl(tmp_path / "c.jsonl", GOOD[:2]))
    assert fingerprint_rows(a) == fingerprint_rows(b) != fingerprint_rows(c)


def test_missing_columns_list_the_accepted_formats(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "x"}])
    with pytest.raises(DataValidationError) as err:
        load_table(DatasetSpec(path=str(path)), "text", field="sft.dataset")
    assert "has no column `text`" in str(err.value) and "accepted formats: language modeling" in str(err.value)


def test_conversational_data_needs_a_chat_template(tmp_path, smoke_world):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    tokenizer.chat_template = None  # the demo's has one; a base model's often has none
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": USER}])
    with pytest.raises(
        DataValidationError,
        match="is conversational .* but the tokenizer has no chat template; set model.chat_template",
    ):
        load_table(DatasetSpec(path=str(path)), "prompt", field="data.prompts", tokenizer=tokenizer)


def test_length_policy_measures_the_templated_text(tmp_path, chat_tokenizer):
    ds = load_table(
        DatasetSpec(path=str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": USER}]))),
        "prompt",
        field="data.prompts",
        tokenizer=chat_tokenizer,
    )
    n = len(chat_tokenizer(CHATML_PROMPT)["input_ids"])
    _, report = apply_length_policy(ds, "prompt", chat_tokenizer, max_length=64, max_prompt_length=n, action="drop")
    assert report.over == 0 and report.longest == n
    _, report = apply_length_policy(ds, "prompt", chat_tokenizer, max_length=64, max_prompt_length=n - 1, action="drop")
    assert report.over == 1


def test_read_rows_gives_back_what_save_table_wrote(tmp_path):
    import datasets

    from rlhf_core.data.tables import read_column, read_rows, save_table

    path = save_table(datasets.Dataset.from_list(GOOD), tmp_path / "t" / "prefs.jsonl")
    assert read_rows(path) == GOOD and read_column(path, "chosen") == [r["chosen"] for r in GOOD]
    assert not path.with_suffix(".jsonl.tmp").exists()


EMPTY = [{"role": "assistant", "content": " "}]
CONVERSATIONAL = [{"prompt": USER, "chosen": HELLO, "rejected": BYE}] * 3


TEMPLATED = ["qwen2.5", "qwen2.5-instruct", "llama-3-instruct"]  # the real-shape families with a chat template


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory):
    """The four real-shape fixture tokenizers (tests/fixtures/real_shapes.py): pad == eos, two stop ids, a
    tokenizer-added BOS with Llama 3's template, GPT-2's without pad or template."""
    from tests.fixtures.real_shapes import FAMILIES, build_family

    root = tmp_path_factory.mktemp("families")
    return {name: load_tokenizer(str(build_family(name, root))) for name in FAMILIES}


@pytest.mark.parametrize("name", TEMPLATED)
@pytest.mark.parametrize(
    "rows",
    [
        GOOD[:2] + [{**GOOD[2], "chosen": "  "}],  # standard: an empty answer
        CONVERSATIONAL[:2] + [{"prompt": USER, "chosen": EMPTY, "rejected": BYE}],  # an empty last message
        CONVERSATIONAL[:1] + [{"prompt": USER, "chosen": [{"content": "Hello"}], "rejected": BYE}],  # no role
        CONVERSATIONAL[:2] + [{"prompt": USER, "chosen": HELLO, "rejected": HELLO}],  # chosen is rejected
        [{"chosen": USER + HELLO, "rejected": USER + BYE}, {"chosen": HELLO, "rejected": BYE}],  # no shared prompt
    ],
    ids=["standard-empty", "conversational-empty", "no-role", "identical", "implicit-without-prompt"],
)
def test_rows_checked_without_a_tokenizer_are_refused_in_the_sentence_of_the_templated_load(
    tmp_path, family_tokenizers, name, rows
):
    """`rlhf run` checks every row before the demo's tokenizer exists: the same row, the same sentence as the
    load templated by each real-shape family's chat template."""
    spec = DatasetSpec(path=str(write_jsonl(tmp_path / "p.jsonl", rows)))
    with pytest.raises(DataValidationError) as templated:
        load_table(spec, "preference", field="data.preference", tokenizer=family_tokenizers[name])
    with pytest.raises(DataValidationError) as checked:
        count_checked_rows(spec, "preference", field="data.preference")
    assert str(checked.value) == str(templated.value)
    assert f"row {len(rows)}" in str(checked.value)


@pytest.mark.parametrize("name", TEMPLATED)
@pytest.mark.parametrize("rows", [GOOD, CONVERSATIONAL, [{"chosen": USER + HELLO, "rejected": USER + BYE}] * 4])
def test_a_good_table_counts_the_rows_the_templated_load_keeps(tmp_path, family_tokenizers, name, rows):
    spec = DatasetSpec(path=str(write_jsonl(tmp_path / "p.jsonl", rows)), limit=2)
    loaded = load_table(spec, "preference", field="data.preference", tokenizer=family_tokenizers[name])
    assert count_checked_rows(spec, "preference", field="data.preference") == len(loaded) == 2


def test_a_standard_table_is_checked_alike_with_gpt2s_tokenizer_and_without_one(tmp_path, family_tokenizers):
    """GPT-2's shape (no pad, no chat template) reads plain rows: the same count, the same refusal."""
    spec = DatasetSpec(path=str(write_jsonl(tmp_path / "p.jsonl", GOOD)))
    assert count_checked_rows(spec, "preference", field="data.preference") == 3
    assert len(load_table(spec, "preference", field="data.preference", tokenizer=family_tokenizers["gpt2"])) == 3
    bad = DatasetSpec(path=str(write_jsonl(tmp_path / "q.jsonl", GOOD[:1] + [{**GOOD[1], "rejected": ""}])))
    with pytest.raises(DataValidationError, match="row 2 column `rejected` is empty") as checked:
        count_checked_rows(bad, "preference", field="data.preference")
    with pytest.raises(DataValidationError) as templated:
        load_table(bad, "preference", field="data.preference", tokenizer=family_tokenizers["gpt2"])
    assert str(checked.value) == str(templated.value)
