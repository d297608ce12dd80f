"""The deploy files and the docs start the code server on a private interface: every documented
`dagster code-server start` binds 127.0.0.1, none binds 0.0.0.0, and the docs say how to reach it and the
webserver safely (SSH port forwarding, a reverse proxy with authentication). That the documented line listens
on loopback only, a real code server shows (test_postgres_daemon.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FILES = [REPO / "deploy" / "workspace.yaml", REPO / "docs" / "scaling.md", REPO / "README.md"]


def _code_server_lines(path: Path) -> list[list[str]]:
    text = path.read_text().replace("\\\n#", "").replace("\\\n", "")
    return [shlex.split(line.lstrip("# ").strip()) for line in text.splitlines() if "code-server start" in line]


def test_every_documented_code_server_binds_loopback() -> None:
    found = {path.name: _code_server_lines(path) for path in FILES}
    assert found["workspace.yaml"] and found["scaling.md"]
    for name, lines in found.items():
        for argv in lines:
            assert argv[argv.index("-h") + 1] == "127.0.0.1", (name, argv)
    assert not [p.name for p in FILES if re.search(r"-h\s+0\.0\.0\.0", p.read_text())]


def test_the_docs_say_how_to_reach_it_safely() -> None:
    for path in FILES[:2]:
        text = " ".join(path.read_text().split())
        assert "ssh -N -L" in text and "never 0.0.0.0" in text.replace("`", ""), path.name
    assert "reverse proxy that authenticates" in " ".join((REPO / "docs" / "scaling.md").read_text().split())
