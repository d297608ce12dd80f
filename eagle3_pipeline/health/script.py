"""One shell round trip per tick: a composite POSIX `sh` script that runs every probe section.

Each section (a check module says which argv it needs) starts in the background under its own
`timeout`, writes to its own file in a temp dir, and the script prints the sections between
marker lines carrying a per-tick nonce. A section still running at the script's deadline (a
process stuck in uninterruptible sleep survives `timeout`) is reported as hung, and only the
checks reading it become UNKNOWN. Values such as paths reach the script only as `shlex.quote`d
arguments of constant inner scripts (`sh -c '...' sh "$path"`), never spliced into code.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from eagle3_pipeline.health.report import Status, Verdict
from eagle3_pipeline.hosts import CommandResult, Host, HostError, quote_args

__all__ = [
    "Section",
    "SectionOutput",
    "ShellOutcome",
    "build_probe_script",
    "parse_probe_output",
    "run_shell_probes",
    "section_failure",
]

Section = tuple[str, tuple[str, ...]]
"""A section of the script: its name (lowercase letters) and the argv it runs."""

_HUNG = "hung"
_SCRIPT_HEAD = """PATH="$PATH:/usr/sbin:/sbin"; export PATH; LC_ALL=C; export LC_ALL
d=$(mktemp -d 2>/dev/null || mktemp -d -p /dev/shm 2>/dev/null) || { printf '@@%s notmp@@\\n' {marker}; exit 0; }
alarm=0
trap 'alarm=1' ALRM
(trap 'kill "$s" 2>/dev/null; exit 0' TERM; sleep {hard}& s=$!; wait "$s" && kill -ALRM $$) </dev/null >/dev/null 2>&1 &
w=$!
"""
_SCRIPT_SECTION = 'timeout -k 1 {timeout} {argv} </dev/null >"$d/{name}" 2>&1 & p_{name}=$!\n'
_SCRIPT_TAIL = """for n in {names}; do
  eval "p=\\$p_$n"
  if [ "$alarm" = 0 ]; then wait "$p"; rc=$?; fi
  if [ "$alarm" = 1 ]; then if kill -0 "$p" 2>/dev/null; then rc={hung}; else wait "$p"; rc=$?; fi; fi
  printf '\\n@@%s %s %s@@\\n' {marker} "$n" "$rc"
  cat "$d/$n"
done
printf '\\n@@%s end@@\\n' {marker}
kill "$w" 2>/dev/null
rm -rf "$d"
"""


@dataclass(frozen=True)
class SectionOutput:
    """One section of the composite script: its exit code (None if still running) and output."""

    name: str
    exit_code: int | None
    text: str


@dataclass(frozen=True)
class ShellOutcome:
    """The sections that came back; `failure` says why any other section is missing.

    `marker` is the tick's nonce: the probe script's own processes carry it in their args.
    """

    sections: Mapping[str, SectionOutput]
    failure: str
    marker: str = ""


def build_probe_script(sections: Sequence[tuple[str, Sequence[str]]], marker: str, section_timeout_s: float) -> str:
    """A POSIX sh script running `sections` in parallel, printing each between marker lines."""
    if not re.fullmatch(r"[0-9a-f]{8,64}", marker):
        raise ValueError("marker must be lowercase hex")
    names = [name for name, _ in sections]
    if not all(re.fullmatch(r"[a-z]+", name) for name in names):
        raise ValueError("section names must be lowercase letters")
    head = _SCRIPT_HEAD.replace("{marker}", marker).replace("{hard}", f"{section_timeout_s + 2:g}")
    body = "".join(
        _SCRIPT_SECTION.format(timeout=f"{section_timeout_s:g}", argv=quote_args(*argv), name=name)
        for name, argv in sections
    )
    tail = _SCRIPT_TAIL.replace("{names}", " ".join(names)).replace("{marker}", marker).replace("{hung}", _HUNG)
    return head + body + tail


def parse_probe_output(stdout: str, marker: str) -> dict[str, SectionOutput]:
    """Split the script's stdout into sections; a section cut off by a timeout is left out."""
    header = re.compile(rf"^@@{re.escape(marker)} (?:([a-z]+) (-?\d+|{_HUNG})|end|notmp)@@$")
    sections: dict[str, SectionOutput] = {}
    current: tuple[str, int | None] | None = None
    lines: list[str] = []
    for line in stdout.split("\n"):
        match = header.match(line)
        if match is None:
            lines.append(line)
            continue
        if current is not None:
            sections[current[0]] = SectionOutput(current[0], current[1], "\n".join(lines).strip("\n"))
        current = None if match.group(1) is None else (match.group(1), _exit_code(match.group(2)))
        lines = []
    return sections


def _exit_code(text: str) -> int | None:
    return None if text == _HUNG else int(text)


def run_shell_probes(host: Host, sections: Sequence[Section], section_timeout_s: float) -> ShellOutcome:
    """Run `sections` on `host` in one round trip (the tick runs this in a worker thread)."""
    marker = secrets.token_hex(8)
    script = build_probe_script(sections, marker, section_timeout_s)
    try:
        result = host.run("sh -c " + shlex.quote(script), timeout_s=section_timeout_s + 5)
    except HostError as exc:
        return ShellOutcome({}, str(exc), marker)
    reason = _missing_reason(result, marker, section_timeout_s + 5)
    return ShellOutcome(parse_probe_output(result.stdout, marker), reason, marker)


def _missing_reason(result: CommandResult, marker: str, timeout_s: float) -> str:
    if f"@@{marker} notmp@@" in result.stdout:
        return "cannot create a temp dir on the host (mktemp failed in $TMPDIR and /dev/shm)"
    if result.timed_out:
        return f"host did not answer within {timeout_s:g} s"
    first = (result.stderr.strip().splitlines() or ["no output"])[0][:200]
    return f"probe script failed (exit {result.exit_code}): {first}"


def section_failure(section: SectionOutput, what: str, timeout_s: float) -> Verdict | None:
    """UNKNOWN when a section did not run to a clean exit; None when it did."""
    if section.exit_code is None:
        return Verdict(Status.UNKNOWN, f"{what} still hung after {timeout_s + 2:g} s (uninterruptible?)")
    if section.exit_code in (124, 137):
        return Verdict(Status.UNKNOWN, f"{what} timed out after {timeout_s:g} s")
    if section.exit_code == 127:
        return Verdict(Status.UNKNOWN, f"{what}: command not found on the host")
    if section.exit_code != 0:
        first = (section.text.splitlines() or ["no output"])[0][:160]
        return Verdict(Status.UNKNOWN, f"{what} failed (exit {section.exit_code}): {first}")
    return None
