"""A managed server's processes on its host: the pid file's record (:class:`ServerRecord`), what
``/proc`` shows of them (:class:`ProcInfo`, :class:`GroupSnapshot`), who listens on the port, and the
shell scripts that read, launch and signal them, each signal only to a process whose pid and start
time are the recorded ones (never by name)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from eagle3_pipeline.health.script import SectionOutput, section_failure

RECORD_VERSION = 1
PROBE_TIMEOUT_S = 10.0
SS_OWNER = re.compile(r'\("([^"]*)",pid=(\d+)')

# The group probe: the boot id, the leader's /proc stat line and command line (hex, NULs kept), and the
# stat line of every process whose process group or session is the server's. $1 = pid, $2 = pgid.
GROUP_SCRIPT = r"""p=$1; g=$2
printf 'boot %s\n' "$(cat /proc/sys/kernel/random/boot_id)"
if s=$(cat "/proc/$p/stat" 2>/dev/null); then
  printf 'leader %s\n' "$s"
  printf 'cmdline %s\n' "$(od -An -v -tx1 "/proc/$p/cmdline" 2>/dev/null | tr -d ' \n')"
fi
for q in $(ps -eo pid=,pgid=,sid= | awk -v g="$g" '$2 == g || $3 == g {print $1}'); do
  s=$(cat "/proc/$q/stat" 2>/dev/null) && printf 'member %s\n' "$s"
done
exit 0
"""
# Starts argv detached, recorded before it runs: `setsid` makes the launched shell a session (and group)
# leader; that shell writes the pid file itself (its pid, start time and boot id, then the record's other
# fields, as given) and only then execs argv, which keeps the pid and start time: no server can bind its
# port unrecorded, however the connection to the host fares. The record goes through a new file (noclobber:
# never a planted one) renamed over the pid file. This script prints the record once it is written.
# $1 = log, $2 = pid file, $3 = header line, $4 = the record's other JSON members, the rest = the command.
# The folder is private (:mod:`eagle3_pipeline.hosts.private`); a log that is a symbolic link is refused.
LAUNCH_SCRIPT = r"""log=$1; rec=$2; header=$3; body=$4; shift 4
[ ! -L "$log" ] || { printf 'the log %s is a symbolic link: refused\n' "$log" >&2; exit 5; }
printf '%s\n' "$header" >>"$log" || exit 3
rm -f "$rec" "$rec.new"
setsid sh -c '
rec=$1; body=$2; shift 2
s=$(cat /proc/$$/stat) && t=$(printf "%s\n" "${s##*) }" | cut -d" " -f20) \
  && b=$(cat /proc/sys/kernel/random/boot_id) || exit 98
