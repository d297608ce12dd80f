"""The test tree's shape: tests mirror the package they test (``eagle3_pipeline_tests/<package>/``), and no
module of the tree imports from a test module or a ``conftest.py``. Shared helpers live in helper modules
(``dagster_runs.py``, ``managed/pipelines.py``, …) or in ``eagle3_pipeline/testing/``; shared fixtures in
the ``conftest.py`` that covers every folder using them, where pytest finds them without an import."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# The only test modules at the top level: they test the project as a whole, not one package.
TOP_LEVEL = {"test_docs.py", "test_package_architecture.py", "test_test_tree.py"}


def _is_test_or_conftest(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == TESTS.name and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def imported_modules(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Every module an import names, at any depth (an import inside a function counts), with its line;
    ``from a import b`` names both ``a`` and ``a.b``, since ``b`` may be a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def test_no_module_imports_from_a_test_module_or_a_conftest() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in imported_modules(tree):
            if _is_test_or_conftest(module):
                found.append(f"{path.relative_to(TESTS.parent)}:{line} imports {module}")
    assert not found, (
        "a test module or conftest.py is imported (move the helper to a helper module or eagle3_pipeline/testing/, "
        "the fixture to the conftest.py above every folder that uses it):\n" + "\n".join(found)
    )


def test_test_modules_sit_in_the_folder_of_their_package() -> None:
    loose = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in TOP_LEVEL)
    assert not loose, f"test modules at the top of {TESTS.name}/ (move each beside its package's tests): {loose}"


def test_every_test_folder_is_a_package() -> None:
    """Test files share base names across folders (``generation/test_recovery.py``, ``managed/test_recovery.py``):
    each folder needs an ``__init__.py`` for pytest to import both."""
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").is_file())
    assert not missing, f"test folders without __init__.py: {missing}"


def _run_suite(folder: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(TESTS.parent)}
    if ci:
        env["CI"] = "true"
    command = [sys.executable, "-m", "pytest", "-p", "eagle3_pipeline_tests.ci_skips", "-p", "no:cacheprovider"]
    # The scratch suite is its own root: node ids relative to it, whatever ini file lies above it.
    command += ["-n", "0", "--rootdir", str(folder), "-c", os.devnull]
    return subprocess.run([*command, str(folder)], capture_output=True, text=True, env=env, check=False)


def test_a_skip_fails_under_ci_and_an_allowed_skip_that_ran_is_stale(tmp_path: Path) -> None:
    """A skipped test, a module skipped at collection by ``importorskip``: skips on a developer's machine,
    failures under ``CI`` (the collection one stops the run); an allowed skip passes under ``CI`` until its
    test runs without skipping."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_skips.py").write_text(
        "import pytest\n\ndef test_skips():\n    pytest.skip('no vLLM venv')\n\ndef test_passes():\n    pass\n"
    )
    local = _run_suite(tests, ci=False)
    assert local.returncode == 0 and "1 passed, 1 skipped" in local.stdout, local.stdout
    ci = _run_suite(tests, ci=True)
    assert ci.returncode == 1 and "1 failed, 1 passed" in ci.stdout, ci.stdout
    assert "skipped under CI, which installs everything the suite needs: no vLLM venv" in ci.stdout

    (tests / "test_missing.py").write_text("import pytest\n\npytest.importorskip('no_such_module_here')\n")
    assert _run_suite(tests, ci=False).returncode == 0
    collection = _run_suite(tests, ci=True)
    assert collection.returncode == 2 and "Interrupted: 1 error during collection" in collection.stdout
    assert "skipped under CI, which installs everything the suite needs" in collection.stdout
    assert "no_such_module_here" in collection.stdout

    (tests / "test_missing.py").unlink()
    (tests / "conftest.py").write_text(
        "from eagle3_pipeline_tests.ci_skips import ALLOWED_SKIPS\n\n"
        "ALLOWED_SKIPS.update({'test_skips.py::test_skips': 'allowed', 'test_skips.py::test_passes': 'stale'})\n"
    )
    stale = _run_suite(tests, ci=True)
    assert stale.returncode == 1 and "1 passed, 1 skipped" in stale.stdout, stale.stdout
    assert "ran in CI without skipping: test_skips.py::test_passes" in stale.stdout
