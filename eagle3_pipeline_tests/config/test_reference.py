"""The settings reference `docs/settings.md` is generated from the config models and kept up to date.

Everything here is real: the models, their JSON schema, the checked-in file and a file written by the
generator's command-line entry point.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

import eagle3_pipeline.config as config_package
from eagle3_pipeline.config import GenerationConfig, PipelineConfig
from eagle3_pipeline.config.reference import NOT_SETTINGS, REGENERATE, render

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "docs" / "settings.md"


def _config_models() -> list[type[BaseModel]]:
    """Every model the config package exports, and every model reachable from the root model's fields."""
    found: dict[str, type[BaseModel]] = {}
    for name in config_package.__all__:
        value = getattr(config_package, name)
        if inspect.isclass(value) and issubclass(value, BaseModel) and value.model_fields:
            found[value.__qualname__] = value
    pending: list[type[BaseModel]] = [PipelineConfig]
    while pending:
        model = pending.pop()
        found[model.__qualname__] = model
        for info in model.model_fields.values():
            for inner in re.findall(r"\b(\w+Config)\b", repr(info.annotation)):
                candidate = getattr(config_package, inner, None)
                if inspect.isclass(candidate) and issubclass(candidate, BaseModel) and inner not in found:
                    pending.append(candidate)
    return list(found.values())


def test_the_checked_in_reference_equals_what_the_models_generate() -> None:
    assert CHECKED_IN.is_file(), f"{CHECKED_IN} is missing; generate it with: {REGENERATE}"
    assert CHECKED_IN.read_text(encoding="utf-8") == render(), (
        f"{CHECKED_IN.relative_to(REPO)} is out of date with the config models; regenerate it from the repository "
        f"root with: {REGENERATE}"
    )


def test_every_field_of_every_config_model_has_a_description() -> None:
    models = _config_models()
    assert len(models) >= 30, f"expected the ~30 config models, found {sorted(m.__name__ for m in models)}"
    missing = [
        f"{model.__name__}.{name}"
        for model in models
        for name, info in model.model_fields.items()
        if not (info.description or "").strip()
    ]
    assert not missing, f"fields without a Field(description=...): {missing}"


def test_the_reference_lists_every_setting_with_its_default_and_description() -> None:
    text = render()
    schema = PipelineConfig.model_json_schema()
    for model in [schema, *schema["$defs"].values()]:
        for name in model.get("properties", {}):
            if model is schema and name in NOT_SETTINGS:
                assert f"`{name}`" not in text
                continue
            assert re.search(rf"^\| `[^`]*\b{name}` \|", text, re.MULTILINE), f"no row for {name!r}"
    row = next(line for line in text.splitlines() if line.startswith("| `generation.max_tokens` |"))
    description = GenerationConfig.model_fields["max_tokens"].description
    assert row.split(" | ")[2:] == ["`256`", f"{description} |"]
    hosts = next(line for line in text.splitlines() if line.startswith("| `inference.hosts[].health` |"))
    assert "section `health`" in hosts, "a section met twice should point to where it is documented"


def test_the_command_writes_the_reference(tmp_path: Path) -> None:
    target = tmp_path / "settings.md"
    subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.config.reference", str(target)], check=True, cwd=REPO, timeout=120
    )
    assert target.read_text(encoding="utf-8") == render()
