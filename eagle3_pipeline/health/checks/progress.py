"""`progress`: the server log and the newest output file advanced within the stall window.

What a stale source means depends on whether requests are running (`busy`): CRITICAL when busy,
OK when idle (nothing is expected to advance), WARN when unknown.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_pipeline.health.report import Status, Verdict
from eagle3_pipeline.health.script import Section, SectionOutput, section_failure

__all__ = ["evaluate_progress", "log_section", "outputs_section"]

_GIB = 1 << 30
_LOG_SCRIPT = r"""date +%s
stat -c '%Y %s' -- "$1" """
_OUTPUTS_SCRIPT = r"""date +%s
if [ -d "$1" ]; then
  find "$1" -type f -printf '%T@ %s\n' 2>/dev/null \
    | awk '{n++; s+=$2; if ($1>m) m=$1} END {printf "%d %.0f %.0f\n", n, s, m}'
else
  echo missing
fi"""


def log_section(path: str) -> Section:
    return ("log", ("sh", "-c", _LOG_SCRIPT, "sh", path))


def outputs_section(path: str) -> Section:
    return ("outputs", ("sh", "-c", _OUTPUTS_SCRIPT, "sh", path))


@dataclass(frozen=True)
class _Progress:
    """One watched source: how long ago it last changed (None: it does not exist)."""

    label: str
    age_s: float | None
    note: str = ""

    def describe(self) -> str:
        if self.age_s is None:
            return f"{self.label} missing"
        return f"{self.label} last written {self.age_s:.0f} s ago{self.note}"


def _log_progress(section: SectionOutput, timeout_s: float) -> _Progress | Verdict:
    lines = section.text.splitlines()
    if section.exit_code == 1 and lines and lines[0].isdigit():
        return _Progress("log", None)  # stat failed: the log does not exist (or is not readable)
    failure = section_failure(section, "stat of the log", timeout_s)
    if failure is not None:
        return failure
    fields = lines[1].split() if len(lines) == 2 and lines[0].isdigit() else []
    if len(fields) != 2 or not fields[0].isdigit():
        return Verdict(Status.UNKNOWN, f"log stat output not understood: {section.text[:120]!r}")
    return _Progress("log", max(0.0, int(lines[0]) - int(fields[0])))


def _outputs_progress(section: SectionOutput, timeout_s: float) -> _Progress | Verdict:
    failure = section_failure(section, "scanning the artifacts dir", timeout_s)
    if failure is not None:
        return failure
    lines = section.text.splitlines()
    if len(lines) == 2 and lines[0].isdigit() and lines[1] == "missing":
        return _Progress("artifacts dir", None)
    fields = lines[1].split() if len(lines) == 2 and lines[0].isdigit() else []
    if len(fields) != 3 or not all(f.isdigit() for f in fields):
        return Verdict(Status.UNKNOWN, f"artifacts scan output not understood: {section.text[:120]!r}")
    files, size, newest = (int(f) for f in fields)
    if files == 0:
        return _Progress("output files", None)
    note = f" ({files} files, {size / _GIB:.1f} GiB)"
    return _Progress("newest output", max(0.0, int(lines[0]) - newest), note)


def evaluate_progress(
    log: SectionOutput | None,
    outputs: SectionOutput | None,
    *,
    busy: bool | None,
    stall_window_s: float,
    timeout_s: float,
    missing: str,
) -> Verdict:
    """Each watched source must have changed within the stall window while work is running.

    `busy` (requests running on the server, None if unknown) decides what a stale source means:
    CRITICAL when busy, OK when idle (nothing is expected to advance), WARN when unknown.
    """
    sources: list[_Progress] = []
    for section, read in ((log, _log_progress), (outputs, _outputs_progress)):
        if section is None:
            continue
        outcome = read(section, timeout_s)
        if isinstance(outcome, Verdict):
            return outcome
        sources.append(outcome)
    if not sources:
        return Verdict(Status.UNKNOWN, missing)
    stale = [s for s in sources if s.age_s is None or s.age_s > stall_window_s]
    data = {"ages_s": {s.label: s.age_s for s in sources}, "stall_window_s": stall_window_s, "busy": busy}
    described = "; ".join(s.describe() for s in sources)
    if not stale:
        return Verdict(Status.OK, described, data)
    described = "; ".join(s.describe() for s in stale) + f" (stall window {stall_window_s:g} s)"
    if busy:
        return Verdict(Status.CRITICAL, f"stalled: {described} while requests are running", data)
    if busy is False:
        return Verdict(Status.OK, f"idle: {described}", data)
    return Verdict(Status.WARN, f"no progress: {described}", data)
