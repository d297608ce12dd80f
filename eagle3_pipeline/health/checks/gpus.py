"""`gpus`: the expected count, no uncorrected ECC errors, no pending page retirement or row remap,
no critical Xid, temperatures below their lines.

nvidia-smi fields change between drivers, so anything unexpected (a missing or extra column, a
value that is not a number) raises `GpuParseError`, which the check reports as UNKNOWN.
`[N/A]` and `[Not Supported]` mean the GPU does not have that counter (no ECC on the card, no page
retirement on row-remapping GPUs) and are not faults; other bracketed values such as
`[GPU is lost]` or `[Unknown Error]` are the driver reporting a fault, and are CRITICAL.

Memory health needs evidence: a GPU whose retired-pages counter is `[N/A]` (A100/H100/H200 remap
rows instead of retiring pages) must show its row-remapping state (`--query-remapped-rows`), where
a pending remap (reset needed) or a failed one is CRITICAL; with neither readable it is UNKNOWN.
The kernel log is read for Xids with `dmesg`, else `journalctl -k` (where dmesg is restricted),
else the kernel log file; when none is readable the check is UNKNOWN, never "no Xid".
"""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.health.report import Status, Verdict, worst_first
from eagle3_pipeline.health.script import Section, SectionOutput, section_failure

__all__ = [
    "APPLICATION_XIDS",
    "GPU_QUERY_FIELDS",
    "REMAP_QUERY_FIELDS",
    "GpuInfo",
    "GpuParseError",
    "RowRemap",
    "XidEvent",
    "evaluate_gpu_sections",
    "evaluate_gpus",
    "nvidia_smi_argv",
    "parse_gpu_csv",
    "parse_remap_csv",
    "parse_xid_summary",
    "remap_argv",
    "sections",
]

GPU_QUERY_FIELDS = (
    "index",
    "pci.bus_id",
    "name",
    "memory.used",
    "memory.total",
    "utilization.gpu",
    "temperature.gpu",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
)
REMAP_QUERY_FIELDS = (
    "gpu_bus_id",
    "remapped_rows.correctable",
    "remapped_rows.uncorrectable",
    "remapped_rows.pending",
    "remapped_rows.failure",
)
# Xids caused by the application (bad memory access, faults in user code), not by the hardware.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

_NOT_AVAILABLE = frozenset({"[N/A]", "N/A", "[Not Supported]", "Not Supported"})
_XID_LINE = re.compile(r"^\s*(\d+)\s+NVRM: Xid \((?:PCI:)?([^)]*)\): (\d+)\s*$")
_UNREADABLE = "none"

# The kernel log's Xid lines, counted: dmesg, else journalctl -k (dmesg_restrict), else the log
# file "$1". An empty answer counts as unreadable (journalctl shows an unprivileged user nothing).
_XID_SCRIPT = r"""x='NVRM: Xid \([^)]*\): [0-9]+'
if out=$(dmesg 2>/dev/null) && [ -n "$out" ]; then
  echo 'source dmesg'; printf '%s\n' "$out" | grep -aoE "$x" | sort | uniq -c
elif out=$(journalctl -k -b -q --no-pager -o short 2>/dev/null) && [ -n "$out" ]; then
  echo 'source journalctl'; printf '%s\n' "$out" | grep -aoE "$x" | sort | uniq -c
elif [ -r "$1" ]; then
  echo 'source kern.log'
  awk '/kernel: Linux version /{n=0} /NVRM: Xid/{l[n++]=$0} END{for(i=0;i<n;i++) print l[i]}' "$1" \
    | grep -aoE "$x" | sort | uniq -c
else
  echo 'source none'
fi"""


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
    bus_id: str = ""


@dataclass(frozen=True)
class RowRemap:
    """A GPU's row-remapping state (`None`: the GPU does not report it)."""

    bus_id: str
    correctable: int | None
    uncorrectable: int | None
    pending: bool | None
    failure: bool | None

    @property
    def known(self) -> bool:
        return self.pending is not None and self.failure is not None


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


def remap_argv() -> tuple[str, ...]:
    return ("nvidia-smi", "--query-remapped-rows=" + ",".join(REMAP_QUERY_FIELDS), "--format=csv,noheader,nounits")


def sections(kernel_log_path: str) -> list[Section]:
    """What the check collects on the host: the GPU table, the remap table and the Xid counts."""
    return [
        ("gpu", nvidia_smi_argv()),
        ("remap", remap_argv()),
        ("xid", ("sh", "-c", _XID_SCRIPT, "sh", kernel_log_path)),
    ]


def _csv_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in row] for row in csv.reader(text.splitlines(), skipinitialspace=True) if row]


