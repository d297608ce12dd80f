"""`LocalHost` and `SshHost` against a real OpenSSH server on loopback (see sshd_fixture)."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from eagle3_pipeline.config import ConfigError, HostConfig, load_config
from eagle3_pipeline.hosts import (
    HostAuthError,
    HostDisconnectedError,
    HostKeyError,
    LocalHost,
    SshHost,
    build_host,
    host_key_fingerprint,
    quote_args,
)
from eagle3_pipeline.testing.process_tools import wait_until
from eagle3_pipeline.testing.sshd_fixture import Sshd, TcpProxy
from eagle3_pipeline_tests.pipeline_files import write_pipeline

HOSTILE = [
    "'; touch {pwned} #",
    '"; touch {pwned}; "',
    "$(touch {pwned})",
    "`touch {pwned}`",
    "a b\tc\nd",
    "-rf",
    "B1\\'; touch {pwned}",
]


def _keygen(path: Path, passphrase: str = "") -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(path)], check=True)
    return path


def _server_fingerprint(sshd: Sshd) -> str:
    _, blob = (sshd.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    return host_key_fingerprint(paramiko.Ed25519Key(data=base64.b64decode(blob)))


def _known_hosts_for(sshd: Sshd, path: Path, port: int) -> Path:
    key_type, blob = (sshd.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    path.write_text(f"[127.0.0.1]:{port} {key_type} {blob}\n")
    return path


def test_command_output_exit_code_and_stderr(ssh_host: SshHost) -> None:
    result = ssh_host.run("echo out; echo err >&2; exit 3", timeout_s=10)
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)


def test_command_killed_by_a_signal_has_no_exit_code_but_is_not_a_drop(ssh_host: SshHost) -> None:
    result = ssh_host.run("echo before; kill -9 $$", timeout_s=10)
    assert (result.exit_code, result.stdout, result.timed_out) == (None, "before\n", False)
    assert ssh_host.run("echo still connected", timeout_s=10).exit_code == 0


def test_ten_megabytes_on_stdout_and_stderr_do_not_deadlock(ssh_host: SshHost) -> None:
    ten_mb = 10 * 1024 * 1024
    command = f"head -c {ten_mb} /dev/zero | tr '\\0' e >&2; head -c {ten_mb} /dev/zero | tr '\\0' o"
    result = ssh_host.run(command, timeout_s=60)
    assert result.exit_code == 0
    assert len(result.stdout) == ten_mb and set(result.stdout) == {"o"}
    assert len(result.stderr) == ten_mb and set(result.stderr) == {"e"}


def test_command_timeout_keeps_the_connection(ssh_host: SshHost, sshd: Sshd) -> None:
    ssh_host.run("true", timeout_s=10)
    connections = sshd.log().count("Connection from")
    result = ssh_host.run("echo started; sleep 5", timeout_s=0.5)
    assert result.timed_out and result.exit_code is None and result.stdout == "started\n"
    assert result.duration_s < 1.5
    assert ssh_host.run("echo again", timeout_s=10).stdout == "again\n"
    assert sshd.log().count("Connection from") == connections


def test_auth_failure_is_fast_and_tried_once(sshd: Sshd, tmp_path: Path) -> None:
    offset = len(sshd.log())
    host = sshd.host(key_file=_keygen(tmp_path / "stranger"))
    started = time.monotonic()
    with pytest.raises(HostAuthError, match=r"authentication failed for .*@127\.0\.0\.1:\d+: key .*stranger refused"):
        host.run("true", timeout_s=10)
    assert time.monotonic() - started < 3
    wait_until(lambda: "Connection closed by authenticating user" in sshd.log()[offset:], 5, "sshd log")
    new_log = sshd.log()[offset:]
    assert new_log.count("Connection from") == 1
    assert new_log.count("Failed publickey") == 1


def test_encrypted_key_errors_never_contain_the_passphrase(sshd: Sshd, tmp_path: Path) -> None:
    key = _keygen(tmp_path / "locked", passphrase="s3cret-passphrase")
    with pytest.raises(HostAuthError, match="encrypted and no passphrase") as no_passphrase:
        sshd.host(key_file=key).run("true", timeout_s=10)
    wrong = sshd.host(key_file=key, passphrase="wr0ng-passphrase")
    with pytest.raises(HostAuthError, match="cannot load private key") as bad_passphrase:
        wrong.run("true", timeout_s=10)
    right = sshd.host(key_file=key, passphrase="s3cret-passphrase")
    with pytest.raises(HostAuthError, match="locked refused") as not_authorized:
        right.run("true", timeout_s=10)
    for text in (str(no_passphrase.value), str(bad_passphrase.value), str(not_authorized.value), repr(wrong)):
        assert "s3cret" not in text and "wr0ng" not in text and "PRIVATE KEY" not in text


@contextlib.contextmanager
def _authorized(sshd: Sshd, key: Path) -> Iterator[None]:
    """`key` may log in for the duration of the block."""
    authorized = sshd.dir / "authorized_keys"
    before = authorized.read_text()
    authorized.write_text(before + key.with_suffix(".pub").read_text())
    try:
        yield
    finally:
        authorized.write_text(before)


def _ssh_config(sshd: Sshd, key: Path, **options: object) -> HostConfig:
    return HostConfig(
        kind="ssh",
        hostname="127.0.0.1",
        port=sshd.port,
        username="root",
        key_file=str(key),
        known_hosts=str(sshd.known_hosts),
        connect_timeout_s=5,
        **options,  # type: ignore[arg-type]
    )


def test_encrypted_key_with_its_passphrase_from_the_environment(
    sshd: Sshd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    key = _keygen(tmp_path / "locked", passphrase="env-s3cret-phrase")
    settings = _ssh_config(sshd, key, key_passphrase_env="E3_TEST_KEY_PASSPHRASE")
    with _authorized(sshd, key):
        monkeypatch.delenv("E3_TEST_KEY_PASSPHRASE", raising=False)
        with build_host(settings) as host, pytest.raises(HostAuthError) as unset:
            host.run("true", timeout_s=10)
        assert (
            str(unset.value)
            == f"private key {key} is encrypted and its passphrase variable E3_TEST_KEY_PASSPHRASE is not set"
        )
        monkeypatch.setenv("E3_TEST_KEY_PASSPHRASE", "env-s3cret-phrase")
        with build_host(settings) as host:
            assert host.run("echo unlocked", timeout_s=10).stdout == "unlocked\n"
            described = repr(host)
    assert "env-s3cret" not in caplog.text + described + sshd.log() + repr(settings)


def test_a_passphrase_variable_needs_a_key_file(tmp_path: Path) -> None:
    host = {"kind": "ssh", "hostname": "gpu-box", "key_passphrase_env": "GPU_BOX_KEY_PASSPHRASE"}
    path = write_pipeline(tmp_path, {"health": {"host": host}}, file_name="p.yaml")
    with pytest.raises(ConfigError, match=r"p\.yaml: health\.host: .*key_passphrase_env needs health\.host\.key_file"):
        load_config(path)


def test_a_key_file_does_not_turn_the_agent_off(sshd: Sshd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's key gets in after the key file's is refused, unless allow_agent is off."""
    socket_path = tmp_path / "agent.sock"
    agent = subprocess.Popen(
        ["ssh-agent", "-D", "-a", str(socket_path)], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_until(socket_path.exists, 10, "ssh-agent")
        monkeypatch.setenv("SSH_AUTH_SOCK", str(socket_path))
        subprocess.run(["ssh-add", "-q", str(sshd.client_key)], check=True, env={**os.environ}, capture_output=True)
        stranger = _keygen(tmp_path / "stranger")
        with build_host(_ssh_config(sshd, stranger)) as host:
            assert host.run("echo via agent", timeout_s=10).stdout == "via agent\n"
        with build_host(_ssh_config(sshd, stranger, allow_agent=False)) as host, pytest.raises(HostAuthError):
            host.run("true", timeout_s=10)
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait()


def test_unknown_host_key_is_refused(sshd: Sshd, tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    with pytest.raises(
        HostKeyError, match=r"unknown host key for \[127\.0\.0\.1\]:\d+ \(ssh-ed25519 SHA256:"
    ) as refused:
        sshd.host(known_hosts=known_hosts).run("true", timeout_s=10)
    assert refused.value.fingerprint == _server_fingerprint(sshd)
    assert refused.value.fingerprint in str(refused.value)
    assert known_hosts.read_text() == ""


def test_trust_on_first_use_records_the_key(sshd: Sshd, tmp_path: Path) -> None:
    known_hosts = tmp_path / "new" / "known_hosts"
    first = sshd.host(known_hosts=known_hosts, trust_on_first_use=True)
    assert first.run("echo hi", timeout_s=10).stdout == "hi\n"
    assert known_hosts.read_text().startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")
    assert sshd.host(known_hosts=known_hosts).run("echo again", timeout_s=10).stdout == "again\n"


def test_changed_host_key_is_refused_even_with_trust_on_first_use(sshd: Sshd, tmp_path: Path) -> None:
    impostor = _keygen(tmp_path / "impostor_host_key")
    key_type, blob = impostor.with_suffix(".pub").read_text().split()[:2]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {key_type} {blob}\n")
    host = sshd.host(known_hosts=known_hosts, trust_on_first_use=True)
    with pytest.raises(HostKeyError, match=r"host key for \[127\.0\.0\.1\]:\d+ changed") as refused:
        host.run("true", timeout_s=10)
    assert refused.value.fingerprint == _server_fingerprint(sshd)
    assert known_hosts.read_text() == f"[127.0.0.1]:{sshd.port} {key_type} {blob}\n"


def test_connection_dropped_mid_command_raises_then_reconnects(sshd: Sshd, tmp_path: Path) -> None:
    proxy = TcpProxy(sshd.port)
    try:
        host = sshd.host(port=proxy.port, known_hosts=_known_hosts_for(sshd, tmp_path / "kh", proxy.port))
        assert host.run("echo up", timeout_s=10).stdout == "up\n"
        threading.Timer(0.5, proxy.cut).start()
        started = time.monotonic()
        with pytest.raises(HostDisconnectedError, match="dropped"):
            host.run("sleep 5", timeout_s=10)
        assert time.monotonic() - started < 3
        assert host.run("echo back", timeout_s=10).stdout == "back\n"
        host.close()
    finally:
        proxy.close()


def test_quoted_hostile_arguments_arrive_verbatim(ssh_host: SshHost, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    for template in HOSTILE:
        value = template.format(pwned=pwned)
        result = ssh_host.run(quote_args("printf", "%s", value), timeout_s=10)
        assert (result.exit_code, result.stdout) == (0, value)
    assert not pwned.exists()


def test_local_host_runs_through_sh() -> None:
    result = LocalHost().run(quote_args("printf", "%s|", "a b", "$(x)") + "; echo oops >&2; exit 4", timeout_s=10)
    assert (result.exit_code, result.stdout, result.stderr) == (4, "a b|$(x)|", "oops\n")


def test_local_host_timeout_kills_the_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    result = LocalHost().run(f"sleep 30 & echo $! > {quote_args(pid_file)}; echo started; sleep 30", timeout_s=0.5)
    assert result.timed_out and result.exit_code is None and result.stdout == "started\n"
    assert result.duration_s < 3
    background = int(pid_file.read_text())
    wait_until(lambda: not _alive(background), 5, "killed background sleep")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
