"""State files on a host (pid files, logs, env files of the servers the pipeline starts) kept where no one else
can plant or read them: a folder of the host user's own, created 0700, refused when another user owns it or
group or others can write it; files written under a fresh ``mktemp`` name, then renamed over their path, and
never through a symbolic link. Contents travel on the command's stdin, never on a command line
(``/proc/<pid>/cmdline`` is world-readable), so an env file may carry a secret."""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from eagle3_pipeline.hosts.host import Host, quote_args

TIMEOUT_S = 60.0
# $1 = the folder, $2 = the action (check, write, read), $3 = the file's name in it. Prints `problem <why>`,
# or `ok` (check, write), `none` / `found` then the file (read).
_SCRIPT = r"""umask 077; d=$1; a=$2; f=$3
if [ -L "$d" ]; then echo 'problem is a symbolic link'; exit 0; fi
if [ ! -e "$d" ] && ! e=$(mkdir -p -m 700 -- "$d" 2>&1); then printf 'problem cannot be created (%s)\n' "$e"; exit 0; fi
if [ ! -d "$d" ]; then echo 'problem is not a folder'; exit 0; fi
o=$(stat -c %u -- "$d"); m=$(stat -c %a -- "$d"); u=$(id -u)
if [ "$o" != "$u" ]; then printf 'problem is owned by uid %s, not by this user (uid %s)\n' "$o" "$u"; exit 0; fi
case $m in *[2367]? | *[2367]) printf 'problem is writable by group or others (mode %s)\n' "$m"; exit 0 ;; esac
p="$d/$f"
if [ "$a" != check ] && [ -L "$p" ]; then printf 'problem holds %s as a symbolic link\n' "$f"; exit 0; fi
case $a in
check) echo ok ;;
write)
  if [ -d "$p" ]; then printf 'problem holds %s as a folder\n' "$f"; exit 0; fi
  t=$(mktemp "$d/.$f.XXXXXX") || exit 3
  if cat >"$t" && mv -f -- "$t" "$p"; then echo ok; else rm -f -- "$t"; exit 3; fi ;;
read) if [ -f "$p" ]; then echo found; cat -- "$p"; else echo none; fi ;;
esac
"""


class PrivateStateError(RuntimeError):
    """A state folder or file that another user could plant or read; the message names it and the setting."""


def _state(host: Host, folder: str, action: str, name: str, setting: str, data: bytes = b"") -> str | None:
    """Run the script: the file's text for a ``read`` that found it, else None."""
    result = host.run(quote_args("sh", "-c", _SCRIPT, "sh", folder, action, name), TIMEOUT_S, stdin=data)
    status, _, rest = result.stdout.partition("\n")
    if status.startswith("problem "):
        raise PrivateStateError(
            f"{setting}: the state folder {folder} on {host.name} {status.removeprefix('problem ')}; the pipeline "
            "keeps its pid files, logs and env files only in a folder of its own user's that no one else can write "
            f"(created 0700): fix it (chmod 700 it, remove the link) or set {setting} to another folder"
        )
    if not result.ok or status not in ("ok", "found", "none"):
        why = result.stderr.strip() or result.stdout.strip() or f"exit {result.exit_code}"
        raise PrivateStateError(f"{setting}: cannot {action} {name or 'it'} in {folder} on {host.name}: {why[:300]}")
    return rest if status == "found" else None


def _split(path: str) -> tuple[str, str]:
    folder, _, name = path.rpartition("/")
    return folder or "/", name


def ensure_private_dir(host: Host, folder: str, setting: str) -> None:
    """Create ``folder`` (0700) if it is missing; :class:`PrivateStateError` when it is not private."""
    _state(host, folder, "check", "", setting)


def write_private(host: Host, path: str, data: bytes, setting: str) -> None:
    """Write ``data`` to ``path`` in a private folder (new file, then a rename; never through a link)."""
    folder, name = _split(path)
    _state(host, folder, "write", name, setting, data)


def read_private(host: Host, path: str, setting: str) -> str | None:
    """The text of ``path`` in a private folder, None when there is none; a symbolic link is refused."""
    folder, name = _split(path)
    return _state(host, folder, "read", name, setting)


def env_file(env: Mapping[str, str]) -> bytes:
    """An env file that ``sh`` sources (``. FILE``): one ``export NAME='value'`` a line, each value quoted."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in sorted(env.items())).encode()
