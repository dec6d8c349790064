"""Hide credentials in any text that can reach a console, a log, an error, MLflow or Prefect.

Credentials belong in MLflow's own environment variables (MLFLOW_TRACKING_USERNAME,
MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN). A URI that carries them still works, but every
place it can surface passes through :func:`redact`, and :func:`split_credentials` takes a
``user:password@`` pair out of a URI so that the URI itself can be shown and stored.

What counts as a credential in a URI (``scheme://`` followed by):
  * ``user:password@host`` -> ``user:***@host``, with ``/``, ``:`` or ``@`` inside the password;
  * ``:token@host``        -> ``:***@host``;
  * ``token@host``         -> ``***@host`` (a token given as the user name);
  * ``?token=``, ``&password=``, ``?api_key=``, ``sig=`` ... query parameters -> ``name=***``.
RFC 3986 allows no whitespace, quotes or angle brackets in a URI, so a credential ends at one.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any
from urllib.parse import unquote

from rlhf_core.config import ConfigError, PipelineConfig

MASK = "***"

_SCHEME = r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)"
_STOP = r"\s'\"<>`"  # characters a URI cannot hold unencoded: a credential ends before them

# user:password@  (the user has no '/', ':' or '@'; the password runs to the last '@' before the
# host, so it may hold '/', ':' and '@'). This errs on the safe side: in 'http://host:5000/a@b',
# where '@' sits in a path after a port, it hides '5000/a' too.
_USER_PASSWORD = re.compile(
    _SCHEME + rf"(?P<user>[^{_STOP}/:@?#]*):(?P<secret>[^{_STOP}]*)@(?=[^{_STOP}@/?#]*(?:[/?#{_STOP}]|$))"
)
# token@  (no colon: the whole userinfo is the secret)
_USER_ONLY = re.compile(_SCHEME + rf"(?P<secret>[^{_STOP}/:@?#]+)@")
_SECRET_NAME = (
    r"(?:[A-Za-z0-9_.-]*[_.-])?(?:token|password|passwd|pwd|secret|api[_-]?key|apikey|signature|sig|"
    r"credentials?|auth)|key"
)
_QUERY_SECRET = re.compile(rf"(?P<lead>[?&;](?i:{_SECRET_NAME}))=(?P<secret>[^&#{_STOP}]*)")


def redact(text: str) -> str:
    """`text` with every credential of every URI in it replaced by ***; other text is unchanged."""
    if not text or ("@" not in text and "=" not in text):
        return text
    text = _USER_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = _USER_ONLY.sub(lambda m: m[0] if m["secret"] == MASK else f"{m['scheme']}{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['lead']}={MASK}", text)


def has_secret(text: str) -> bool:
    """True when :func:`redact` would change `text`."""
    return redact(text) != text


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(uri without userinfo, user, password) for `scheme://user:password@host...`, both parts non-empty.

    Any other URI comes back unchanged with (None, None): a token given as the user name, an empty
    user, or a secret query parameter cannot move into MLflow's username and password variables.
    """
    match = _USER_PASSWORD.match(uri.strip())
    if not match or not match["user"] or not match["secret"]:
        return uri, None, None
    clean = match["scheme"] + uri.strip()[match.end() :]
    return clean, unquote(match["user"]), unquote(match["secret"])


def redact_override(text: str) -> str:
    """A `section.field=value` override with a secret-named field's value, or a URI's credentials, hidden."""
    key, sep, value = text.partition("=")
    if sep and is_secret_key(key.strip()):
        return f"{key}={MASK}"
    return redact(text)


def refuse_secret_overrides(overrides: list[str] | None) -> None:
    """Raise ConfigError when a flow parameter override carries a credential.

    Prefect stores and shows a flow run's parameters, so a credential must come from the
    environment of the process that runs the flow instead.
    """
    for text in overrides or []:
        if redact_override(text) != text:
            raise ConfigError(
                f"override '{redact_override(text)}' carries a credential, which Prefect would store as a flow-run "
                "parameter; set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN, or "
                "MLFLOW_TRACKING_URI) in the environment that runs the flow and pass the URI without it"
            )


def _redacting_record_factory(base):
    """A log record factory that hides credentials in every record's message and traceback."""

    def factory(*args, **kwargs):
        record = base(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's to report, not ours
            return record
        if has_secret(message):
            record.msg, record.args = redact(message), ()
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and has_secret(f"{exc} {exc.__cause__ or ''} {exc.__context__ or ''}"):
            import traceback

            record.exc_text = redact("".join(traceback.format_exception(exc)).rstrip("\n"))
        return record

    factory.redacting = True
    return factory


def install_log_redaction() -> None:
    """Hide credentials in every log record of the process: ours, Prefect's (console and API) and MLflow's."""
    base = logging.getLogRecordFactory()
    if not getattr(base, "redacting", False):
        logging.setLogRecordFactory(_redacting_record_factory(base))


SECRET_SUFFIXES = ("token", "password", "passwd", "secret", "api_key", "apikey", "credentials")


def is_secret_key(key: str) -> bool:
    """True for keys such as `hub_token` or `tracking.password` (not `model.tokenizer`)."""
    name = key.rsplit(".", 1)[-1].lower()
    return any(name == s or name.endswith("_" + s) for s in SECRET_SUFFIXES)


def flatten_config(cfg: PipelineConfig) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params; secret keys left out, URI credentials hidden."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif not is_secret_key(prefix):
            out[prefix] = redact(json.dumps(value) if isinstance(value, list) else str(value))

    walk("", cfg.model_dump(mode="json"))
    return out
