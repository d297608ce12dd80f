"""When a running managed server is called hung: the probe-window policy of :mod:`.recovery`, apart from
the probes themselves so that the decision is plain arithmetic on what the probes found.

A reload of a 1T model costs 10–40 minutes, so one failed probe (a long prefill, a busy host) must not
cost one. After requests fail as a dead or hung server fails, the recovery probes the server (process,
port, a generation, each probe's client timeout longer than the engine's own health wait) every
``window / (probes - 1)`` seconds:

- a probe that **answers** ends the check: the server serves, nothing is restarted;
- a probe that **failed** (a check CRITICAL: no generation in time, the port closed, …) counts; the server
  is **hung** once ``probes`` probes in a row failed and the last ended at least ``window`` seconds after
  the first was sent (the server has not answered for that long: measured from the first probe's end, the
  ``probes``-th probe on its ``window / (probes - 1)`` schedule would land on the bound itself and a few
  milliseconds of jitter would cost one more probe);
- a probe that **cannot tell** (UNKNOWN: the host did not answer the shell probes, the tick ran out)
  never counts, and never restarts: past :attr:`HangPolicy.give_up_s` without a verdict, the check
  reports that it cannot tell, and the failed requests are ordinary failures (retried and counted).

The window's default scales with the server's measured start time (what a reload costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from eagle3_pipeline.config import ServingConfig
from eagle3_pipeline.health import HealthReport, Status
from eagle3_pipeline.managed.lifecycle import READY_CHECKS

# The default window: this share of the server's measured start time (of serving.startup_timeout_s before one
# was measured), at least hang_probes × hang_probe_timeout_s.
WINDOW_SHARE_OF_START = 0.25

ProbeOutcome = Literal["answered", "failed", "unknown"]
Verdict = Literal["serving", "hung", "unknown"]


@dataclass(frozen=True)
class HangPolicy:
    """How many failed probes in a row, over how long, make a server hung; each probe's client timeout."""

    probes: int
    window_s: float
    probe_timeout_s: float
    window_source: str = "serving.hang_window_s"

    @classmethod
    def of(cls, serving: ServingConfig, start_s: float | None) -> HangPolicy:
        """The policy of ``serving``; ``start_s``: how long the running server took to get ready (None when
        that was not measured), which the default window scales with."""
        if serving.hang_window_s is not None:
            return cls(serving.hang_probes, serving.hang_window_s, serving.hang_probe_timeout_s)
        floor = serving.hang_probes * serving.hang_probe_timeout_s
        if start_s is not None:
            measured, source = start_s, f"its measured start of {start_s:.0f} s"
        else:
            measured, source = serving.startup_timeout_s, f"serving.startup_timeout_s {serving.startup_timeout_s:g} s"
        window = max(WINDOW_SHARE_OF_START * measured, floor)
        shown = f"a quarter of {source}, at least {serving.hang_probes} x {serving.hang_probe_timeout_s:g} s"
        return cls(serving.hang_probes, window, serving.hang_probe_timeout_s, shown)

    @property
    def spacing_s(self) -> float:
        """Seconds from one probe's start to the next one's."""
        return self.window_s / max(1, self.probes - 1)

    @property
    def give_up_s(self) -> float:
        """How long a check probes without a verdict before it reports that it cannot tell."""
        return 2 * self.window_s + self.probe_timeout_s

    def describe(self) -> str:
        return (
            f"{self.probes} failed probe(s) in a row over at least {self.window_s:g} s ({self.window_source}), "
            f"each given {self.probe_timeout_s:g} s"
        )


@dataclass
class HangWatch:
    """One check's probes (each recorded) and the verdict they reach (module doc); times in seconds from
    the check's start."""

    policy: HangPolicy
    failed: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each failed probe so far
    probes: list[dict[str, Any]] = field(default_factory=list)

    def add(self, outcome: ProbeOutcome, started: float, ended: float, detail: str) -> Verdict | None:
        """Record one probe; the verdict when the probes reached one, else None (probe again at
        :meth:`next_probe_at`)."""
        self.probes.append(
            {"probe": len(self.probes) + 1, "outcome": outcome, "at_s": round(started, 3), "detail": detail}
        )
        if outcome == "answered":
            return "serving"
        if outcome == "failed":
            self.failed.append((started, ended))
        policy = self.policy
        if len(self.failed) >= policy.probes and ended - self.failed[0][0] >= policy.window_s:
            return "hung"
        if ended >= policy.give_up_s:
            return "unknown"
        return None

    def next_probe_at(self) -> float:
        """When the next probe starts: the schedule's next slot (at once when the probes overran it)."""
        return len(self.probes) * self.policy.spacing_s

    def summary(self) -> str:
        failed = len(self.failed)
        unknown = sum(p["outcome"] == "unknown" for p in self.probes)
        span = self.failed[-1][1] - self.failed[0][0] if self.failed else 0.0
        return (
            f"{len(self.probes)} probe(s): {failed} failed in a row over {span:.1f} s, {unknown} could not tell "
            f"(hung takes {self.policy.describe()})"
        )


def probe_outcome(report: HealthReport) -> tuple[ProbeOutcome, str]:
    """A probe's outcome from its health tick: answered (process, port and generation OK or WARN, e.g. a
    429), failed (one of them CRITICAL), else unknown; and what the checks that are not OK said."""
    checks = [c for c in report.checks if c.name in READY_CHECKS]
    shown = "; ".join(f"{c.name} {c.status.value}: {c.detail}" for c in checks if c.status != Status.OK)
    if any(c.status == Status.CRITICAL for c in checks):
        return "failed", shown
    if all(c.status in (Status.OK, Status.WARN) for c in checks) and len(checks) == len(READY_CHECKS):
        return "answered", shown or report.summary()
    return "unknown", shown or "the probe's checks did not report"