def parse_gpu_csv(text: str) -> list[GpuInfo]:
    rows = _csv_rows(text)
    if not rows:
        raise GpuParseError("nvidia-smi printed no GPU rows")
    return [_parse_row(row) for row in rows]


def _parse_row(cells: list[str]) -> GpuInfo:
    if len(cells) != len(GPU_QUERY_FIELDS):
        raise GpuParseError(
            f"expected {len(GPU_QUERY_FIELDS)} nvidia-smi fields, got {len(cells)}: {','.join(cells)[:120]}"
        )
    values: dict[str, str] = dict(zip(GPU_QUERY_FIELDS, cells, strict=True))
    try:
        index = int(values["index"])
    except ValueError:
        raise GpuParseError(f"unparsable GPU index {values['index']!r}") from None
    faults = tuple(
        f"{value} for {name}" for name, value in values.items() if value.startswith("[") and value not in _NOT_AVAILABLE
    )
    where = f"GPU {index}"
    return GpuInfo(
        index=index,
        name=values["name"],
        memory_used_mib=_number(values, "memory.used", where),
        memory_total_mib=_number(values, "memory.total", where),
        utilization_pct=_number(values, "utilization.gpu", where),
        temperature_c=_number(values, "temperature.gpu", where),
        ecc_uncorrected=_integer(values, "ecc.errors.uncorrected.volatile.total", where),
        retired_pages_pending=_yes_no(values, "retired_pages.pending", where),
        faults=faults,
        bus_id=_bus_id(values["pci.bus_id"]),
    )


def parse_remap_csv(text: str) -> dict[str, RowRemap]:
    """`--query-remapped-rows` rows by normalized PCI bus id."""
    remaps: dict[str, RowRemap] = {}
    for cells in _csv_rows(text):
        if len(cells) != len(REMAP_QUERY_FIELDS):
            raise GpuParseError(
                f"expected {len(REMAP_QUERY_FIELDS)} remapped-rows fields, got {len(cells)}: {','.join(cells)[:120]}"
            )
        values: dict[str, str] = dict(zip(REMAP_QUERY_FIELDS, cells, strict=True))
        bus_id = _bus_id(values["gpu_bus_id"])
        where = f"GPU {bus_id}"
        remaps[bus_id] = RowRemap(
            bus_id=bus_id,
            correctable=_integer(values, "remapped_rows.correctable", where),
            uncorrectable=_integer(values, "remapped_rows.uncorrectable", where),
            pending=_yes_no(values, "remapped_rows.pending", where),
            failure=_yes_no(values, "remapped_rows.failure", where),
        )
    return remaps


def _bus_id(text: str) -> str:
    """`00000000:3B:00.0` (nvidia-smi) → `0000:3b:00.0`, the domain as the kernel writes it."""
    domain, sep, rest = text.strip().lower().rpartition(":")
    head, _, bus = domain.rpartition(":") if domain.count(":") else ("", "", domain)
    return f"{head[-4:]}:{bus}:{rest}" if sep and head else text.strip().lower()


def _number(values: dict[str, str], name: str, where: str) -> float | None:
    value = values[name]
    if value in _NOT_AVAILABLE or value.startswith("["):
        return None
    try:
        return float(value)
    except ValueError:
        raise GpuParseError(f"unparsable {name} {value!r} on {where}") from None


def _integer(values: dict[str, str], name: str, where: str) -> int | None:
    number = _number(values, name, where)
    if number is not None and not number.is_integer():
        raise GpuParseError(f"unparsable {name} {values[name]!r} on {where}")
    return None if number is None else int(number)


def _yes_no(values: dict[str, str], name: str, where: str) -> bool | None:
    value = values[name]
    if value in _NOT_AVAILABLE or value.startswith("["):
        return None
    lowered = value.lower()
    if lowered in ("yes", "1"):
        return True
    if lowered in ("no", "0"):
        return False
    raise GpuParseError(f"unparsable {name} {value!r} on {where}")


def parse_xid_summary(text: str) -> tuple[str, list[XidEvent]]:
    """Parse the Xid section: a `source <dmesg|journalctl|kern.log|none>` line, then `uniq -c` lines."""
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


