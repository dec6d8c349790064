import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.config.redaction import (
    flatten_config,
    has_secret,
    is_secret_key,
    redact,
    redact_override,
    refuse_secret_overrides,
    split_credentials,
)

S = "S3cr3t"  # every case below hides it

REDACTED = [
    ("http://user:S3cr3t@host:5000", "http://user:***@host:5000"),
    ("https://user:S3cr3t@mlflow.example.com/path?x=1", "https://user:***@mlflow.example.com/path?x=1"),
    ("postgresql://u:S3cr3t@db:5432/mlflow", "postgresql://u:***@db:5432/mlflow"),
    ("http://user:a/S3cr3t/b@host", "http://user:***@host"),  # '/' in the password
    ("http://user:p@ss@S3cr3t@host/x", "http://user:***@host/x"),  # '@' in the password
    ("http://user:a:S3cr3t@host", "http://user:***@host"),  # ':' in the password
    ("http://user:S3cr3t%40x@host", "http://user:***@host"),  # percent-encoded
    ("http://S3cr3t@host:5000", "http://***@host:5000"),  # a token as the user name
    ("http://:S3cr3t@host", "http://:***@host"),  # a token as the password, no user
    ("http://host/api?token=S3cr3t", "http://host/api?token=***"),
    ("http://host/api?a=1&password=S3cr3t&b=2", "http://host/api?a=1&password=***&b=2"),
    ("http://host/?api_key=S3cr3t#frag", "http://host/?api_key=***#frag"),
    ("http://host/?X-Amz-Signature=S3cr3t", "http://host/?X-Amz-Signature=***"),
    ("http://host/?access_token=S3cr3t", "http://host/?access_token=***"),
    ("http://host/?apikey=S3cr3t", "http://host/?apikey=***"),
    ("http://host/?key=S3cr3t", "http://host/?key=***"),
    # inside other text: log lines, reprs, JSON, error messages
    (
        "View run x at: http://u:S3cr3t@127.0.0.1:5000/#/experiments/1/runs/abc",
        "View run x at: http://u:***@127.0.0.1:5000/#/experiments/1/runs/abc",
    ),
    ("['tracking.uri=http://u:S3cr3t@h', 'x=1']", "['tracking.uri=http://u:***@h', 'x=1']"),
    ('{"uri": "http://u:S3cr3t@h"}', '{"uri": "http://u:***@h"}'),
    (
        "API request to http://u:S3cr3t@h/api/2.0/x failed; retry http://t0k3nS3cr3t@h2 later",
        "API request to http://u:***@h/api/2.0/x failed; retry http://***@h2 later",
    ),
]

UNCHANGED = [
    "http://127.0.0.1:5000",
    "http://host:5000/#/experiments/1/runs/abc/artifacts/eval/table.json",
    "https://huggingface.co/gpt2?revision=main&token_type=bearer",
    "sqlite:////tmp/x/mlflow.db",
    "file:///tmp/mlruns/1/abc/artifacts",
    "models:/rlhf-policy@candidate",
    "models:/rlhf-policy/3",
    "/home/user/outputs/rlhf/ppo/step-2",
    "outputs/a@b/c:d",
    "user@example.com wrote: key=value, monkey=banana",
    "ppo.kl_coef=0.1",
    "",
]


@pytest.mark.parametrize("text, expected", REDACTED)
def test_redact_hides_every_credential_form(text, expected):
    assert redact(text) == expected
    assert S not in redact(text) and has_secret(text)


@pytest.mark.parametrize("text", UNCHANGED)
def test_redact_leaves_ordinary_uris_and_paths_alone(text):
    assert redact(text) == text and not has_secret(text)


def test_redact_is_idempotent():
    for _text, expected in REDACTED:
        assert redact(expected) == expected


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("http://alice:a/b@c@host:5000/x", ("http://host:5000/x", "alice", "a/b@c")),
        ("https://alice:p%40ss@host", ("https://host", "alice", "p@ss")),
        ("http://TOKEN@host", ("http://TOKEN@host", None, None)),
        ("http://:TOKEN@host", ("http://:TOKEN@host", None, None)),
        ("http://host:5000", ("http://host:5000", None, None)),
        ("sqlite:////tmp/mlflow.db", ("sqlite:////tmp/mlflow.db", None, None)),
    ],
)
def test_split_credentials(uri, expected):
    assert split_credentials(uri) == expected


def test_overrides_with_credentials_are_refused_with_the_secret_hidden():
    assert redact_override("hub_token=S3cr3t") == "hub_token=***"
    assert redact_override("tracking.uri=http://u:S3cr3t@h") == "tracking.uri=http://u:***@h"
    refuse_secret_overrides(["tracking.uri=http://h:5000", "ppo.kl_coef=0.1"])
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_PASSWORD") as err:
        refuse_secret_overrides(["ppo.kl_coef=0.1", "tracking.uri=http://u:S3cr3t@h"])
    assert S not in str(err.value) and "http://u:***@h" in str(err.value)


def test_flatten_config_hides_uri_credentials():
    cfg = load_config(None, ["tracking.uri=http://u:S3cr3t@h:5000?token=S3cr3t"])
    params = flatten_config(cfg)
    assert params["tracking.uri"] == "http://u:***@h:5000?token=***"
    assert not any(S in v for v in params.values())


def test_flatten_hides_secrets():
    cfg = load_config(None, ["tracking.uri=http://alice:s3cret@mlflow.example:5000", "model.tokenizer=./tok"])
    flat = flatten_config(cfg)
    assert flat["ppo.kl_coef"] == "0.05"
    assert flat["model.tokenizer"] == "./tok"
    assert "s3cret" not in " ".join(flat.values())
    assert flat["tracking.uri"] == "http://alice:***@mlflow.example:5000"
    assert is_secret_key("hub_token") and is_secret_key("tracking.password") and not is_secret_key("model.tokenizer")
    assert redact("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
