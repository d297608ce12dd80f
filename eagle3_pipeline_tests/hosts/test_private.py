"""State folders and files on a host kept private (:mod:`eagle3_pipeline.hosts.private`), on this machine and over
the loopback sshd: a folder created 0700, one writable by group or others or owned by another user refused
(naming it and the setting), a planted symbolic link never written through or read, contents sent on stdin."""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

import pytest

from eagle3_pipeline.hosts import Host, LocalHost
from eagle3_pipeline.hosts.private import (
    PrivateStateError,
    ensure_private_dir,
    env_file,
    read_private,
    write_private,
)
from eagle3_pipeline.testing.sshd_fixture import Sshd

SETTING = "serving.log_dir"


@pytest.fixture(params=["local", "ssh"])
def host(request: pytest.FixtureRequest) -> Host:
    if request.param == "local":
        return LocalHost()
    sshd: Sshd = request.getfixturevalue("sshd")
    remote = sshd.host()
    request.addfinalizer(remote.close)
    return remote


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_missing_folder_is_created_0700_with_its_parents(host: Host, tmp_path: Path) -> None:
    folder = tmp_path / "state" / "serving"
    ensure_private_dir(host, str(folder), SETTING)
    assert _mode(folder) == 0o700 and _mode(folder.parent) == 0o700
    write_private(host, str(folder / "managed-30000.json"), b'{"pid": 1}\n', SETTING)
    assert _mode(folder / "managed-30000.json") == 0o600
    assert read_private(host, str(folder / "managed-30000.json"), SETTING) == '{"pid": 1}\n'
    assert read_private(host, str(folder / "managed-30001.json"), SETTING) is None
    assert [p.name for p in folder.iterdir()] == ["managed-30000.json"]  # no temporary file left


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o722])
def test_a_folder_writable_by_group_or_others_is_refused(host: Host, tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(PrivateStateError) as refused:
        write_private(host, str(folder / "managed-30000.json"), b"{}", SETTING)
    message = str(refused.value)
    assert f"{SETTING}: the state folder {folder} on {host.name} is writable by group or others" in message
    assert f"(mode {mode:o})" in message and "chmod 700" in message
    assert list(folder.iterdir()) == []


def test_a_folder_of_another_user_is_refused(host: Host, tmp_path: Path) -> None:
    """The tests run as root: the folder is given to nobody (uid 65534)."""
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(
        PrivateStateError, match=rf"state folder {folder} on .* is owned by uid 65534, not by this user"
    ):
        read_private(host, str(folder / "managed-30000.json"), SETTING)


def test_a_folder_that_is_a_symbolic_link_is_refused(host: Host, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(PrivateStateError, match=r"state folder .*/link on .* is a symbolic link"):
        ensure_private_dir(host, str(tmp_path / "link"), SETTING)


def test_a_planted_symbolic_link_is_never_written_through_nor_read(host: Host, tmp_path: Path) -> None:
    """The attack of the review: `managed-30000.json.tmp` planted as a link made the record write overwrite its
    target; now the temporary name is mktemp's, and a link at the record's own path is refused."""
    folder = tmp_path / "serving"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (folder / "managed-30000.json.tmp").symlink_to(victim)
    write_private(host, str(folder / "managed-30000.json"), b'{"pid": 2}\n', SETTING)
    assert victim.read_text() == "precious\n" and (folder / "managed-30000.json").read_text() == '{"pid": 2}\n'

    (folder / "managed-30001.json").symlink_to(victim)
    with pytest.raises(PrivateStateError, match=r"holds managed-30001.json as a symbolic link"):
        write_private(host, str(folder / "managed-30001.json"), b'{"pid": 3}\n', SETTING)
    with pytest.raises(PrivateStateError, match=r"holds managed-30001.json as a symbolic link"):
        read_private(host, str(folder / "managed-30001.json"), SETTING)
    assert victim.read_text() == "precious\n"


def test_an_env_file_sourced_by_sh_gives_the_values_back(host: Host, tmp_path: Path) -> None:
    hostile = {"TOKEN": "s3cret 'quoted' $(touch pwned) `x`\nline", "PLAIN": "v"}
    path = tmp_path / "serving" / "managed-8000.env"
    write_private(host, str(path), env_file(hostile), SETTING)
    assert _mode(path) == 0o600
    result = host.run(f'. {shlex.quote(str(path))} && printf \'%s|%s\' "$TOKEN" "$PLAIN"', 30.0)
    assert result.ok and result.stdout == f"{hostile['TOKEN']}|v"
    assert not (tmp_path / "pwned").exists()
