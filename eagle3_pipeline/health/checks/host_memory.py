"""`host_memory`: enough available RAM (`MemAvailable` in /proc/meminfo; such boxes often run
without swap)."""

from __future__ import annotations

from eagle3_pipeline.health.report import Status, Verdict
from eagle3_pipeline.health.script import Section, SectionOutput, section_failure

__all__ = ["SECTION", "evaluate_memory"]

_GIB = 1 << 30
SECTION: Section = ("mem", ("grep", "-E", "^(MemTotal|MemAvailable):", "/proc/meminfo"))


def evaluate_memory(section: SectionOutput, floor_gb: float, timeout_s: float) -> Verdict:
    failure = section_failure(section, "reading /proc/meminfo", timeout_s)
    if failure is not None:
        return failure
    values: dict[str, int] = {}
    for line in section.text.splitlines():
        key, _, rest = line.partition(":")
        amount = rest.split()
        if amount and amount[0].isdigit():
            values[key.strip()] = int(amount[0]) * 1024
    if "MemAvailable" not in values or "MemTotal" not in values:
        return Verdict(Status.UNKNOWN, "MemAvailable/MemTotal missing from /proc/meminfo")
    available, total = values["MemAvailable"] / _GIB, values["MemTotal"] / _GIB
    data = {"available_gib": round(available, 2), "total_gib": round(total, 2), "floor_gib": floor_gb}
    if available < floor_gb:
        return Verdict(Status.CRITICAL, f"{available:.1f} GiB memory available (floor {floor_gb:g} GiB)", data)
    return Verdict(Status.OK, f"{available:.0f} of {total:.0f} GiB memory available", data)
