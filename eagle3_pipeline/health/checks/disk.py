"""`disk`: free space on the output volume (the watched dir, or its nearest existing parent)."""

from __future__ import annotations

from eagle3_pipeline.health.report import Status, Verdict
from eagle3_pipeline.health.script import Section, SectionOutput, section_failure

__all__ = ["evaluate_disk", "section"]

_GIB = 1 << 30
_DISK_SCRIPT = r"""p=$1
while [ ! -e "$p" ]; do p=$(dirname -- "$p"); done
printf '%s\n' "$p"
df -Pk -- "$p" | tail -n 1"""


def section(path: str) -> Section:
    return ("disk", ("sh", "-c", _DISK_SCRIPT, "sh", path))


def evaluate_disk(section: SectionOutput, floor_gb: float, timeout_s: float) -> Verdict:
    failure = section_failure(section, "df", timeout_s)
    if failure is not None:
        return failure
    lines = section.text.splitlines()
    fields = lines[-1].split(None, 5) if len(lines) >= 2 else []
    if len(fields) < 6 or not fields[3].isdigit():
        return Verdict(Status.UNKNOWN, f"df output not understood: {section.text[:120]!r}")
    path, free_gib = lines[0], int(fields[3]) * 1024 / _GIB
    data = {"path": path, "mount": fields[5], "free_gib": round(free_gib, 2), "floor_gib": floor_gb}
    if free_gib < floor_gb:
        return Verdict(Status.CRITICAL, f"{free_gib:.1f} GiB free on {fields[5]} (floor {floor_gb:g} GiB)", data)
    return Verdict(Status.OK, f"{free_gib:.0f} GiB free on {fields[5]} ({fields[4]} used)", data)
