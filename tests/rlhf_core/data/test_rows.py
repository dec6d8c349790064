"""rlhf_core/data/rows.py: every TRL type and format is mapped, converted and checked row by row."""

import pandas as pd
import pytest

from rlhf_core.config import ColumnMap, DatasetSpec
from rlhf_core.data.rows import DataValidationError
from rlhf_core.data.tables import load_table
from tests.fixtures.tables import BYE, CHATML_PROMPT, GOOD, HELLO, USER, load, write_jsonl


def test_column_mapping_and_margin(tmp_path):
    rows = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "m": 0.5, "extra": 1} for r in GOOD]
    path = write_jsonl(tmp_path / "mapped.jsonl", rows)
    ds = load(path, columns=ColumnMap(prompt="q", chosen="good", rejected="bad", margin="m"))
    assert sorted(ds.column_names) == ["chosen", "margin", "prompt", "rejected"]
    assert ds[1]["chosen"] == " lovely ." and ds[1]["margin"] == 0.5


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "p", "chosen": "   ", "rejected": "b"}, "row 2 column `chosen` is empty"),
        ({"prompt": "p", "chosen": "same", "rejected": " same "}, "row 2: `chosen` is identical to `rejected`"),
        ({"prompt": "p", "chosen": None, "rejected": "b"}, "row 2 column `chosen` is missing a value"),
        ({"prompt": "p", "chosen": 5, "rejected": "b"}, "row 2 column `chosen` holds a int, not a string"),
    ],
)
def test_bad_rows_name_file_row_and_column(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD[0], row, GOOD[1]])
    with pytest.raises(DataValidationError) as err:
        load(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_non_numeric_margin(tmp_path):
    rows = [dict(GOOD[0], m=1.0), dict(GOOD[1], m="big")]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataValidationError, match="row 2 column `m`"):
        load(path, columns=ColumnMap(margin="m"))


# ---- every TRL dataset type and format ------------------------------------------------------------


def write_all(tmp_path, rows, name="d"):
    """The rows as jsonl, parquet and a save_to_disk directory."""
    import datasets

    jsonl = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    pd.DataFrame(rows).to_parquet(tmp_path / f"{name}.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / f"{name}_saved"))
    return [jsonl, tmp_path / f"{name}.parquet", tmp_path / f"{name}_saved"]


TRL_ROWS = [
    # (kind, rows, expected first pipeline row); TRL's rendering, except that completions end at the
    # turn's end (no template newline after <|im_end|>: generation stops there)
    (
        "preference",
        [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}],
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    ),
    (
        "preference",
        [{"chosen": "The sky is blue.", "rejected": "The sky is green."}],
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    ),
    (
        "preference",
        [{"prompt": USER, "chosen": HELLO, "rejected": BYE}],
        {"prompt": CHATML_PROMPT, "chosen": "Hello<|im_end|>", "rejected": "Bye<|im_end|>"},
    ),
    (
        "preference",
        [{"chosen": USER + HELLO, "rejected": USER + BYE}],
        {"prompt": CHATML_PROMPT, "chosen": "Hello<|im_end|>", "rejected": "Bye<|im_end|>"},
    ),
    ("prompt", [{"prompt": "The sky is", "solution": "blue"}], {"prompt": "The sky is", "solution": "blue"}),
    (
        "prompt",
        [{"prompt": USER, "solution": "blue"}],
        {"prompt": CHATML_PROMPT, "prompt_messages": USER, "solution": "blue"},
    ),
    ("text", [{"text": "The sky is blue."}], {"text": "The sky is blue."}),
    ("text", [{"prompt": "The sky is", "completion": " blue."}], {"text": "The sky is blue."}),
    ("text", [{"messages": USER + HELLO}], {"text": CHATML_PROMPT + "Hello<|im_end|>"}),
    ("text", [{"prompt": USER, "completion": HELLO}], {"text": CHATML_PROMPT + "Hello<|im_end|>"}),
]


@pytest.mark.parametrize("kind, rows, expected", TRL_ROWS)
def test_every_trl_type_and_format_loads_from_jsonl_parquet_and_save_to_disk(
    tmp_path, chat_tokenizer, kind, rows, expected
):
    for source in write_all(tmp_path, rows):
        ds = load_table(DatasetSpec(path=str(source)), kind, field="data.x", tokenizer=chat_tokenizer)
        assert ds[0] == expected, source


def test_standard_csv_loads_and_conversational_csv_is_refused(tmp_path, chat_tokenizer):
    pd.DataFrame([{"chosen": "The sky is blue.", "rejected": "The sky is green."}]).to_csv(
        tmp_path / "p.csv", index=False
    )
    assert load(tmp_path / "p.csv")[0]["prompt"] == "The sky is"
    with pytest.raises(DataValidationError, match=r"p.csv: a csv file cannot hold lists of messages"):
        load(tmp_path / "p.csv", format="conversational")