def evaluate_gpu_sections(
    gpu: SectionOutput | None,
    remap: SectionOutput | None,
    xid: SectionOutput | None,
    *,
    expected: int,
    temp_warn_c: float,
    temp_critical_c: float,
    missing: str,
    timeout_s: float,
) -> Verdict:
    """The check from the tick's sections (`missing`: why a section did not come back)."""
    if expected == 0:
        return Verdict(Status.OK, "no GPUs required")
    if gpu is None:
        return Verdict(Status.UNKNOWN, missing)
    failure = section_failure(gpu, "nvidia-smi", timeout_s)
    if failure is not None:
        return failure
    try:
        gpus = parse_gpu_csv(gpu.text)
        remaps, remap_why = _remaps(remap, missing, timeout_s)
        source, xids, xid_why = _xids(xid, missing, timeout_s)
    except GpuParseError as exc:
        return Verdict(Status.UNKNOWN, f"nvidia-smi output not understood: {exc}")
    return evaluate_gpus(
        gpus,
        xids,
        expected=expected,
        temp_warn_c=temp_warn_c,
        temp_critical_c=temp_critical_c,
        remaps=remaps,
        remap_why=remap_why,
        xid_source=source,
        xid_why=xid_why,
    )


def _remaps(section: SectionOutput | None, missing: str, timeout_s: float) -> tuple[dict[str, RowRemap] | None, str]:
    if section is None:
        return None, missing
    failure = section_failure(section, "nvidia-smi --query-remapped-rows", timeout_s)
    if failure is not None:
        return None, failure.detail
    return parse_remap_csv(section.text), ""


def _xids(section: SectionOutput | None, missing: str, timeout_s: float) -> tuple[str, list[XidEvent], str]:
    if section is None:
        return _UNREADABLE, [], missing
    failure = section_failure(section, "reading the kernel log", timeout_s)
    if failure is not None:
        return _UNREADABLE, [], failure.detail
    source, xids = parse_xid_summary(section.text)
    return source, xids, ""


def evaluate_gpus(
    gpus: list[GpuInfo],
    xids: list[XidEvent],
    *,
    expected: int,
    temp_warn_c: float,
    temp_critical_c: float,
    remaps: Mapping[str, RowRemap] | None = None,
    remap_why: str = "",
    xid_source: str = "dmesg",
    xid_why: str = "",
) -> Verdict:
    """The rules. `remaps` None: the remap table could not be read (`remap_why` says why);
    `xid_source` "none": no kernel log was readable, so seeing no Xid is not evidence."""
    findings = _gpu_findings(gpus, expected, temp_warn_c, temp_critical_c)
    findings += _memory_findings(gpus, remaps, remap_why)
    findings += [(x.status, f"Xid {x.code} on {x.device} (x{x.count})") for x in xids]
    if xid_source == _UNREADABLE:
        why = xid_why or "no readable kernel log (dmesg, journalctl -k, kern.log)"
        findings.append((Status.UNKNOWN, f"Xids unknown: {why}"))
    data: dict[str, Any] = {
        "visible": len(gpus),
        "expected": expected,
        "gpus": [_gpu_data(g, (remaps or {}).get(g.bus_id)) for g in gpus],
        "xids": [{"device": x.device, "code": x.code, "count": x.count} for x in xids],
        "xid_source": xid_source,
    }
    if not findings:
        return Verdict(Status.OK, _healthy_detail(gpus, expected), data)
    status, detail = worst_first(findings)
    return Verdict(status, detail, data)


def _memory_findings(
    gpus: list[GpuInfo], remaps: Mapping[str, RowRemap] | None, remap_why: str
) -> list[tuple[Status, str]]:
    findings: list[tuple[Status, str]] = []
    blind = []
    for gpu in gpus:
        remap = (remaps or {}).get(gpu.bus_id)
        if remap is not None and remap.pending:
            findings.append((Status.CRITICAL, f"GPU {gpu.index} has a row remap pending (reset needed)"))
        if remap is not None and remap.failure:
            findings.append((Status.CRITICAL, f"GPU {gpu.index} row remapping failed (the GPU needs service)"))
        if gpu.retired_pages_pending is None and (remap is None or not remap.known):
            blind.append(str(gpu.index))
    if blind:
        why = f" ({remap_why})" if remap_why else ""
        findings.append(
            (
                Status.UNKNOWN,
                f"GPU {', '.join(blind)}: neither retired pages nor row remapping readable{why}",
            )
        )
    return findings


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


def _gpu_data(gpu: GpuInfo, remap: RowRemap | None) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "bus_id": gpu.bus_id,
        "name": gpu.name,
        "memory_used_mib": gpu.memory_used_mib,
        "memory_total_mib": gpu.memory_total_mib,
        "utilization_pct": gpu.utilization_pct,
        "temperature_c": gpu.temperature_c,
        "ecc_uncorrected": gpu.ecc_uncorrected,
        "retired_pages_pending": gpu.retired_pages_pending,
        "remap_pending": remap.pending if remap else None,
        "remap_failure": remap.failure if remap else None,
        "remapped_rows_uncorrectable": remap.uncorrectable if remap else None,
    }
