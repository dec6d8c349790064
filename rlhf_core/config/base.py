"""What every section of the configuration shares: the strict base model, the error type, the demo name."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from rlhf_core.config.errors import UserError

DEMO = "demo"  # the reserved source name for the built-in offline demo world
_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_path(value: Any) -> Any:
    """`~` and `$VAR` / `${VAR}` in a path field, as a shell expands them; a variable that is not set is an
    error (a folder literally named `$VAR` is never what was meant). A Jinja template (a chat template
    written inline) and any value that is not text pass unchanged."""
    if not isinstance(value, (str, Path)) or "{{" in str(value) or "{%" in str(value):
        return value
    text = os.path.expandvars(str(value))
    unset = _VARIABLE.search(text)
    if unset:
        raise ValueError(f"environment variable {unset.group(1).strip('{}')} is not set")
    text = os.path.expanduser(text)
    return Path(text) if isinstance(value, Path) else text


# a path a user writes: `~` and environment variables expand (tilde-only or hub names pass unchanged)
PathText = Annotated[str, BeforeValidator(expand_path)]
ExpandedPath = Annotated[Path, BeforeValidator(expand_path)]


class ConfigError(UserError):
    """A configuration a user wrote that cannot run; the message is one sentence."""


class Section(BaseModel):
    # strict: an int field refuses `true` and `2.5` (a float field still takes `1`); Path fields opt out
    # with Field(strict=False) so that YAML strings become paths
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)
