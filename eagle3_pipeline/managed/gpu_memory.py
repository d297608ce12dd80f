"""GPU memory on a managed server's host, measured, not inferred from pids: in a container or another PID
namespace nvidia-smi lists other pids (or none), so "none of the server's pids is listed" proves nothing.

- :func:`read_gpu_memory`: one nvidia-smi reading over the host — ``memory.used`` per GPU (the health
  check's own ``--query-gpu`` fields, :func:`~eagle3_pipeline.health.checks.gpus.nvidia_smi_argv`), the
  compute processes (pid, MiB) and their names as ``ps`` shows them on the host;
- a start takes the reading as its **baseline** (kept in the pid file) and is refused, naming the holders,
  when a GPU uses more than ``serving.gpu_free_mib`` (:func:`busy`);
- a stop waits until every GPU is back to its baseline, within ``serving.gpu_release_tolerance_mib``
  (:func:`not_released`; a record with no baseline: back under ``gpu_free_mib``).

No answer from nvidia-smi is no evidence: the reading says why (``unknown``), never "free". A host with no
GPUs declared (``health.expected_gpus`` 0, this machine's CPU default) is not measured at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eagle3_pipeline.health.checks.gpus import GpuParseError, nvidia_smi_argv, parse_gpu_csv
from eagle3_pipeline.health.script import Section, SectionOutput, section_failure
from eagle3_pipeline.managed.processes import NVIDIA_SMI, PROBE_TIMEOUT_S

if TYPE_CHECKING:
    from eagle3_pipeline.managed.servers import ServerSetup

# The probe sections of one reading (run_shell_probes); GPU_SECTION alone is the stop's memory figure.
GPU_SECTION: Section = ("gpus", nvidia_smi_argv())
READING_SECTIONS: list[Section] = [GPU_SECTION, ("apps", NVIDIA_SMI), ("ps", ("ps", "-eo", "pid=,comm="))]


@dataclass(frozen=True)
class GpuMemory:
    """One reading: MiB used per GPU index, the compute processes (pid, MiB, name), or why there is none."""

    used: tuple[tuple[int, float], ...] = ()
    holders: tuple[tuple[int, int, str], ...] = ()
    unknown: str | None = None

    def holders_text(self) -> str:
        if not self.holders:
            return "nvidia-smi lists no compute process (another PID namespace or container hides them)"
        return ", ".join(f"pid {pid} ({name}, {mib} MiB)" for pid, mib, name in self.holders)


def parse_used(section: SectionOutput | None, missing: str) -> tuple[tuple[tuple[int, float], ...], str | None]:
    """(index, MiB used) per GPU from the ``--query-gpu`` section, or why it cannot be read."""
    if section is None:
        return (), f"no answer from nvidia-smi ({missing or 'the probe failed'})"
    if section.exit_code == 127:
        return (), "no nvidia-smi on the host"
    failure = section_failure(section, "nvidia-smi --query-gpu", PROBE_TIMEOUT_S)
    if failure is not None:
        return (), failure.detail
    try:
        gpus = parse_gpu_csv(section.text)
    except GpuParseError as exc:
        return (), f"nvidia-smi --query-gpu: {exc}"
    if any(gpu.memory_used_mib is None for gpu in gpus):
        return (), "nvidia-smi reports no memory.used for some GPU"
    return tuple((gpu.index, float(gpu.memory_used_mib or 0.0)) for gpu in gpus), None


def parse_reading(sections: Mapping[str, SectionOutput], missing: str) -> GpuMemory:
    """A :class:`GpuMemory` from the :data:`READING_SECTIONS` of one probe."""
    used, why = parse_used(sections.get("gpus"), missing)
    if why is not None:
        return GpuMemory(unknown=why)
    names: dict[int, str] = {}
    ps = sections.get("ps")
    for line in ps.text.splitlines() if ps is not None else ():
        pid, _, name = line.strip().partition(" ")
        if pid.isdigit():
            names[int(pid)] = name.strip()
    holders = []
    apps = sections.get("apps")
    for line in apps.text.splitlines() if apps is not None and apps.exit_code == 0 else ():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            pid = int(parts[0])
            mib = int(parts[1]) if parts[1].isdigit() else 0
            holders.append((pid, mib, names.get(pid, "not visible on the host")))
    return GpuMemory(used, tuple(holders))


def busy(reading: GpuMemory, free_mib: float) -> list[tuple[int, float]]:
    """The GPUs using more than ``free_mib`` (index, MiB)."""
    return [(index, mib) for index, mib in reading.used if mib > free_mib]


def not_released(
    used: Sequence[tuple[int, float]],
    baseline: Sequence[tuple[int, float]] | None,
    tolerance_mib: float,
    free_mib: float,
) -> list[tuple[int, float, float]]:
    """The GPUs not back to their baseline within ``tolerance_mib`` (index, MiB used, baseline); with no
    baseline recorded, those above ``free_mib`` (given as the baseline)."""
    before = dict(baseline) if baseline is not None else {}
    held = []
    for index, mib in used:
        if baseline is None:
            if mib > free_mib:
                held.append((index, mib, free_mib))
        elif mib > before.get(index, 0.0) + tolerance_mib:
            held.append((index, mib, before.get(index, 0.0)))
    return held


def figures(held: Sequence[tuple[int, float, float]]) -> str:
    """``GPU 0 70000 MiB (baseline 5 MiB), …``."""
    return ", ".join(f"GPU {index} {mib:.0f} MiB (baseline {base:.0f} MiB)" for index, mib, base in held)


def busy_message(reading: GpuMemory, setup: ServerSetup) -> str | None:
    """Why a start is refused on this reading (the busy GPUs' MiB and the holders), or None: they are free."""
    free_mib = setup.serving.gpu_free_mib
    held = busy(reading, free_mib)
    if not held:
        return None
    shown = ", ".join(f"GPU {index} {mib:.0f} MiB used" for index, mib in held)
    return (
        f"the GPUs are not free: {shown} (more than {setup.setting}.gpu_free_mib = {free_mib:g}); held by "
        f"{reading.holders_text()}. The pipeline did not start that and leaves it alone: stop it, or wait until "
        "it is done"
    )


def pid_check(
    section: SectionOutput | None, pids: Mapping[int, int], setup: ServerSetup, missing: str
) -> tuple[tuple[tuple[int, int], ...], str]:
    """The server's pids that ``--query-compute-apps`` still lists (pid, MiB), and what was checked."""
    if not pids:
        return (), "skipped: no process of the server to look for"
    if section is None:
        return (), f"failed: cannot verify the GPUs ({missing})"
    if section.exit_code == 127:
        if setup.expected_gpus == 0:
            return (), "skipped: no nvidia-smi on the host and health.expected_gpus is 0"
        return (), (
            f"failed: cannot verify the GPUs: no nvidia-smi on the host, which should have "
            f"{setup.expected_gpus} (health.expected_gpus)"
        )
    failure = section_failure(section, "nvidia-smi --query-compute-apps", PROBE_TIMEOUT_S)
    if failure is not None:
        return (), f"failed: cannot verify the GPUs: {failure.detail}"
    held = []
    for line in section.text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) in pids:
            held.append((int(parts[0]), int(parts[1]) if parts[1].isdigit() else 0))
    apps = sum(1 for line in section.text.splitlines() if line.strip())
    return tuple(held), f"ok: nvidia-smi lists {apps} compute process(es), none of the server's"


def release_check(
    section: SectionOutput | None,
    ran: bool,
    baseline: Sequence[tuple[int, float]] | None,
    setup: ServerSetup,
    missing: str,
) -> tuple[tuple[tuple[int, float, float], ...], str]:
    """Per-GPU memory.used back to the start's baseline (:mod:`.gpu_memory`); what could not be measured
    fails where GPUs are declared."""
    if not ran:
        return (), "skipped: no process of the server to release"
    if setup.expected_gpus == 0:
        return (), "skipped: health.expected_gpus is 0 (no GPUs declared)"
    used, why = parse_used(section, missing)
    if why is not None:
        return (), f"failed: cannot measure the GPUs' memory: {why}"
    serving = setup.serving
    held = not_released(used, baseline, serving.gpu_release_tolerance_mib, serving.gpu_free_mib)
    against = (
        f"baseline from the start, tolerance {serving.gpu_release_tolerance_mib:g} MiB"
        if baseline is not None
        else f"no baseline recorded: under {setup.setting}.gpu_free_mib = {serving.gpu_free_mib:g}"
    )
    if held:
        return tuple(held), f"nvidia-smi --query-gpu=memory.used; {against}"
    return (), f"ok: {len(used)} GPU(s) back to the baseline ({against})"
