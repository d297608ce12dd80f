"""One dagster.yaml: the project root's file, which ``dagster dev`` and ``dg dev`` read from the working
directory when DAGSTER_HOME is unset, is also the package data ``eagle3-pipeline run`` copies into
$DAGSTER_HOME (``eagle3_pipeline/dagster.yaml`` is a symbolic link to it; a wheel carries its content)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import pytest
from dagster import DagsterInstance

from eagle3_pipeline.cli.shared import ensure_dagster_home

REPO = Path(__file__).resolve().parents[2]


def test_the_package_data_is_the_root_file() -> None:
    packaged = Path(str(resources.files("eagle3_pipeline") / "dagster.yaml"))
    root = REPO / "dagster.yaml"
    assert root.is_file() and not root.is_symlink()
    assert os.path.samefile(packaged, root), f"{packaged} is another file than {root}"


def test_the_cli_home_gets_the_project_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    home = ensure_dagster_home()
    assert (home / "dagster.yaml").read_bytes() == (REPO / "dagster.yaml").read_bytes()
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.run_monitoring_enabled and instance.run_monitoring_start_timeout_seconds == 180
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
