"""Managed-server sections of pipeline files for the managed-server tests (a helper module, not a test): the engine
is the stand-in for SGLang (`fake_sglang.FakeSglang`'s `python -m sglang.launch_server`), started by the
pipeline's own launch line with the module on PYTHONPATH; the GPU host, where one is named, is the loopback sshd."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.testing.fake_sglang import FakeSglang
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline.testing.sshd_fixture import Sshd

# A stand-in for an SGLang that dies during start-up, as one does on a GPU that is already full.
_DYING_SERVER = """import sys, time
print("Loading weights took 0.5 s", flush=True)
time.sleep(0.5)
print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 95.00 GiB total)", file=sys.stderr)
sys.exit(1)
"""


def fake_sglang_serving(folder: Path, tp_size: int = 2, **overrides: Any) -> dict[str, Any]:
    """A managed `serving` section whose engine is the SGLang stand-in."""
    fake = FakeSglang(folder / "engine", tp_size=tp_size)
    section: dict[str, Any] = {
        "managed": True,
        "engine": "sglang",
        "python": sys.executable,
        "model": "/models/target",
        "tp_size": tp_size,
        "port": free_port(),
        "log_dir": str(folder / "logs"),
        "stop_grace_s": 10,
        "gpu_release_timeout_s": 0,
        "env": {
            "PYTHONPATH": str(fake.workdir / "pythonpath"),
            "FAKE_SGLANG_SCENARIO": str(fake.scenario_path),
            "FAKE_SGLANG_READY": str(folder / "engine" / "ready"),
        },
    }
    return {**section, **overrides}


def dying_sglang_serving(folder: Path) -> dict[str, Any]:
    """A managed `serving` section whose engine exits during start-up with a CUDA error in its log."""
    package = folder / "dying" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(_DYING_SERVER)
    return fake_sglang_serving(folder, env={"PYTHONPATH": str(folder / "dying")})


def ssh_health(sshd: Sshd, **overrides: Any) -> dict[str, Any]:
    """The health section of a pipeline whose GPU host is the loopback sshd (the floors: the builder's)."""
    return {
        "host": {
            "kind": "ssh",
            "hostname": "127.0.0.1",
            "port": sshd.port,
            "key_file": str(sshd.client_key),
            "known_hosts": str(sshd.known_hosts),
            "allow_agent": False,
        },
        **overrides,
    }
