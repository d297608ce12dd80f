"""What the phases ask of a managed server (the SGLang stand-in of conftest on this machine): serve for a
purpose (kept when it already does, replaced when it runs for another), give the GPUs up for a block and
come back only when work remains; every start, stop and reuse reported as an event."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.managed import EagleDrafter, ServerEvent, ServerPurpose, open_supervisor
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

GENERATION = ServerPurpose.generation(needs_tools=False)


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


def test_ensure_keeps_replaces_and_hands_over(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, {"serving": fake_sglang_serving(tmp_path)})
    events: list[ServerEvent] = []
    with open_supervisor(config, on_event=events.append) as supervisor:
        assert supervisor is not None
        supervisor.ensure(GENERATION, "responses B1")
        supervisor.ensure(GENERATION, "responses B2")
        assert [(e.action, e.role) for e in events] == [("started", "generation"), ("kept", "generation")]
        assert events[0].metadata["pid"] > 0 and events[0].duration_s > 0
        assert "managed server serving (generation) started in" in events[0].line()

        drafter = ServerPurpose.served_drafter(EagleDrafter("/models/drafter", 3), needs_tools=False)
        supervisor.ensure(drafter, "serve the new drafter")
        assert [(e.action, e.role) for e in events[2:]] == [("stopped", "generation"), ("started", "served-drafter")]
        assert "it runs as generation, served-drafter is needed" in events[2].reason
        kept = supervisor.ensure(GENERATION, "responses B3", accept=("served-drafter",))
        assert events[-1].action == "kept" and "--speculative-algorithm" in kept.argv

        del events[:]
        with supervisor.handover("eagle3_drafter", after=lambda: GENERATION):
            assert supervisor.server.status().state == "absent"
        assert [(e.action, e.role) for e in events] == [("stopped", "served-drafter"), ("started", "generation")]
        assert events[0].reason == "eagle3_drafter needs the GPUs"
        assert events[1].reason == "after eagle3_drafter: generation work remains"

        del events[:]
        with pytest.raises(RuntimeError, match="training failed"), supervisor.handover("hidden_states", lambda: None):
            raise RuntimeError("training failed")
        assert [e.action for e in events] == ["stopped"]
        assert supervisor.release("nothing left") is None and supervisor.server.status().state == "absent"


def test_an_unmanaged_server_has_no_supervisor(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, {})
    with open_supervisor(config) as supervisor:
        assert supervisor is None
