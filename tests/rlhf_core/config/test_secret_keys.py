"""rlhf_core/config/secret_keys.py: secrets never reach the flattened config logged as MLflow params."""

from __future__ import annotations

from rlhf_core.config import (
    flatten_config,
    is_secret_key,
    load_config,
    redact_uri,
)


def test_flatten_hides_secrets():
    cfg = load_config(None, ["tracking.uri=http://alice:s3cret@mlflow.example:5000", "model.tokenizer=./tok"])
    flat = flatten_config(cfg)
    assert flat["ppo.kl_coef"] == "0.05"
    assert flat["model.tokenizer"] == "./tok"
    assert "s3cret" not in " ".join(flat.values())
    assert flat["tracking.uri"] == "http://alice:***@mlflow.example:5000"
    assert is_secret_key("hub_token") and is_secret_key("tracking.password") and not is_secret_key("model.tokenizer")
    assert redact_uri("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
