"""The health probes of DESIGN §3 and `run_health_tick`, which runs them all once.

One tick makes one shell round trip to the host and, at the same time, two HTTP requests to the
server. The shell side is one composite POSIX `sh` script: every section (ps, ss, nvidia-smi,
Xid log, df, meminfo, log and output stats) starts in the background under its own
`timeout`, writes to its own file in a temp dir, and the script prints the sections between
marker lines carrying a per-tick nonce. A section still running at the script's deadline (a
process stuck in uninterruptible sleep survives `timeout`) is reported as hung and its check
alone becomes UNKNOWN. Values such as paths reach the script only as `shlex.quote`d arguments
of constant inner scripts (`sh -c '...' sh "$path"`), never spliced into code.

The tick as a whole is bounded by `HealthThresholds.tick_timeout_s`: whatever has not answered
by then (a hung host, a trickling server) is reported as UNKNOWN, and the tick returns.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import httpx

from eagle3_pipeline.health.gpu import GpuParseError, evaluate_gpus, nvidia_smi_argv, parse_gpu_csv, parse_xid_summary
from eagle3_pipeline.health.metrics import (
    MetricsParseError,
    MetricsScrape,
    ThroughputBaseline,
    evaluate_throughput,
    parse_metrics,
)
from eagle3_pipeline.health.report import CheckResult, HealthReport, Status, Verdict, worst_first
from eagle3_pipeline.health.settings import CHECK_NAMES, HealthThresholds, ServerSpec
from eagle3_pipeline.hosts import CommandResult, Host, HostError, quote_args

__all__ = [
    "ProcessInfo",
    "SectionOutput",
    "ShellOutcome",
    "TickState",
    "build_probe_script",
    "evaluate_disk",
    "evaluate_gpu_sections",
    "evaluate_memory",
    "evaluate_port",
    "evaluate_progress",
    "evaluate_server_process",
    "fetch_metrics",
    "parse_probe_output",
    "parse_ps",
    "probe_generation",
    "probe_sections",
    "run_health_tick",
    "run_shell_probes",
]

_GIB = 1 << 30
_SCHEDULER_RANK = re.compile(r"^sglang::scheduler_(?:\S*_)?TP\d+(?:\s|_|$)")
_HUNG = "hung"

# Inner scripts are constants; paths arrive as "$1".
_XID_SCRIPT = r"""x='NVRM: Xid \([^)]*\): [0-9]+'
if out=$(dmesg 2>/dev/null); then
  echo 'source dmesg'; printf '%s\n' "$out" | grep -aoE "$x" | sort | uniq -c
elif [ -r /var/log/kern.log ]; then
  echo 'source kern.log'
  awk '/kernel: Linux version /{n=0} /NVRM: Xid/{l[n++]=$0} END{for(i=0;i<n;i++) print l[i]}' /var/log/kern.log \
    | grep -aoE "$x" | sort | uniq -c
else
  echo 'source none'
fi"""
_DISK_SCRIPT = r"""p=$1
while [ ! -e "$p" ]; do p=$(dirname -- "$p"); done
printf '%s\n' "$p"
df -Pk -- "$p" | tail -n 1"""
_LOG_SCRIPT = r"""date +%s
stat -c '%Y %s' -- "$1" """
_OUTPUTS_SCRIPT = r"""date +%s
if [ -d "$1" ]; then
  find "$1" -type f -printf '%T@ %s\n' 2>/dev/null \
    | awk '{n++; s+=$2; if ($1>m) m=$1} END {printf "%d %.0f %.0f\n", n, s, m}'
else
  echo missing