f="{\"pid\": %s, \"pgid\": %s, \"start_ticks\": %s, \"boot_id\": \"%s\", "
f="$f\"members\": [{\"pid\": %s, \"start_ticks\": %s}], %s}\n"
(set -C; printf "$f" $$ $$ "$t" "$b" $$ "$t" "$body" >"$rec.new") && mv -f "$rec.new" "$rec" || exit 99
exec "$@"' sh "$rec" "$body" "$@" >>"$log" 2>&1 </dev/null &
i=0
while [ ! -s "$rec" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
[ -s "$rec" ] || { echo 'the launched shell wrote no record' >&2; exit 4; }
printf 'record %s\n' "$(cat "$rec")"
exit 0
"""
# Wraps the command for the server's shell environment: $1 = how many files follow, each sourced in turn with
# every assignment exported (empty names skipped), the rest = the command, exec'd (same pid).
ENV_WRAPPER = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do if [ -n "$1" ]; then set -a; . "$1" || exit 96; set +a; fi; '
    'shift; n=$((n-1)); done; exec "$@"'
)


def in_shell_environment(command: list[str], login_shell: bool, env_files: Sequence[str | None]) -> list[str]:
    """``command`` run through ``bash -l`` (the login profile, ``serving.login_shell``) or ``sh``, after
    sourcing ``env_files`` in order (``serving.env_file``, then the private file of ``serving.env``)."""
    files = [f or "" for f in env_files]
    shell = ["bash", "-lc"] if login_shell else ["sh", "-c"]
    return [*shell, ENV_WRAPPER, shell[0], str(len(files)), *files, *command]


# Signals the group only while its leader is still the recorded process (start time checked in the same
# shell as the kill). $1 = signal, $2 = pid = pgid, $3 = start time.
GROUP_KILL_SCRIPT = r"""s=$(cat "/proc/$2/stat" 2>/dev/null) || exit 0
t=$(printf '%s\n' "${s##*) }" | cut -d' ' -f20)
[ "$t" = "$3" ] && kill -"$1" -"$2" 2>/dev/null
exit 0
"""
# Signals single processes, each only while its start time is the recorded one. $1 = signal, then pid/ticks pairs.
PIDS_KILL_SCRIPT = r"""sig=$1; shift
while [ $# -ge 2 ]; do
  s=$(cat "/proc/$1/stat" 2>/dev/null) && t=$(printf '%s\n' "${s##*) }" | cut -d' ' -f20) && [ "$t" = "$2" ] \
    && kill -"$sig" "$1" 2>/dev/null
  shift 2
done
exit 0
"""
NVIDIA_SMI = ("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
# The pid file's fields the launched shell writes itself (LAUNCH_SCRIPT); the rest comes from the pipeline.
IDENTITY_FIELDS = ("pid", "pgid", "start_ticks", "boot_id", "members")


@dataclass(frozen=True)
class ProcInfo:
    """One process as ``/proc/<pid>/stat`` shows it."""

    pid: int
    comm: str
    state: str
    pgid: int
    sid: int
    start_ticks: int

    @property
    def live(self) -> bool:
        return self.state not in ("Z", "X")


def parse_stat(line: str) -> ProcInfo:
    """A ``/proc/<pid>/stat`` line (the command name may hold spaces and parentheses)."""
    head, _, rest = line.rpartition(")")
    pid, _, comm = head.partition(" (")
    fields = rest.split()
    return ProcInfo(int(pid), comm, fields[0], int(fields[2]), int(fields[3]), int(fields[19]))


@dataclass(frozen=True)
class ProcessRef:
    """A process of the server: its pid and start time (clock ticks since boot) tell it from a reuse."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class ServerRecord:
    """The pid file: the server the pipeline started, and what identifies its processes."""

    pid: int
    pgid: int
    start_ticks: int
    boot_id: str
    argv: tuple[str, ...]
    env_names: tuple[str, ...]
    engine: str
    port: int
    role: str
    reason: str
    started_at: str
    log_path: str
    cmdline: tuple[str, ...] | None = None  # as /proc/<pid>/cmdline shows it once ready
    members: tuple[ProcessRef, ...] = ()  # the group's processes seen, the leader included
    gpu_baseline: tuple[tuple[int, float], ...] | None = None  # (GPU index, MiB used) before the start
    ready_s: float | None = None  # seconds from the start to ready (what a restart costs), once ready

    def to_json(self) -> str:
        return json.dumps({"version": RECORD_VERSION, **asdict(self)}, sort_keys=True)

    def launch_body(self) -> str:
        """The JSON members the launched shell writes after its own identity (:data:`LAUNCH_SCRIPT`)."""
        data = json.loads(self.to_json())
        return json.dumps({k: v for k, v in data.items() if k not in IDENTITY_FIELDS}, sort_keys=True)[1:-1]

    @classmethod
    def from_json(cls, text: str) -> ServerRecord:
        data = json.loads(text)
        if data.pop("version", None) != RECORD_VERSION:
            raise ValueError(f"expected version {RECORD_VERSION}")
        data["argv"] = tuple(data["argv"])
        data["env_names"] = tuple(data["env_names"])
        data["cmdline"] = tuple(data["cmdline"]) if data.get("cmdline") is not None else None
        data["members"] = tuple(ProcessRef(**m) for m in data.get("members") or ())
        baseline = data.get("gpu_baseline")
        data["gpu_baseline"] = tuple((int(i), float(mib)) for i, mib in baseline) if baseline is not None else None
        return cls(**data)


@dataclass(frozen=True)
class GroupSnapshot:
    """The host's view of a server: the boot id, the leader (if its pid is alive) and the group's processes."""

    boot_id: str
    leader: ProcInfo | None
    leader_cmdline: tuple[str, ...] | None
    group: tuple[ProcInfo, ...]

    def live_group(self) -> list[ProcInfo]:
        return [p for p in self.group if p.live]


@dataclass
class Seen:
    """The server's processes seen during one start or stop (pid → start time)."""

    processes: dict[int, int] = field(default_factory=dict)

    def add(self, infos: Iterable[ProcInfo]) -> None:
        for info in infos:
            self.processes.setdefault(info.pid, info.start_ticks)

    def refs(self) -> tuple[ProcessRef, ...]:
        return tuple(ProcessRef(pid, ticks) for pid, ticks in sorted(self.processes.items()))


def rebooted(record: ServerRecord, snap: GroupSnapshot) -> bool:
    """The host's boot id is not the recorded one: the server, started before the reboot, is gone."""
    return bool(snap.boot_id) and snap.boot_id != record.boot_id


def port_holders(ss_text: str, port: int) -> tuple[tuple[int, str], ...]:
    """Who listens on ``port`` in ``ss -Htlnp`` output: (pid, command name); (0, why) when no owner is visible."""
    holders: dict[int, str] = {}
    for line in ss_text.splitlines():
        columns = line.split()
        if len(columns) < 5 or columns[3].rpartition(":")[2] != str(port):
            continue
        owners = {int(pid): name for name, pid in SS_OWNER.findall(line)}
        holders.update(owners or {0: "an owner not visible to this user"})
    return tuple(sorted(holders.items()))


def port_check(section: SectionOutput | None, port: int, missing: str) -> tuple[tuple[int, str], ...]:
    """The port's holders after a stop; when ss cannot tell, the port counts as held (by an unknown owner)."""
    if section is None or section_failure(section, "ss", PROBE_TIMEOUT_S) is not None:
        return ((0, f"an unknown owner (ss gave no answer: {missing or 'it failed'})"),)
    return port_holders(section.text, port)
