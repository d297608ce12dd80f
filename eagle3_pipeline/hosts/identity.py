"""A process the pipeline started, known by its pid, its start time (field 22 of ``/proc/<pid>/stat``, clock
ticks since boot) and the host's boot id, so that a pid reused by another process after a reboot or an exit
is never signalled. :data:`RECORD_IDENTITY` is the shell fragment that writes the identity of ``$p`` when a
process starts; :func:`kill_recorded_group` signals its process group only while that identity holds (the
check runs in the same shell as each signal), as :mod:`eagle3_pipeline.managed.processes` does for servers."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_pipeline.hosts.host import Host, quote_args

# Prints "<pid> <start ticks> <boot id>" of the process $p (nothing when it is gone).
RECORD_IDENTITY = (
    's=$(cat "/proc/$p/stat" 2>/dev/null) && printf \'%s %s %s\\n\' "$p" '
    '"$(printf \'%s\\n\' "${s##*) }" | cut -d\' \' -f20)" "$(cat /proc/sys/kernel/random/boot_id)"'
)
# $1 = pid (= pgid), $2 = start ticks, $3 = boot id, $4 = grace in tenths of a second. Prints `refused <why>`
# (nothing signalled), `gone` or `alive`.
_KILL_SCRIPT = r"""p=$1; t=$2; b=$3; n=$4
why() {
  if [ "$(cat /proc/sys/kernel/random/boot_id)" != "$b" ]; then
    echo "the host rebooted since it started (boot id $b)"; return
  fi
  if s=$(cat "/proc/$p/stat" 2>/dev/null); then
    now=$(printf '%s\n' "${s##*) }" | cut -d' ' -f20)
    [ "$now" = "$t" ] || echo "pid $p is another process now (start time $now ticks, recorded $t)"
  fi
}
live() { ps -eo pgid=,stat= | awk -v g="$p" '$1 == g && $2 !~ /^Z/' | grep -q .; }
w=$(why); [ -z "$w" ] || { echo "refused $w"; exit 0; }
live || { echo gone; exit 0; }
kill -TERM -"$p" 2>/dev/null; i=0
while live && [ $i -lt "$n" ]; do sleep 0.1; i=$((i+1)); done
if live; then
  w=$(why); [ -z "$w" ] || { echo "refused $w"; exit 0; }
  kill -KILL -"$p" 2>/dev/null; sleep 0.2
fi
if live; then echo alive; else echo gone; fi
"""


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as it was when it started: pid, start time and the boot it started in."""

    pid: int
    start_ticks: int
    boot_id: str

    @classmethod
    def parse(cls, line: str) -> ProcessIdentity | None:
        """The line :data:`RECORD_IDENTITY` wrote; None when it is not one."""
        parts = line.split()
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return cls(int(parts[0]), int(parts[1]), parts[2])


@dataclass(frozen=True)
class KillOutcome:
    """What :func:`kill_recorded_group` did: ``refused`` says why nothing was signalled (None: it was)."""

    gone: bool
    refused: str | None = None


def kill_recorded_group(host: Host, identity: ProcessIdentity, grace_s: float) -> KillOutcome:
    """SIGTERM the process group of ``identity``, SIGKILL it after ``grace_s``, each only while the leader's pid
    is still that process (or is gone, leaving its group) in the same boot; ``gone`` when no live process of the
    group is left (zombies waiting for their parent do not count)."""
    args = (identity.pid, identity.start_ticks, identity.boot_id, max(1, int(grace_s * 10)))
    result = host.run(quote_args("sh", "-c", _KILL_SCRIPT, "sh", *args), timeout_s=grace_s + 30.0)
    last = result.stdout.strip().splitlines()[-1:] or [""]
    if last[0].startswith("refused "):
        return KillOutcome(False, last[0].removeprefix("refused "))
    return KillOutcome(last[0] == "gone")
