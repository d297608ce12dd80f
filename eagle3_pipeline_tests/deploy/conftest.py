"""The throwaway PostgreSQL server of the deployment tests."""

from __future__ import annotations

import importlib.util
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
        pytest.skip(reason)
    with postgres_cluster(bin_dir) as server:
        yield server
