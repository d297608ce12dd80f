"""`port`: the server's port is listening, and owned by the server's process tree (`ss -Htlnp`)."""

from __future__ import annotations

import re
from typing import Any

from eagle3_pipeline.health.report import Status, Verdict
from eagle3_pipeline.health.script import Section, SectionOutput, section_failure

__all__ = ["SECTION", "evaluate_port", "port_verdict"]

SECTION: Section = ("ss", ("ss", "-Htlnp"))
_SS_OWNER = re.compile(r'\("([^"]*)",pid=(\d+)')


def port_verdict(
    section: SectionOutput | None, port: int, server_pids: frozenset[int] | None, missing: str, timeout_s: float
) -> Verdict:
    """The check from the tick's `ss` section (`missing`: why the section did not come back)."""
    if section is None:
        return Verdict(Status.UNKNOWN, missing)
    return section_failure(section, "ss", timeout_s) or evaluate_port(section.text, port, server_pids)


def evaluate_port(ss_text: str, port: int, server_pids: frozenset[int] | None) -> Verdict:
    """Is `port` listening, and owned by the server's process tree (`None`: tree unknown)?"""
    owners: dict[int, str] = {}
    listening = False
    for line in ss_text.splitlines():
        columns = line.split()
        if len(columns) < 5:
            continue
        local = columns[3]
        if local.rpartition(":")[2] != str(port):
            continue
        listening = True
        owners.update({int(pid): name for name, pid in _SS_OWNER.findall(line)})
    data: dict[str, Any] = {"port": port, "owner_pids": sorted(owners)}
    if not listening:
        return Verdict(Status.CRITICAL, f"nothing listening on port {port}", data)
    if not owners:
        return Verdict(Status.WARN, f"port {port} listening; its owner is not visible to this user", data)
    if server_pids is None:
        return Verdict(Status.UNKNOWN, f"port {port} listening (pid {min(owners)}), server process unknown", data)
    if owners.keys() & server_pids:
        return Verdict(Status.OK, f"port {port} listening (pid {min(owners.keys() & server_pids)})", data)
    pid = min(owners)
    return Verdict(Status.CRITICAL, f"port {port} held by pid {pid} ({owners[pid]}), not by the server", data)
