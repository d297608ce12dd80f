"""GPUs: parse `nvidia-smi --query-gpu` CSV and kernel Xid summaries, and judge them.

nvidia-smi fields change between drivers, so anything unexpected (a missing or extra column, a
value that is not a number) raises `GpuParseError`, which the GPU check reports as UNKNOWN.
`[N/A]` and `[Not Supported]` mean the GPU does not have that counter (no ECC on the card, no page
retirement on row-remapping GPUs) and are not faults; other bracketed values such as
`[GPU is lost]` or `[Unknown Error]` are the driver reporting a fault, and are CRITICAL.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.health.report import Status, Verdict, worst_first

__all__ = [
    "APPLICATION_XIDS",
    "GPU_QUERY_FIELDS",
    "GpuInfo",
    "GpuParseError",
    "XidEvent",
    "evaluate_gpus",
    "nvidia_smi_argv",
    "parse_gpu_csv",
    "parse_xid_summary",
]

GPU_QUERY_FIELDS = (
    "index",
    "name",
    "memory.used",
    "memory.total",
    "utilization.gpu",
    "temperature.gpu",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
)
# Xids caused by the application (bad memory access, faults in user code), not by the hardware.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

_NOT_AVAILABLE = frozenset({"[N/A]", "N/A", "[Not Supported]", "Not Supported"})
_XID_LINE = re.compile(r"^\s*(\d+)\s+NVRM: Xid \((?:PCI:)?([^)]*)\): (\d+)\s*$")


class GpuParseError(ValueError):
    """nvidia-smi output that does not have the fields and formats we asked for."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_used_mib: float | None
    memory_total_mib: float | None
    utilization_pct: float | None
    temperature_c: float | None
    ecc_uncorrected: int | None
    retired_pages_pending: bool | None
    faults: tuple[str, ...] = ()


@dataclass(frozen=True)
class XidEvent:
    """`count` kernel log lines reporting Xid `code` for the GPU at PCI address `device`."""

    device: str
    code: int
    count: int

    @property
    def status(self) -> Status:
        return Status.WARN if self.code in APPLICATION_XIDS else Status.CRITICAL


def nvidia_smi_argv() -> tuple[str, ...]:
    return ("nvidia-smi", "--query-gpu=" + ",".join(GPU_QUERY_FIELDS), "--format=csv,noheader,nounits")


def parse_gpu_csv(text: str) -> list[GpuInfo]:
    rows = [row for row in csv.reader(text.splitlines(), skipinitialspace=True) if row]
    if not rows:
        raise GpuParseError("nvidia-smi printed no GPU rows")
    return [_parse_row([cell.strip() for cell in row]) for row in rows]


def _parse_row(cells: list[str]) -> GpuInfo:
    if len(cells) != len(GPU_QUERY_FIELDS):
        raise GpuParseError(
            f"expected {len(GPU_QUERY_FIELDS)} nvidia-smi fields, got {len(cells)}: {','.join(cells)[:120]}"
        )
    values = dict(zip(GPU_QUERY_FIELDS, cells, strict=True))
    try:
        index = int(values["index"])
    except ValueError:
        raise GpuParseError(f"unparsable GPU index {values['index']!r}") from None
    faults = tuple(
        f"{value} for {name}" for name, value in values.items() if value.startswith("[") and value not in _NOT_AVAILABLE
    )
    return GpuInfo(
        index=index,
        name=values["name"],
        memory_used_mib=_number(values, "memory.used", index),
        memory_total_mib=_number(values, "memory.total", index),
        utilization_pct=_number(values, "utilization.gpu", index),
        temperature_c=_number(values, "temperature.gpu", index),
        ecc_uncorrected=_integer(values, "ecc.errors.uncorrected.volatile.total", index),
        retired_pages_pending=_yes_no(values, "retired_pages.pending", index),
        faults=faults,
    )


def _number(values: dict[str, str], name: str, index: int) -> float | None:
    value = values[name]
    if value in _NOT_AVAILABLE or value.startswith("["):
        return None
    try:
        return float(value)
    except ValueError:
        raise GpuParseError(f"unparsable {name} {value!r} on GPU {index}") from None


def _integer(values: dict[str, str], name: str, index: int) -> int | None:
    number = _number(values, name, index)
    if number is not None and not number.is_integer():
        raise GpuParseError(f"unparsable {name} {values[name]!r} on GPU {index}")
    return None if number is None else int(number)


