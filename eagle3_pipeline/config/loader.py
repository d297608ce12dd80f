"""A pipeline file (YAML) → a validated :class:`PipelineConfig`.

Every problem with a pipeline file is reported as one :class:`ConfigError` that names the file,
the field path, the bad value and what was expected. Secrets are never echoed: a field that names
an environment variable holding an API key is reported by the variable's *name* only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from eagle3_pipeline.config.base import URL_CREDENTIALS, ConfigError
from eagle3_pipeline.config.pipeline import PipelineConfig, check_runtime

ARTIFACTS_ENV_VAR = "EAGLE3_ARTIFACTS_ROOT"
LOCAL_PROFILE = "local"


def profiles_dir() -> Path:
    """The profiles shipped inside the package."""
    return Path(str(resources.files("eagle3_pipeline") / "profiles")).resolve()


def local_profile_path() -> Path:
    return profiles_dir() / f"{LOCAL_PROFILE}.yaml"


def user_data_dir() -> Path:
    """This user's data folder for the package: ``$XDG_DATA_HOME/eagle3_pipeline``, else
    ``~/.local/share/eagle3_pipeline``."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "eagle3_pipeline"


def default_artifacts_root(file: Path, name: str) -> Path:
    """Where a pipeline file without ``artifacts_root`` writes, whatever the current directory:
    ``$EAGLE3_ARTIFACTS_ROOT/<name>``; else, for a profile shipped in the package (whose folder may be
    read-only and is replaced by an upgrade), ``<user data folder>/<name>``; else
    ``<the file's folder>/artifacts/<name>``."""
    folder = file.resolve().parent
    if os.environ.get(ARTIFACTS_ENV_VAR):
        parent = _resolve(os.environ[ARTIFACTS_ENV_VAR], folder)
    elif folder == profiles_dir():
        parent = user_data_dir()
    else:
        parent = folder / "artifacts"
    return parent / name


def _field_path(loc: tuple[Any, ...], raw: Any) -> str:
    """`('datasets', 1, 'token_budget')` → `datasets[1].token_budget` (with the dataset id)."""
    parts: list[str] = []
    node = raw
    for item in loc:
        if isinstance(item, int):
            label = f"[{item}]"
            if isinstance(node, list) and item < len(node):
                node = node[item]
                named = next(
                    (key for key in ("id", "name") if isinstance(node, dict) and isinstance(node.get(key), str)), None
                )
                if named is not None:
                    label = f"[{item}] ({named} {node[named]!r})"
            parts.append(label)
        else:
            parts.append(f".{item}" if parts else str(item))
            node = node.get(item) if isinstance(node, dict) else None
    return "".join(parts) or "<top level>"


def _describe(error: Mapping[str, Any], raw: Any) -> str:
    where = _field_path(tuple(error["loc"]), raw)
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{where}: unknown key (check the spelling; every allowed key is listed in docs/settings.md)"
    if kind == "missing":
        return f"{where}: required field is missing"
    if kind == URL_CREDENTIALS:
        return f"{where}: {error['msg']}"  # never the value: it holds the secret
    shown = error.get("input")
    value = "" if isinstance(shown, (dict, list)) else f" (got {shown!r})"
    return f"{where}: {error['msg']}{value}"


def validation_problems(exc: ValidationError, raw: Any) -> str:
    """Each of a validation's errors as `field.path: what was expected (got value)`, joined: the
    pipeline file's and the heavy phases' specs name what is wrong alike."""
    return "; ".join(_describe(err, raw) for err in exc.errors())


def _resolve(path_text: str, base: Path) -> Path:
    path = Path(os.path.expanduser(path_text))
    return path if path.is_absolute() else (base / path).resolve()


def load_config(path: str | os.PathLike[str] | None = None, runtime_checks: bool = True) -> PipelineConfig:
    """Read and validate a pipeline file; relative paths resolve against the file's folder.

    ``runtime_checks=False`` (the code location) validates only the file itself: source files and
    API-key variables are checked when a run needs them, with the same errors, so the webserver and
    daemon load the definitions in any environment.

    ``artifacts_root`` may be omitted: then it is :func:`default_artifacts_root`, scoped by the
    pipeline's name and independent of the current directory.
    """
    file = Path(path) if path is not None else local_profile_path()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: pipeline file does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read pipeline file ({exc.__class__.__name__}: {exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{file}: invalid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a mapping at the top level, got {type(raw).__name__}")
    if "source_file" in raw:
        raise ConfigError(f"{file}: source_file: unknown key (it is set by the loader)")

    base = file.resolve().parent
    data = dict(raw)
    if data.get("artifacts_root") is None:
        name = data.get("name")
        data["artifacts_root"] = str(default_artifacts_root(file, name if isinstance(name, str) else ""))
    if isinstance(data.get("artifacts_root"), str):
        data["artifacts_root"] = str(_resolve(data["artifacts_root"], base))
    datasets = data.get("datasets")
    if isinstance(datasets, list):
        data["datasets"] = [_with_resolved_source(item, base) for item in datasets]
    target = data.get("target")
    if isinstance(target, dict) and isinstance(target.get("tokenizer"), str):
        tok = target["tokenizer"]
        if tok.startswith((".", "/", "~")):
            data["target"] = {**target, "tokenizer": str(_resolve(tok, base))}
    data["source_file"] = file.resolve()

    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{file}: {validation_problems(exc, raw)}") from None
    if runtime_checks:
        check_runtime(config)
    return config


def _with_resolved_source(item: Any, base: Path) -> Any:
    if isinstance(item, dict) and isinstance(item.get("source"), str):
        source = item["source"]
        if source and not source.startswith("hf:") and not re.match(r"^[a-z]+://", source):
            return {**item, "source": str(_resolve(source, base))}
    return item
