"""`server_process`: the real server command line, not a wrapper that mentions it.

Found in `ps -ww -eo pid=,ppid=,args=` by its full argv (`ServerSpec.command_pattern`); for
SGLang the `sglang::scheduler_TP*` descendants must number `tp_size`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.health.report import Status, Verdict, worst_first
from eagle3_pipeline.health.script import Section, SectionOutput, ShellOutcome, section_failure
from eagle3_pipeline.health.settings import ServerSpec

__all__ = ["SECTION", "ProcessInfo", "evaluate_server_process", "parse_ps", "process_verdict"]

SECTION: Section = ("ps", ("ps", "-ww", "-eo", "pid=,ppid=,args="))
_SCHEDULER_RANK = re.compile(r"^sglang::scheduler_(?:\S*_)?TP\d+(?:\s|_|$)")


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    args: str


def parse_ps(text: str) -> list[ProcessInfo]:
    """Parse `ps -eo pid=,ppid=,args=`; raises ValueError on lines of another shape."""
    processes = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if not parts:
            continue
        if len(parts) < 2 or not parts[0].isdigit() or not parts[1].isdigit():
            raise ValueError(f"unparsable ps line {line[:120]!r}")
        processes.append(ProcessInfo(int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else ""))
    if not processes:
        raise ValueError("ps printed no processes")
    return processes


def process_verdict(
    section: SectionOutput | None, spec: ServerSpec, outcome: ShellOutcome, timeout_s: float
) -> tuple[Verdict, frozenset[int] | None]:
    """The check from the tick's `ps` section; also the server's process tree (None: unknown)."""
    if section is None:
        return Verdict(Status.UNKNOWN, outcome.failure), None
    failure = section_failure(section, "ps", timeout_s)
    if failure is not None:
        return failure, None
    try:
        processes = parse_ps(section.text)
    except ValueError as exc:
        return Verdict(Status.UNKNOWN, f"ps output not understood: {exc}"), None
    return evaluate_server_process(processes, spec, exclude=outcome.marker)


def _descendants(roots: Iterable[int], processes: Sequence[ProcessInfo]) -> set[int]:
    children: dict[int, list[int]] = {}
    for proc in processes:
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children.get(pid, ()))
    return found


def evaluate_server_process(
    processes: Sequence[ProcessInfo], spec: ServerSpec, exclude: str = ""
) -> tuple[Verdict, frozenset[int]]:
    """Find the server by its real command line; returns the verdict and the server's process tree.

    Processes whose args contain `exclude` (the tick's own probe script) and their children are
    ignored. For SGLang, the `sglang::scheduler_TP*` descendants must number `tp_size`.
    """
    ours = _descendants((p.pid for p in processes if exclude and exclude in p.args), processes)
    candidates = [p for p in processes if p.pid not in ours]
    pattern = re.compile(spec.command_pattern)
    matched = [p for p in candidates if pattern.search(p.args)]
    matched_pids = {p.pid for p in matched}
    roots = sorted((p for p in matched if p.ppid not in matched_pids), key=lambda p: p.pid)
    if not roots:
        return Verdict(Status.CRITICAL, _no_server_detail(candidates, spec)), frozenset()
    tree = frozenset(_descendants((p.pid for p in roots), candidates))
    data: dict[str, Any] = {"pids": [p.pid for p in roots], "command": roots[0].args[:300]}
    expected = spec.expected_scheduler_ranks
    findings: list[tuple[Status, str]] = []
    if len(roots) > 1:
        findings.append(
            (Status.WARN, f"{len(roots)} {spec.kind} server processes (pids {', '.join(str(p.pid) for p in roots)})")
        )
    if expected is not None:
        ranks = sum(1 for p in candidates if p.pid in tree and _SCHEDULER_RANK.match(p.args))
        data["scheduler_ranks"] = ranks
        if ranks < expected:
            findings.append((Status.CRITICAL, f"{ranks} of {expected} sglang::scheduler_TP ranks running"))
    if findings:
        status, detail = worst_first(findings)
        return Verdict(status, detail, data), tree
    ranks_text = f" with {data['scheduler_ranks']} of {expected} scheduler ranks" if expected is not None else ""
    return Verdict(Status.OK, f"{spec.kind} server pid {roots[0].pid}{ranks_text}", data), tree


def _no_server_detail(processes: Sequence[ProcessInfo], spec: ServerSpec) -> str:
    detail = f"no {spec.kind} server process ({spec.command_description})"
    if spec.kind == "custom":
        return detail
    lookalikes = [p for p in processes if spec.kind in p.args and not _SCHEDULER_RANK.match(p.args)]
    if lookalikes:
        detail += f"; {len(lookalikes)} other process(es) mention {spec.kind!r}, e.g. {lookalikes[0].args[:60]!r}"
    return detail
