"""What every section of the configuration shares: the strict base model, the error type, the demo name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

DEMO = "demo"  # the reserved source name for the built-in offline demo world


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message is one sentence."""


class Section(BaseModel):
    # strict: an int field refuses `true` and `2.5` (a float field still takes `1`); Path fields opt out
    # with Field(strict=False) so that YAML strings become paths
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)