fi"""

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


# -- the shell round trip --------------------------------------------------------------------


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


def probe_sections(thresholds: HealthThresholds) -> list[tuple[str, tuple[str, ...]]]:
    """The (name, argv) sections a tick runs on the host."""
    sections: list[tuple[str, tuple[str, ...]]] = [
        ("ps", ("ps", "-ww", "-eo", "pid=,ppid=,args=")),
        ("ss", ("ss", "-Htlnp")),
    ]
    if thresholds.expected_gpus > 0:
        sections.append(("gpu", nvidia_smi_argv()))
        sections.append(("xid", ("sh", "-c", _XID_SCRIPT)))
    sections.append(("disk", ("sh", "-c", _DISK_SCRIPT, "sh", thresholds.disk_path)))
    sections.append(("mem", ("grep", "-E", "^(MemTotal|MemAvailable):", "/proc/meminfo")))
    if thresholds.log_path is not None:
        sections.append(("log", ("sh", "-c", _LOG_SCRIPT, "sh", thresholds.log_path)))
    if thresholds.artifacts_dir is not None:
        sections.append(("outputs", ("sh", "-c", _OUTPUTS_SCRIPT, "sh", thresholds.artifacts_dir)))
    return sections


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


def run_shell_probes(host: Host, thresholds: HealthThresholds) -> ShellOutcome:
    """The composite shell round trip on its own (the tick runs it in a worker thread)."""
    marker = secrets.token_hex(8)
    timeout = thresholds.shell_section_timeout_s
    script = build_probe_script(probe_sections(thresholds), marker, timeout)
    try:
        result = host.run("sh -c " + shlex.quote(script), timeout_s=timeout + 5)
    except HostError as exc:
        return ShellOutcome({}, str(exc), marker)
    return ShellOutcome(parse_probe_output(result.stdout, marker), _missing_reason(result, marker, timeout + 5), marker)


def _missing_reason(result: CommandResult, marker: str, timeout_s: float) -> str:
    if f"@@{marker} notmp@@" in result.stdout:
        return "cannot create a temp dir on the host (mktemp failed in $TMPDIR and /dev/shm)"
    if result.timed_out:
        return f"host did not answer within {timeout_s:g} s"
    first = (result.stderr.strip().splitlines() or ["no output"])[0][:200]
    return f"probe script failed (exit {result.exit_code}): {first}"


def _section_failure(section: SectionOutput, what: str, timeout_s: float) -> Verdict | None:
    """UNKNOWN when a section did not run to a clean exit."""
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


# -- server process and port -------------------------------------------------------------------


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


_SS_OWNER = re.compile(r'\("([^"]*)",pid=(\d+)')


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


# -- GPUs, disk, memory, progress --------------------------------------------------------------


def evaluate_gpu_sections(
    gpu: SectionOutput | None, xid: SectionOutput | None, thresholds: HealthThresholds, missing: str
) -> Verdict:
    if thresholds.expected_gpus == 0:
        return Verdict(Status.OK, "no GPUs required")
    if gpu is None:
        return Verdict(Status.UNKNOWN, missing)
    failure = _section_failure(gpu, "nvidia-smi", thresholds.shell_section_timeout_s)
    if failure is not None:
        return failure
    try:
        gpus = parse_gpu_csv(gpu.text)
        xid_source, xids = parse_xid_summary(xid.text) if xid is not None and xid.exit_code == 0 else ("none", [])
    except GpuParseError as exc:
        return Verdict(Status.UNKNOWN, f"nvidia-smi output not understood: {exc}")
    verdict = evaluate_gpus(
        gpus,
        xids,
        expected=thresholds.expected_gpus,
        temp_warn_c=thresholds.gpu_temp_warn_c,
        temp_critical_c=thresholds.gpu_temp_critical_c,
    )
    return Verdict(verdict.status, verdict.detail, {**verdict.data, "xid_source": xid_source})


def evaluate_disk(section: SectionOutput, floor_gb: float, timeout_s: float) -> Verdict:
    failure = _section_failure(section, "df", timeout_s)
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


def evaluate_memory(section: SectionOutput, floor_gb: float, timeout_s: float) -> Verdict:
    failure = _section_failure(section, "reading /proc/meminfo", timeout_s)
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
    failure = _section_failure(section, "stat of the log", timeout_s)
    if failure is not None:
        return failure
    fields = lines[1].split() if len(lines) == 2 and lines[0].isdigit() else []
    if len(fields) != 2 or not fields[0].isdigit():
        return Verdict(Status.UNKNOWN, f"log stat output not understood: {section.text[:120]!r}")
    return _Progress("log", max(0.0, int(lines[0]) - int(fields[0])))


def _outputs_progress(section: SectionOutput, timeout_s: float) -> _Progress | Verdict:
    failure = _section_failure(section, "scanning the artifacts dir", timeout_s)
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


# -- HTTP probes -------------------------------------------------------------------------------


def _client(spec: ServerSpec, timeout_s: float) -> httpx.Client:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0))
    return httpx.Client(timeout=timeout, headers=headers, trust_env=False)


def probe_generation(spec: ServerSpec, timeout_s: float) -> Verdict:
    """A real 1-token chat completion (or `/health_generate`) must answer within `timeout_s`.

    A plain `/health` is not enough: it answers while generation is hung.
    """
    path = "/v1/chat/completions" if spec.generation_probe == "chat" else "/health_generate"
    started = time.monotonic()
    try:
        with _client(spec, timeout_s) as client:
            if spec.generation_probe == "chat":
                response = client.post(spec.url(path), json=_one_token_request(spec))
            else:
                response = client.get(spec.url(path))
    except httpx.ConnectTimeout:
        return Verdict(Status.UNKNOWN, f"could not connect for {path} within {min(timeout_s, 5.0):g} s")
    except httpx.ConnectError as exc:
        if "refused" in str(exc).lower():
            return Verdict(Status.CRITICAL, f"connection refused for {path} (server not listening)")
        return Verdict(Status.UNKNOWN, f"cannot connect for {path}: {exc}")
    except httpx.TimeoutException:
        return Verdict(Status.CRITICAL, f"no answer from {path} within {timeout_s:g} s (generation hung?)")
    except httpx.HTTPError as exc:
        return Verdict(Status.CRITICAL, f"{path} failed: {type(exc).__name__}: {exc}")
    latency = time.monotonic() - started
    return _generation_verdict(response, path, latency, spec)


def _one_token_request(spec: ServerSpec) -> dict[str, Any]:
    return {
        "model": spec.model,
        "messages": [{"role": "user", "content": "Reply with OK."}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
    }


def _generation_verdict(response: httpx.Response, path: str, latency: float, spec: ServerSpec) -> Verdict:
    data = {"http_status": response.status_code, "latency_s": round(latency, 3)}
    code = response.status_code
    if code == 429:
        return Verdict(Status.WARN, f"HTTP 429 from {path} (rate limited)", data)
    if code != 200:
        hint = {401: " (check the API key)", 403: " (check the API key)", 404: " (check the model name and URL)"}
        return Verdict(Status.CRITICAL, f"HTTP {code} from {path}{hint.get(code, '')}", data)
    if spec.generation_probe == "chat" and not _has_choice(response):
        return Verdict(Status.CRITICAL, f"{path} answered 200 without a completion", data)
    what = "1-token completion" if spec.generation_probe == "chat" else "/health_generate"
    return Verdict(Status.OK, f"{what} in {latency:.2f} s", data)


def _has_choice(response: httpx.Response) -> bool:
    try:
        choices = response.json().get("choices")
    except (ValueError, AttributeError):
        return False
    return isinstance(choices, list) and len(choices) > 0


def fetch_metrics(spec: ServerSpec, timeout_s: float) -> MetricsScrape | str:
    """Scrape the server's Prometheus endpoint; a string says why it failed."""
    path = spec.metrics_endpoint
    if path is None:
        return "no metrics endpoint"
    try:
        with _client(spec, timeout_s) as client:
            response = client.get(spec.url(path))
    except httpx.TimeoutException:
        return f"metrics scrape: no answer from {path} within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        return f"metrics scrape of {path} failed: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"metrics scrape failed: HTTP {response.status_code} from {path}"
    try:
        return parse_metrics(response.text)
    except MetricsParseError as exc:
        return f"metrics scrape failed: {exc}"


