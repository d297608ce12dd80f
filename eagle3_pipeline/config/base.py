"""What every section of the pipeline file shares: the strict base model, the error type, name patterns."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

DATASET_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
ENV_VAR_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class ConfigError(ValueError):
    """A pipeline file is unusable; the message says where and what was expected."""


class ConfigModel(BaseModel):
    """A section of the pipeline file: unknown keys are refused, and a loaded section never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
