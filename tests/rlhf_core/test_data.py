import json

import pandas as pd
import pytest

from rlhf_core.config import ColumnMap, DatasetSpec
from rlhf_core.data import DataValidationError, apply_length_policy, fingerprint_rows, load_table
from rlhf_core.models import load_tokenizer

GOOD = [
    {"prompt": "the food was", "chosen": " great .", "rejected": " awful ."},
    {"prompt": "the room was", "chosen": " lovely .", "rejected": " dirty ."},
    {"prompt": "the staff was", "chosen": " kind .", "rejected": " rude ."},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path, kind="preference", **spec):
    return load_table(DatasetSpec(path=str(path), **spec), kind, field="data.preference")


def test_loads_jsonl_parquet_csv_and_directories(tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", GOOD)
    pd.DataFrame(GOOD).to_parquet(tmp_path / "p.parquet")
    pd.DataFrame(GOOD).to_csv(tmp_path / "p.csv", index=False)
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "a.jsonl", GOOD[:2])
    write_jsonl(tmp_path / "dir" / "b.jsonl", GOOD[2:])
    for source in (jsonl, tmp_path / "p.parquet", tmp_path / "p.csv", tmp_path / "dir"):
        ds = load(source)
        assert ds.column_names == ["prompt", "chosen", "rejected"]
        assert ds[0] == GOOD[0]
        assert len(ds) == 3


def test_a_glob_reads_every_matching_file_in_name_order(tmp_path):
    (tmp_path / "drops").mkdir()
    write_jsonl(tmp_path / "drops" / "2026-11-02.jsonl", GOOD[2:])
    write_jsonl(tmp_path / "drops" / "2026-11-01.jsonl", GOOD[:2])
    (tmp_path / "drops" / "notes.txt").write_text("not data")
    ds = load(f"{tmp_path}/drops/*.jsonl")
    assert [r["prompt"] for r in ds] == [r["prompt"] for r in GOOD]
    with pytest.raises(DataValidationError, match=r"data.preference.path: the glob .*/none-\*.jsonl matches no"):
        load(f"{tmp_path}/drops/none-*.jsonl")
    pd.DataFrame(GOOD).to_csv(tmp_path / "drops" / "2026-11-03.csv", index=False)
    with pytest.raises(DataValidationError, match="mixes file types"):
        load(f"{tmp_path}/drops/2026-*")


def test_column_mapping_and_margin(tmp_path):
    rows = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "m": 0.5, "extra": 1} for r in GOOD]
    path = write_jsonl(tmp_path / "mapped.jsonl", rows)
    ds = load(path, columns=ColumnMap(prompt="q", chosen="good", rejected="bad", margin="m"))
    assert sorted(ds.column_names) == ["chosen", "margin", "prompt", "rejected"]
    assert ds[1]["chosen"] == " lovely ." and ds[1]["margin"] == 0.5


def test_limit(tmp_path):
    assert len(load(write_jsonl(tmp_path / "p.jsonl", GOOD), limit=2)) == 2


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


def test_missing_column_names_the_columns_and_the_config_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a"}])
    with pytest.raises(
        DataValidationError,
        match=r"has no column `rejected` \(columns are \['prompt', 'chosen'\]\); map it with data.preference.columns",
    ):
        load(path)


def test_non_numeric_margin(tmp_path):
    rows = [dict(GOOD[0], m=1.0), dict(GOOD[1], m="big")]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataValidationError, match="row 2 column `m`"):
        load(path, columns=ColumnMap(margin="m"))