# -- the tick ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TickState:
    """What a tick hands to the next one (the last token-counter scrape); JSON for a sensor cursor."""

    throughput: ThroughputBaseline | None = None

    def to_json(self) -> str:
        baseline = self.throughput.to_dict() if self.throughput is not None else None
        return json.dumps({"version": 1, "throughput": baseline}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> TickState:
        """Parse a cursor; an empty or unreadable one starts afresh."""
        if not text:
            return cls()
        try:
            baseline = json.loads(text).get("throughput")
            return cls(ThroughputBaseline.from_dict(baseline) if baseline else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls()


T = TypeVar("T")


class _Background(Generic[T]):
    """Runs a call in a daemon thread so the tick can stop waiting for it at its deadline."""

    def __init__(self, name: str, call: Callable[[], T]) -> None:
        self._call = call
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"health-tick-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._call()
        except BaseException as exc:  # surfaced to the waiting thread by `wait`
            self._error = exc

    def wait(self, deadline: float) -> T:
        """The call's result; raises its exception, or TimeoutError past the deadline."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise TimeoutError
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def run_health_tick(
    host: Host, spec: ServerSpec | None, thresholds: HealthThresholds, state: TickState | None = None
) -> tuple[HealthReport, TickState]:
    """Run every probe once against `host` and `spec`; returns the report and the next state.

    With `spec` None (no server is up yet, e.g. one the pipeline starts itself) only the host's
    checks run: GPUs, disk, memory and progress, the last judged as for an idle server (running
    generations are watched by their checkpoints instead, in the stall sensor).

    Never raises for an unhealthy or unreachable host: such failures are CRITICAL or UNKNOWN
    checks. Returns within `thresholds.tick_timeout_s` (plus a few milliseconds).
    """
    state = state or TickState()
    deadline = time.monotonic() + thresholds.tick_timeout_s
    shell = _Background("shell", lambda: run_shell_probes(host, thresholds))
    generation = (
        _Background("generation", lambda: probe_generation(spec, thresholds.generation_timeout_s))
        if spec is not None
        else None
    )
    metrics = (
        _Background("metrics", lambda: fetch_metrics(spec, thresholds.metrics_timeout_s))
        if spec is not None and spec.metrics_endpoint
        else None
    )

    budget = thresholds.tick_timeout_s
    shell_outcome = _wait(shell, deadline, budget, lambda why: ShellOutcome({}, f"shell probes {why}"))
    scrape = _wait(metrics, deadline, budget, lambda why: f"metrics scrape {why}") if metrics is not None else None

    verdicts: dict[str, Verdict] = {}
    verdicts.update(_shell_verdicts(shell_outcome, spec, thresholds, scrape))
    if generation is not None:
        verdicts["generation"] = _wait(
            generation, deadline, budget, lambda why: Verdict(Status.UNKNOWN, f"generation probe {why}")
        )
    next_state = state
    if scrape is not None and spec is not None:
        verdicts["throughput"], next_state = _throughput(scrape, state, host, spec, thresholds)
    return _report(verdicts, host, thresholds), next_state


def _wait(job: _Background[T], deadline: float, budget_s: float, failed: Callable[[str], T]) -> T:
    """The job's result, or `failed(why)` if it raised or is still running at the deadline."""
    try:
        return job.wait(deadline)
    except TimeoutError:
        return failed(f"did not finish within the tick's {budget_s:g} s")
    except Exception as exc:
        return failed(f"failed: {type(exc).__name__}: {exc}")


def _shell_verdicts(
    outcome: ShellOutcome, spec: ServerSpec | None, thresholds: HealthThresholds, scrape: MetricsScrape | str | None
) -> dict[str, Verdict]:
    sections, missing, timeout = outcome.sections, outcome.failure, thresholds.shell_section_timeout_s
    verdicts: dict[str, Verdict] = {}
    if spec is not None:
        verdicts["server_process"], server_pids = _process_verdict(sections.get("ps"), spec, outcome, timeout)
        ss = sections.get("ss")
        verdicts["port"] = (
            Verdict(Status.UNKNOWN, missing)
            if ss is None
            else _section_failure(ss, "ss", timeout) or evaluate_port(ss.text, spec.port, server_pids)
        )
    verdicts["gpus"] = evaluate_gpu_sections(sections.get("gpu"), sections.get("xid"), thresholds, missing)
    disk, mem = sections.get("disk"), sections.get("mem")
    verdicts["disk"] = (
        Verdict(Status.UNKNOWN, missing) if disk is None else evaluate_disk(disk, thresholds.min_disk_free_gb, timeout)
    )
    verdicts["host_memory"] = (
        Verdict(Status.UNKNOWN, missing) if mem is None else evaluate_memory(mem, thresholds.min_mem_free_gb, timeout)
    )
    if thresholds.log_path is not None or thresholds.artifacts_dir is not None:
        verdicts["progress"] = evaluate_progress(
            sections.get("log"),
            sections.get("outputs"),
            busy=_busy(scrape) if spec is not None else False,
            stall_window_s=thresholds.stall_window_s,
            timeout_s=timeout,
            missing=missing,
        )
    return verdicts


def _process_verdict(
    section: SectionOutput | None, spec: ServerSpec, outcome: ShellOutcome, timeout_s: float
) -> tuple[Verdict, frozenset[int] | None]:
    if section is None:
        return Verdict(Status.UNKNOWN, outcome.failure), None
    failure = _section_failure(section, "ps", timeout_s)
    if failure is not None:
        return failure, None
    try:
        processes = parse_ps(section.text)
    except ValueError as exc:
        return Verdict(Status.UNKNOWN, f"ps output not understood: {exc}"), None
    return evaluate_server_process(processes, spec, exclude=outcome.marker)


def _busy(scrape: MetricsScrape | str | None) -> bool | None:
    if not isinstance(scrape, MetricsScrape) or scrape.running is None:
        return None
    return scrape.running > 0


def _throughput(
    scrape: MetricsScrape | str, state: TickState, host: Host, spec: ServerSpec, thresholds: HealthThresholds
) -> tuple[Verdict, TickState]:
    if isinstance(scrape, str):
        return Verdict(Status.UNKNOWN, scrape), state
    outcome = evaluate_throughput(
        scrape,
        state.throughput,
        server=f"{host.name}:{spec.port}",
        now=time.time(),
        min_interval_s=thresholds.throughput_min_interval_s,
    )
    return outcome.verdict, TickState(throughput=outcome.baseline)


def _report(verdicts: Mapping[str, Verdict], host: Host, thresholds: HealthThresholds) -> HealthReport:
    checks = tuple(
        CheckResult(
            name=name,
            status=verdicts[name].status,
            detail=verdicts[name].detail,
            host=host.name,
            data=verdicts[name].data,
            required=name not in thresholds.optional_checks,
        )
        for name in CHECK_NAMES
        if name in verdicts
    )
    return HealthReport(checks=checks, taken_at=datetime.now(UTC))