def test_format_can_be_forced(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "plain"}])
    with pytest.raises(DataValidationError) as err:
        load_table(
            DatasetSpec(path=str(path), format="conversational"),
            "prompt",
            field="data.prompts",
            tokenizer=chat_tokenizer,
        )
    message = str(err.value)
    assert str(path) in message and "row 1 column `prompt` holds str, not a non-empty list of messages" in message
    assert "accepted formats: prompt-only" in message


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [
                {"prompt": USER, "chosen": HELLO, "rejected": BYE},
                {"prompt": USER, "chosen": [{"role": "assistant"}], "rejected": BYE},
            ],
            "row 2 column `chosen` message 0 has no string `content`",
        ),
        (
            [{"prompt": USER, "chosen": HELLO, "rejected": BYE}, {"prompt": USER, "chosen": "text", "rejected": BYE}],
            "row 2 column `chosen` holds str, not a non-empty list of messages",
        ),
        ([{"prompt": USER, "chosen": HELLO, "rejected": HELLO}], "row 1: `chosen` is identical to `rejected`"),
        ([{"chosen": HELLO, "rejected": BYE}], "row 1 column `chosen` shares no leading message with `rejected`"),
        (  # an empty answer would train on the end-of-turn token alone
            [{"prompt": USER, "chosen": [{"role": "assistant", "content": " "}], "rejected": BYE}],
            "row 1 column `chosen` ends with an empty `assistant` message",
        ),
        (
            [{"chosen": USER + HELLO, "rejected": [*USER, {"role": "assistant", "content": ""}]}],
            "row 1 column `rejected` ends with an empty `assistant` message",
        ),
    ],
)
def test_bad_conversational_rows_name_file_row_field_and_formats(tmp_path, chat_tokenizer, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataValidationError) as err:
        load_table(DatasetSpec(path=str(path)), "preference", field="data.preference", tokenizer=chat_tokenizer)
    assert str(path) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_conversational_columns_are_mapped_and_kwargs_reach_the_template(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [{"conv": USER + HELLO}])
    saved = chat_tokenizer.chat_template
    chat_tokenizer.chat_template = "{{ tag }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        ds = load_table(
            DatasetSpec(path=str(path), columns=ColumnMap(messages="conv")),
            "text",
            field="sft.dataset",
            tokenizer=chat_tokenizer,
            chat_template_kwargs={"tag": "#"},
        )
    finally:
        chat_tokenizer.chat_template = saved
    assert ds[0] == {"text": "#HiHello"}


def test_check_first_rows_is_trl_aware():
    from rlhf_core.data.rows import check_first_rows

    def check(rows, kind="preference", **spec):
        return check_first_rows(
            rows, kind, DatasetSpec(path="x.jsonl", **spec), source="x.jsonl", field="data.x", file_fmt="json"
        )

    assert check([{"prompt": USER, "chosen": HELLO, "rejected": BYE}]) is None
    assert check([{"chosen": USER + HELLO, "rejected": USER + BYE}]) is None
    assert check([{"messages": USER + HELLO}], "text") is None
    assert check([{"prompt": USER, "extra": 1}], "prompt") is None
    assert check(GOOD) is None
    assert "row 1 column `prompt` holds a int, not a string" in check([{"prompt": 3}], "prompt")
    assert "row 2 column `chosen` message 0 has no string `content`" in check(
        [
            {"prompt": USER, "chosen": HELLO, "rejected": BYE},
            {"prompt": USER, "chosen": [{"role": "a"}], "rejected": BYE},
        ]
    )
    # empty answers are refused in the first rows, before any stage, as strings and as messages
    assert "row 1 column `chosen` is empty" in check([{"prompt": "p", "chosen": "  ", "rejected": "no"}])
    assert "row 1 column `completion` is empty" in check([{"prompt": "p", "completion": ""}], "text")
    empty = [{"role": "assistant", "content": ""}]
    assert "column `chosen` ends with an empty `assistant` message" in check(
        [{"prompt": USER, "chosen": empty, "rejected": BYE}]
    )
    assert check([{"prompt": "", "chosen": "a", "rejected": "b"}]) is None  # an empty prompt is TRL's implicit one
    assert "has no column `text` (row 1 has ['body']); map it with data.x.columns.text" in check(
        [{"body": "b"}], "text"
    )


def test_is_conversational_table():
    from rlhf_core.data.rows import is_conversational_table

    spec = DatasetSpec(path="x.jsonl")
    assert is_conversational_table([{"chosen": USER + HELLO, "rejected": USER + BYE}], "preference", spec)
    assert is_conversational_table([{"messages": USER + HELLO}], "text", spec)
    assert not is_conversational_table(GOOD, "preference", spec)
    assert is_conversational_table(GOOD, "preference", DatasetSpec(path="x.jsonl", format="conversational"))
