"""Health check results and the report that gathers them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any

__all__ = ["CheckResult", "HealthReport", "Status", "Verdict", "gate_status", "report_markdown", "tokens_per_second"]


class Status(Enum):
    """A check's verdict, ordered from best to worst: OK < WARN < UNKNOWN < CRITICAL.

    UNKNOWN (a probe timed out, a field could not be parsed, the connection dropped) is never
    healthy: it ranks above WARN.
    """

    OK = "ok"
    WARN = "warn"
    UNKNOWN = "unknown"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return self.rank < other.rank

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return self.rank <= other.rank

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return self.rank > other.rank

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return self.rank >= other.rank


_RANKS = {Status.OK: 0, Status.WARN: 1, Status.UNKNOWN: 2, Status.CRITICAL: 3}
_BLOCKING = (Status.UNKNOWN, Status.CRITICAL)


@dataclass(frozen=True)
class Verdict:
    """What a probe concluded, before it is named and attached to a host."""

    status: Status
    detail: str
    data: Mapping[str, Any] = field(default_factory=dict)


def worst_first(findings: list[tuple[Status, str]], limit: int = 3) -> tuple[Status, str]:
    """The worst status among findings and a one-line detail listing them, worst first."""
    ordered = sorted(findings, key=lambda f: f[0], reverse=True)
    shown = "; ".join(message for _, message in ordered[:limit])
    more = f" (+{len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ordered[0][0], shown + more


@dataclass(frozen=True)
class CheckResult:
    """One check: a verdict with a one-line detail; `data` holds the measured values."""

    name: str
    status: Status
    detail: str
    host: str
    data: Mapping[str, Any] = field(default_factory=dict)
    required: bool = True

    @property
    def blocking(self) -> bool:
        """Whether this check makes its report unhealthy."""
        return self.required and self.status in _BLOCKING

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "host": self.host,
            "required": self.required,
        }


def gate_status(checks: tuple[CheckResult, ...]) -> Status:
    """The gate's one verdict on a set of checks, for the sensor and `status` alike: the worst
    status of the required checks (optional ones are reported, never counted); UNKNOWN when no
    required check ran, since no evidence is not health."""
    return max((c.status for c in checks if c.required), default=Status.UNKNOWN)


@dataclass(frozen=True)
class HealthReport:
    """The checks of one tick. Healthy means `overall` (`gate_status`) is OK or WARN."""

    checks: tuple[CheckResult, ...]
    taken_at: datetime

    @property
    def overall(self) -> Status:
        return gate_status(self.checks)

    @property
    def healthy(self) -> bool:
        return self.overall in (Status.OK, Status.WARN)

    def failing(self) -> tuple[CheckResult, ...]:
        """The checks that make the report unhealthy, worst first."""
        return tuple(sorted((c for c in self.checks if c.blocking), key=lambda c: c.status, reverse=True))

    def check(self, name: str) -> CheckResult:
        for result in self.checks:
            if result.name == name:
                return result
        raise KeyError(name)

    def summary(self) -> str:
        """One line: "healthy" or why not, e.g. for a sensor's SkipReason."""
        if self.healthy:
            return f"healthy ({self.overall.value})"
        if not self.failing():
            return "unhealthy: no required check ran"
        groups: dict[tuple[Status, str], list[str]] = {}
        for check in self.failing():
            groups.setdefault((check.status, check.detail), []).append(check.name)
        reasons = "; ".join(
            f"{', '.join(names)} {status.value}: {detail}" for (status, detail), names in groups.items()
        )
        return f"unhealthy: {reasons}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "overall": self.overall.value,
            "healthy": self.healthy,
            "taken_at": self.taken_at.isoformat(),
            "checks": [c.to_dict() for c in self.checks],
        }


def report_markdown(report: HealthReport) -> str:
    """The checks as a table, and the GPUs as a second one when there are any."""
    lines = ["| check | status | detail | host |", "|---|---|---|---|"]
    lines += [
        f"| {c.name} | {c.status.value.upper()} | {c.detail.replace('|', '/')} | {c.host} |" for c in report.checks
    ]
    gpus = next((c.data.get("gpus") for c in report.checks if c.name == "gpus" and c.data.get("gpus")), None)
    if gpus:
        lines += [
            "",
            "| gpu | name | memory MiB | util % | temp °C | ECC uncorr. | pages pending | remap pending "
            "| remap failed |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {g['index']} | {g['name']} | {g['memory_used_mib']}/{g['memory_total_mib']} | "
            f"{g['utilization_pct']} | {g['temperature_c']} | {g['ecc_uncorrected']} | "
            f"{g['retired_pages_pending']} | {g['remap_pending']} | {g['remap_failure']} |"
            for g in gpus
        ]
    return "\n".join(lines)


def tokens_per_second(report: HealthReport) -> float | None:
    for check in report.checks:
        if check.name == "throughput" and check.data.get("elapsed_s"):
            return float(check.data["delta_tokens"]) / float(check.data["elapsed_s"])
    return None
