"""A throwaway PostgreSQL cluster (Debian `postgresql`): `initdb` in a temporary folder, the server on
127.0.0.1 at a free port with password authentication, stopped and deleted at the end.

PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` system user (made
by the Debian package) and every server binary runs through `runuser -u postgres`; as anyone else
it runs as the current user.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.testing.process_tools import free_port

SYSTEM_USER = "postgres"


def postgres_bin() -> Path | None:
    """The newest installed server's binaries folder, or None when PostgreSQL is not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def runuser() -> str:
    """util-linux's `runuser`, also when the PATH lacks the sbin folders (as in a minimal CI shell)."""
    for candidate in (shutil.which("runuser"), "/usr/sbin/runuser", "/sbin/runuser"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "runuser (util-linux) is needed to run PostgreSQL as the postgres user when the tests run as root"
    )


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    user: str
    password: str
    db_name: str

    def env(self) -> dict[str, str]:
        """The variables deploy/dagster.yaml reads."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USER": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.db_name,
        }


@contextmanager
def postgres_cluster(bin_dir: Path, db_name: str = "dagster") -> Iterator[Postgres]:
    as_root = os.geteuid() == 0
    prefix = [runuser(), "-u", SYSTEM_USER, "--"] if as_root else []
    # Not under pytest's tmp_path: that folder is private to root and the server must reach its files.
    folder = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    if as_root:
        shutil.chown(folder, SYSTEM_USER)
    data, log = folder / "data", folder / "server.log"
    password = secrets.token_urlsafe(16)
    pwfile = folder / "pwfile"
    pwfile.write_text(password + "\n")
    if as_root:
        shutil.chown(pwfile, SYSTEM_USER)
    user, port = "eagle3", free_port()

    def run(*argv: str) -> None:
        done = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            server_log = log.read_text() if log.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout}{done.stderr}{server_log}")

    started = False
    try:
        run(
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            user,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--no-sync",
        )
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} -c fsync=off -c max_connections=200"
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "120", "start")
        started = True
        run(str(bin_dir / "createdb"), "-h", str(folder), "-p", str(port), "-U", user, db_name)
        yield Postgres(host="127.0.0.1", port=port, user=user, password=password, db_name=db_name)
    finally:
        if started:
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)