def test_missing_files_and_formats(tmp_path):
    with pytest.raises(DataValidationError, match=r"data.preference.path: .*nope.jsonl does not exist"):
        load(tmp_path / "nope.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataValidationError, match="unsupported file type '.txt'"):
        load(tmp_path / "x.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataValidationError, match="directory holds no"):
        load(tmp_path / "empty")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataValidationError):
        load(tmp_path / "e.jsonl")


def test_broken_json_line_is_located(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n{not json\n")
    with pytest.raises(DataValidationError, match="row 2 is not valid JSON"):
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
    assert (report.rows, report.overlong, report.kept, len(kept)) == (4, 1, 4, 4)
    assert "1 of 4 rows exceed the length limit and will be truncated" in report.sentence("p.jsonl")
    kept, report = apply_length_policy(ds, "preference", tokenizer, max_length=10, max_prompt_length=4, action="drop")
    assert (report.overlong, report.kept, len(kept)) == (1, 3, 3)
    assert "great great" not in " ".join(kept["chosen"])
    prompts = load_table(
        DatasetSpec(path=str(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a b"}, {"prompt": "a b c d e f"}]))),
        "prompt",
        field="x",
    )
    _, report = apply_length_policy(prompts, "prompt", tokenizer, max_length=10, max_prompt_length=4, action="drop")
    assert report.overlong == 1  # bos + 6 words > 4


def test_fingerprint_depends_on_content_only(tmp_path):
    a = load(write_jsonl(tmp_path / "a.jsonl", GOOD))
    pd.DataFrame(GOOD).to_parquet(tmp_path / "b.parquet")
    b = load(tmp_path / "b.parquet")
    c = load(write_jsonl(tmp_path / "c.jsonl", GOOD[:2]))
    assert fingerprint_rows(a) == fingerprint_rows(b) != fingerprint_rows(c)


def test_hub_dataset_names_go_to_the_hub_and_fail_in_one_sentence_offline():
    with pytest.raises(DataValidationError) as err:
        load_table(
            DatasetSpec(path="no-such-org/no-such-dataset", split="train"), "preference", field="data.preference"
        )
    message = str(err.value)
    assert message.startswith(
        "data.preference.path: hub dataset 'no-such-org/no-such-dataset' (split 'train') could not be loaded"
    )
    assert "\n" not in message


# ---- every TRL dataset type and format ------------------------------------------------------------

USER = [{"role": "user", "content": "Hi"}]
HELLO = [{"role": "assistant", "content": "Hello"}]
BYE = [{"role": "assistant", "content": "Bye"}]
CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from tests.fixtures.real_shapes import build_family

    return load_tokenizer(str(build_family("qwen2.5-instruct", tmp_path_factory.mktemp("fam"))))


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


def test_a_save_to_disk_dataset_dict_reads_its_split(tmp_path):
    import datasets

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GOOD), "test": datasets.Dataset.from_list(GOOD[:1])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(load(tmp_path / "dd", split="test")) == 1
    with pytest.raises(DataValidationError, match=r"data.preference.split: .* has no split 'dev'"):
        load(tmp_path / "dd", split="dev")


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
    ],
)
def test_bad_conversational_rows_name_file_row_field_and_formats(tmp_path, chat_tokenizer, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataValidationError) as err:
        load_table(DatasetSpec(path=str(path)), "preference", field="data.preference", tokenizer=chat_tokenizer)
    assert str(path) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


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


def test_hub_names_pass_split_and_revision(monkeypatch):
    import datasets

    seen = {}

    def fake_load_dataset(path, **kwargs):
        seen.update(path=path, **kwargs)
        return datasets.Dataset.from_list(GOOD)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_table(
        DatasetSpec(path="org/prefs", split="train_prefs", revision="abc123"), "preference", field="data.preference"
    )
    assert seen == {"path": "org/prefs", "split": "train_prefs", "revision": "abc123"} and len(ds) == 3


def test_length_policy_measures_the_templated_text(tmp_path, chat_tokenizer):
    ds = load_table(
        DatasetSpec(path=str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": USER}]))),
        "prompt",
        field="data.prompts",
        tokenizer=chat_tokenizer,
    )
    n = len(chat_tokenizer(CHATML_PROMPT)["input_ids"])
    _, report = apply_length_policy(ds, "prompt", chat_tokenizer, max_length=64, max_prompt_length=n, action="drop")
    assert report.overlong == 0
    _, report = apply_length_policy(ds, "prompt", chat_tokenizer, max_length=64, max_prompt_length=n - 1, action="drop")
    assert report.overlong == 1


def test_check_first_rows_is_trl_aware():
    from rlhf_core.data import check_first_rows

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
    assert "has no column `text` (row 1 has ['body']); map it with data.x.columns.text" in check(
        [{"body": "b"}], "text"
    )


def test_is_conversational_table():
    from rlhf_core.data import is_conversational_table

    spec = DatasetSpec(path="x.jsonl")
    assert is_conversational_table([{"chosen": USER + HELLO, "rejected": USER + BYE}], "preference", spec)
    assert is_conversational_table([{"messages": USER + HELLO}], "text", spec)
    assert not is_conversational_table(GOOD, "preference", spec)
    assert is_conversational_table(GOOD, "preference", DatasetSpec(path="x.jsonl", format="conversational"))
