"""The managed server (`serving.managed`) in a Dagster run: every start, stop and reuse of it is a line of the
run's log and an observation of its server asset (`inference_server`, or `inference_server/<host>`), so the
UI shows who held the GPUs when.

- :func:`supervised`: the server's supervisor for a block (None when the server is not managed);
- :func:`hand_over`: the managed server on a GPU phase's machine around its block, as the phase's row in
  eagle3_pipeline.config.phases says: ``stops`` — stopped (verified) first, and afterwards the generation
  server again while `responses` partitions are incomplete; ``arms`` — the same without the stop first (the
  benchmark starts its arms on it itself, and its baseline arm keeps a generation server); ``purpose`` —
  as ``stops``, with the server serving the phase's own launch line during the block
  (the extraction server of `hidden_states.backend: vllm`); ``keeps`` — nothing handed over (the served
  drafter). With `inference.hosts` the run holds that host (its pool) first.
(`responses`, ``serves``, makes the server serve generation itself:
eagle3_pipeline.inference.provider.InferenceProvider.)

A server that cannot be started or stopped as asked fails the step with the lifecycle's message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dagster as dg

from eagle3_pipeline.components.health.inference_server import server_event_observation
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.config.phases import GpuPhase, phase_row
from eagle3_pipeline.hosts import HostError
from eagle3_pipeline.managed import (
    LaunchError,
    ManagedServerError,
    ServerEvent,
    ServerPurpose,
    ServerSetup,
    Supervisor,
    managed_server,
)
from eagle3_pipeline.managed.phases import after_gpu_phase, gpu_phase_server
from eagle3_pipeline.managed.supervisor import open_supervisor
from eagle3_pipeline.orchestration.hosts import NoHostFree, hold_host
from eagle3_pipeline.orchestration.names import PipelineNames

SERVER_ERRORS = (ManagedServerError, LaunchError, HostError)


@contextmanager
def supervised(
    context: Any, config: PipelineConfig, names: PipelineNames, host_name: str | None = None
) -> Iterator[Supervisor | None]:
    """The supervisor of the managed server of ``host_name`` (None: the pipeline's only or first one), its
    events recorded on the run (``context``: an asset's); None when that server is not managed."""
    setup = managed_server(config, host_name)
    if setup is None:
        yield None
        return
    observed = setup.name if config.inference.hosts else None

    def record(event: ServerEvent) -> None:
        context.log.info(event.line())
        context.log_event(server_event_observation(event, observed, names))

    try:
        with open_supervisor(config, setup.name, record) as supervisor:
            yield supervisor
    except SERVER_ERRORS as exc:
        raise dg.Failure(description=str(exc)) from None


@contextmanager
def _phase_supervisor(
    context: Any, config: PipelineConfig, names: PipelineNames, setup: ServerSetup, phase: GpuPhase
) -> Iterator[Supervisor]:
    """The supervisor of ``setup``'s server for a GPU phase; with `inference.hosts` its host held first."""
    if config.inference.hosts:
        try:
            hold_host(
                context.instance,
                context.run_id,
                launch=config.launch,
                inference=config.inference,
                host_name=setup.name,
                log=context.log.info,
                names=names,
            )
        except NoHostFree as exc:
            raise dg.Failure(description=f"{phase} needs the GPUs of {setup.setting}: {exc}") from None
    with supervised(context, config, names, setup.name) as supervisor:
        assert supervisor is not None
        yield supervisor


@dataclass(frozen=True)
class OwnLaunch:
    """What a ``purpose`` phase has the managed server serve: ``server`` (the extraction server of
    hidden_states, a managed vLLM) serving ``purpose(supervisor)``, built once its host is connected."""

    server: ServerSetup
    purpose: Callable[[Supervisor], ServerPurpose]


@contextmanager
def hand_over(
    context: Any, config: PipelineConfig, names: PipelineNames, phase: GpuPhase, own: OwnLaunch | None = None
) -> Iterator[Supervisor | None]:
    """The managed server around ``phase``'s block, as its row's ``handover`` says (module doc); ``own``: the
    launch line of a ``purpose`` phase, else it stops as for ``stops``. Yields the supervisor (None: no
    managed server there, nothing to hand over)."""
    handover = phase_row(phase).handover
    if handover == "serves":
        raise ValueError(f"{phase}: the server serves it (eagle3_pipeline.inference.provider); nothing is handed over")
    serves_own = own if handover == "purpose" else None
    setup = serves_own.server if serves_own is not None else gpu_phase_server(config, phase)
    if setup is None:
        yield None
        return
    with _phase_supervisor(context, config, names, setup, phase) as supervisor:
        if handover == "keeps":
            yield supervisor
        elif serves_own is not None:
            with supervisor.serving(serves_own.purpose(supervisor), phase, after=lambda: after_gpu_phase(config)):
                yield supervisor
        elif handover == "arms":
            with supervisor.arms(phase, after=lambda: after_gpu_phase(config)):
                yield supervisor
        else:
            with supervisor.handover(phase, after=lambda: after_gpu_phase(config)):
                yield supervisor
