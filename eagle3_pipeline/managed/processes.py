"""A managed server's processes on its host: the pid file's record (:class:`ServerRecord`), what
``/proc`` shows of them (:class:`ProcInfo`, :class:`GroupSnapshot`), who listens on the port, and the
shell scripts that read, launch and signal them, each signal only to a process whose pid and start
time are the recorded ones (never by name)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
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
# Starts argv detached: `setsid` makes it a session (and group) leader; the shell it runs writes its own
# pid (the same process once it execs argv) to a temporary file, which this script prints with the stat
# line. $1 = log, $2 = pid tmp file, $3 = header line, the rest = the command (env assignments first).
LAUNCH_SCRIPT = r"""log=$1; tmp=$2; header=$3; shift 3
mkdir -p "$(dirname "$log")" || exit 3
printf '%s\n' "$header" >>"$log" || exit 3
rm -f "$tmp"
setsid sh -c 'echo $$ >"$0"; exec "$@"' "$tmp" "$@" >>"$log" 2>&1 </dev/null &
i=0
while [ ! -s "$tmp" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
pid=$(cat "$tmp" 2>/dev/null); rm -f "$tmp"
[ -n "$pid" ] || { echo 'the launched shell wrote no pid' >&2; exit 4; }
printf 'pid %s\n' "$pid"
printf 'boot %s\n' "$(cat /proc/sys/kernel/random/boot_id)"
s=$(cat "/proc/$pid/stat" 2>/dev/null) && printf 'stat %s\n' "$s"
exit 0
"""
# Writes stdin to a new file only its owner reads: an old file (or a link planted there) is removed first, and
# noclobber refuses one that appears meanwhile. $1 = the file.
KEY_SCRIPT = r"""umask 077
mkdir -p "$(dirname "$1")" || exit 3
rm -f "$1" && set -C && cat >"$1"
"""
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

    def to_json(self) -> str:
        return json.dumps({"version": RECORD_VERSION, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServerRecord:
        data = json.loads(text)
        if data.pop("version", None) != RECORD_VERSION:
            raise ValueError(f"expected version {RECORD_VERSION}")
        data["argv"] = tuple(data["argv"])
        data["env_names"] = tuple(data["env_names"])
        data["cmdline"] = tuple(data["cmdline"]) if data.get("cmdline") is not None else None
        data["members"] = tuple(ProcessRef(**m) for m in data.get("members") or ())
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
