"""What every section of the pipeline file shares: the strict base model, the error type, name patterns."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

DATASET_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
ENV_VAR_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


# The error type of a URL with credentials: the loader shows its message without the value (the secret).
URL_CREDENTIALS = "url_credentials"


def _no_credentials(url: str) -> str:
    """A URL holding a user or password (``https://user:secret@host``) is refused: it would be written, secret
    and all, wherever the URL is shown (reasons, errors.jsonl, events)."""
    if "@" in urlsplit(url).netloc:
        raise PydanticCustomError(
            URL_CREDENTIALS,
            "a URL with credentials (user:password@) is refused, since the URL is written in logs and records; "
            "give the server's API key through the endpoint's api_key_env instead",
        )
    return url


# An http(s) URL without credentials: every base_url of the pipeline file.
HttpUrl = Annotated[str, Field(pattern=r"^https?://"), AfterValidator(_no_credentials)]


class ConfigError(ValueError):
    """A pipeline file is unusable; the message says where and what was expected."""


class ConfigModel(BaseModel):
    """A section of the pipeline file: unknown keys are refused, and a loaded section never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
