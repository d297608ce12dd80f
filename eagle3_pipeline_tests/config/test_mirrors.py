"""The domain's settings objects that mirror a section of the pipeline file, and the parameters named as
a section's fields, have no defaults of their own: every value comes from the validated file, so the
file's default is the only one (a mirror with its own once trained 1 epoch where the file says 10, and
wanted 8 GPUs where the file says 0). The heavy phases' specs are no mirrors: each is the section it
reads, subclassed (drafter/test_spec.py)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.config import (
    HealthConfig,
    HiddenStatesConfig,
    HostConfig,
    MonitoredServerConfig,
    TargetConfig,
    load_config,
    local_profile_path,
)
from eagle3_pipeline.config.base import ConfigModel
from eagle3_pipeline.health import HealthThresholds, ServerSpec
from eagle3_pipeline.health.gate import thresholds_for
from eagle3_pipeline.hidden_states.capture import load_target
from eagle3_pipeline.hosts import SshHost

PROFILES = Path(local_profile_path()).parent

# (domain settings object, the file's section it mirrors, the section's fields it does not carry)
MIRRORS: list[tuple[type[Any], type[ConfigModel], frozenset[str]]] = [
    (HealthThresholds, HealthConfig, frozenset()),
    # generation_probe: the benchmark's server (drafter/serve/benchmark.py) has no such setting and asks by chat.
    (ServerSpec, MonitoredServerConfig, frozenset({"generation_probe"})),
]
# (a function or class taking settings as parameters, the file's section they come from): a parameter
# named as a field of the section has no default.
PARAMETERS: list[tuple[Callable[..., Any], type[ConfigModel]]] = [
    (SshHost, HostConfig),
    (load_target, HiddenStatesConfig),
    (load_target, TargetConfig),
]


@pytest.mark.parametrize(("mirror", "section", "not_carried"), MIRRORS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_mirror_has_no_default_for_a_field_of_the_file(
    mirror: type[Any], section: type[ConfigModel], not_carried: frozenset[str]
) -> None:
    shared = [f for f in dataclasses.fields(mirror) if f.name in section.model_fields and f.name not in not_carried]
    assert shared, f"{mirror.__name__} shares no field with {section.__name__}"
    own = [
        f.name for f in shared if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert own == [], f"{mirror.__name__} has defaults of its own for {section.__name__} fields {own}"


@pytest.mark.parametrize(("taker", "section"), PARAMETERS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_settings_parameter_has_no_default(taker: Callable[..., Any], section: type[ConfigModel]) -> None:
    parameters = inspect.signature(taker).parameters
    shared = [name for name in parameters if name in section.model_fields]
    assert shared, f"{taker.__name__} takes no parameter named as a field of {section.__name__}"
    own = [name for name in shared if parameters[name].default is not inspect.Parameter.empty]
    assert own == [], f"{taker.__name__} has defaults of its own for {section.__name__} fields {own}"


def test_an_ssh_host_takes_every_host_setting() -> None:
    """build_host hands SshHost the section whole: every field but where and which kind is a parameter."""
    assert set(HostConfig.model_fields) - {"kind", "hostname"} <= set(inspect.signature(SshHost).parameters)


@pytest.mark.parametrize("profile", ["local.yaml", "kimi-k25.yaml"])
def test_each_shipped_profile_gates_as_its_file_says(profile: str) -> None:
    config = load_config(PROFILES / profile, runtime_checks=False)
    thresholds = thresholds_for(config.health, config.artifacts_root)
    assert (thresholds.expected_gpus, thresholds.min_disk_free_gb, thresholds.min_mem_free_gb) == (
        config.health.expected_gpus,
        config.health.min_disk_free_gb,
        config.health.min_mem_free_gb,
    )


def test_a_file_without_a_health_section_gets_the_files_defaults() -> None:
    """No `health:` keys: the values are the file's documented defaults (docs/settings.md)."""
    thresholds = thresholds_for(HealthConfig(), Path("/artifacts"))
    assert (thresholds.expected_gpus, thresholds.min_disk_free_gb) == (
        HealthConfig().expected_gpus,
        HealthConfig().min_disk_free_gb,
    )
