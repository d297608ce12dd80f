"""`eagle3-pipeline server status|stop`: the managed server's state and its verified stop from the command line,
so a user frees the GPUs without ps or kill (the SGLang stand-in of conftest as the engine)."""

from pathlib import Path

import pytest

from eagle3_pipeline.cli import main
from eagle3_pipeline.managed import ServerPurpose, open_supervisor
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

pytestmark = pytest.mark.usefixtures("stop_servers")


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


def test_status_then_stop_verified(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serving = fake_sglang_serving(tmp_path)
    config = load_pipeline(tmp_path, {"serving": serving})
    args = ["--config", str(config.source_file)]
    assert main(["server", "status", *args]) == 3
    assert f"on port {serving['port']}: absent" in capsys.readouterr().out

    with open_supervisor(config) as supervisor:
        assert supervisor is not None
        supervisor.ensure(ServerPurpose.generation(needs_tools=False), "responses B1")
        status = supervisor.server.status()
    assert status.record is not None
    assert main(["server", "status", *args]) == 0
    out = capsys.readouterr().out
    assert f"on port {serving['port']}: running" in out and f"role generation, pid {status.record.pid}" in out
    assert "-m sglang.launch_server" in out and "responses B1" in out

    assert main(["server", "stop", *args]) == 0
    out = capsys.readouterr().out
    assert f"stopped the generation server (pid {status.record.pid})" in out
    assert f"0 process(es) of it left; port {serving['port']} free" in out
    assert processes_of(status.record.pgid) == []
    assert main(["server", "stop", *args]) == 0
    assert "no server of the pipeline's was running" in capsys.readouterr().out


def test_a_pipeline_without_a_managed_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_pipeline(tmp_path, {})
    assert main(["server", "stop", "--config", str(config.source_file)]) == 2
    assert "no managed server (serving.managed)" in capsys.readouterr().err
