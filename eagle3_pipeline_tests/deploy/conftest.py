"""The throwaway PostgreSQL server of the deployment tests."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from eagle3_pipeline_tests.deploy.postgres_server import Postgres, postgres_bin, postgres_cluster


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    bin_dir = postgres_bin()
    missing = []
    if bin_dir is None:
        missing.append("PostgreSQL server binaries under /usr/lib/postgresql/*/bin (Debian package `postgresql`)")
    if importlib.util.find_spec("dagster_postgres") is None:
        missing.append("dagster-postgres (the `deploy` extra)")
    if missing or bin_dir is None:
        reason = "not installed: " + "; ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; .ci/run installs them, so in CI this is a broken set-up")
        pytest.skip(reason)
    with postgres_cluster(bin_dir) as server:
        yield server