def _yes_no(values: dict[str, str], name: str, index: int) -> bool | None:
    value = values[name]
    if value in _NOT_AVAILABLE or value.startswith("["):
        return None
    lowered = value.lower()
    if lowered in ("yes", "1"):
        return True
    if lowered in ("no", "0"):
        return False
    raise GpuParseError(f"unparsable {name} {value!r} on GPU {index}")


def parse_xid_summary(text: str) -> tuple[str, list[XidEvent]]:
    """Parse the Xid section: a `source <dmesg|kern.log|none>` line, then `uniq -c` lines."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("source "):
        raise GpuParseError("Xid summary has no source line")
    events = []
    for line in lines[1:]:
        match = _XID_LINE.match(line)
        if match is None:
            raise GpuParseError(f"unparsable Xid summary line {line[:120]!r}")
        count, device, code = match.groups()
        events.append(XidEvent(device=device, code=int(code), count=int(count)))
    return lines[0].removeprefix("source ").strip(), events


def evaluate_gpus(
    gpus: list[GpuInfo],
    xids: list[XidEvent],
    *,
    expected: int,
    temp_warn_c: float,
    temp_critical_c: float,
) -> Verdict:
    findings = _gpu_findings(gpus, expected, temp_warn_c, temp_critical_c)
    findings += [(x.status, f"Xid {x.code} on {x.device} (x{x.count})") for x in xids]
    data: dict[str, Any] = {
        "visible": len(gpus),
        "expected": expected,
        "gpus": [_gpu_data(g) for g in gpus],
        "xids": [{"device": x.device, "code": x.code, "count": x.count} for x in xids],
    }
    if not findings:
        return Verdict(Status.OK, _healthy_detail(gpus, expected), data)
    status, detail = worst_first(findings)
    return Verdict(status, detail, data)


def _gpu_findings(
    gpus: list[GpuInfo], expected: int, temp_warn_c: float, temp_critical_c: float
) -> list[tuple[Status, str]]:
    findings: list[tuple[Status, str]] = []
    if len(gpus) < expected:
        findings.append((Status.CRITICAL, f"{len(gpus)} GPUs visible, {expected} expected"))
    for gpu in gpus:
        findings += [(Status.CRITICAL, f"GPU {gpu.index} reports {fault}") for fault in gpu.faults]
        if gpu.ecc_uncorrected:
            findings.append((Status.CRITICAL, f"ECC uncorrected errors on GPU {gpu.index}: {gpu.ecc_uncorrected}"))
        if gpu.retired_pages_pending:
            findings.append((Status.CRITICAL, f"GPU {gpu.index} has retired pages pending (reset needed)"))
        if gpu.temperature_c is not None and gpu.temperature_c >= temp_critical_c:
            findings.append(
                (Status.CRITICAL, f"GPU {gpu.index} at {gpu.temperature_c:.0f} C (critical {temp_critical_c:.0f} C)")
            )
        elif gpu.temperature_c is not None and gpu.temperature_c >= temp_warn_c:
            findings.append((Status.WARN, f"GPU {gpu.index} at {gpu.temperature_c:.0f} C (warn {temp_warn_c:.0f} C)"))
    return findings


def _healthy_detail(gpus: list[GpuInfo], expected: int) -> str:
    visible = f"{len(gpus)} GPUs OK" if len(gpus) == expected else f"{len(gpus)} GPUs OK ({expected} expected)"
    temps = [g.temperature_c for g in gpus if g.temperature_c is not None]
    utils = [g.utilization_pct for g in gpus if g.utilization_pct is not None]
    parts = [visible]
    if temps:
        parts.append(f"max {max(temps):.0f} C")
    if utils:
        parts.append(f"mean util {sum(utils) / len(utils):.0f}%")
    return ", ".join(parts)


def _gpu_data(gpu: GpuInfo) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "name": gpu.name,
        "memory_used_mib": gpu.memory_used_mib,
        "memory_total_mib": gpu.memory_total_mib,
        "utilization_pct": gpu.utilization_pct,
        "temperature_c": gpu.temperature_c,
        "ecc_uncorrected": gpu.ecc_uncorrected,
        "retired_pages_pending": gpu.retired_pages_pending,
    }
