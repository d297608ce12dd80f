"""Full health ticks over a real SSH connection (loopback sshd) against real processes.

This machine has no GPU: the `nvidia-smi` and `dmesg` the probes meet on the SSH host's PATH
are scripted stand-ins for the hardware (`sshd_fixture.FakeBin`). The SGLang server is a real
process with the argv `python -m sglang.launch_server --port P --tp-size 8` serving HTTP on
loopback, with real `sglang::scheduler_TP<i>` child processes (`fake_sglang.FakeSglang`).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3_pipeline.config import HealthConfig
from eagle3_pipeline.health import (
    CHECK_NAMES,
    GenerationTarget,
    HealthReport,
    HealthThresholds,
    Status,
    TickState,
    run_health_tick,
)
from eagle3_pipeline.health.checks.gpus import GPU_QUERY_FIELDS
from eagle3_pipeline.health.gate import thresholds_for as file_thresholds
from eagle3_pipeline.hosts import LocalHost, SshHost
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply
from eagle3_pipeline.testing.fake_sglang import FakeSglang, spec_for
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline.testing.sshd_fixture import (
    FakeBin,
    Sshd,
    TcpProxy,
    Watched,
    gpu_row,
    healthy_gpu_rows,
    healthy_remap_rows,
    make_watched,
    remap_row,
    thresholds_for,
)

SHELL_CHECKS = ("server_process", "port", "gpus", "disk", "host_memory", "progress")


def statuses(report: HealthReport) -> dict[str, Status]:
    return {check.name: check.status for check in report.checks}


def two_ticks(host: SshHost | LocalHost, server: FakeSglang, thresholds: HealthThresholds) -> HealthReport:
    """A baseline tick, then the tick under test (its state passed through JSON, as a cursor)."""
    spec = spec_for(server)
    _, state = run_health_tick(host, spec, thresholds)
    report, _ = run_health_tick(host, spec, thresholds, TickState.from_json(state.to_json()))
    return report


def test_healthy_host_all_checks_ok(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin, watched: Watched) -> None:
    sglang.set(running=4)
    pid = sglang.start().pid
    report = two_ticks(ssh_host, sglang, thresholds_for(watched))
    assert statuses(report) == {name: Status.OK for name in CHECK_NAMES}, report.summary()
    assert report.healthy and report.overall is Status.OK and report.failing() == ()
    assert report.check("server_process").detail == f"sglang server pid {pid} with 8 of 8 scheduler ranks"
    assert report.to_dict()["overall"] == "ok"
    hosts = {c["name"]: c["host"] for c in report.to_dict()["checks"]}
    assert hosts.pop("generation") == f"{sglang.base_url}/v1"  # the server asked, not the SSH host
    assert set(hosts.values()) == {ssh_host.name}


def test_healthy_host_over_local_host(sglang: FakeSglang, gpus: FakeBin, watched: Watched) -> None:
    sglang.start()
    host = LocalHost(env={"PATH": f"{gpus.dir}:{os.environ['PATH']}"})
    report = two_ticks(host, sglang, thresholds_for(watched))
    assert report.healthy and report.overall is Status.OK, report.summary()


def test_server_process_down(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    checks = statuses(report)
    assert checks["server_process"] is Status.CRITICAL
    assert report.check("server_process").detail.startswith("no sglang server process")
    assert checks["port"] is Status.CRITICAL and checks["generation"] is Status.CRITICAL
    assert not report.healthy and report.overall is Status.CRITICAL


def test_bash_wrapper_mentioning_sglang_is_not_a_server(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    loop = f"while sleep 0.2; do :; done # python -m sglang.launch_server --port {sglang.port} --tp-size 8"
    wrapper = subprocess.Popen(["bash", "-c", loop])
    try:
        naive = subprocess.run(["pgrep", "-f", "sglang.launch_server"], capture_output=True, text=True, check=False)
        assert str(wrapper.pid) in naive.stdout.split()  # the trap: a naive pgrep is satisfied
        report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    finally:
        wrapper.kill()
        wrapper.wait()
    check = report.check("server_process")
    assert check.status is Status.CRITICAL
    assert "no sglang server process" in check.detail and "mention 'sglang'" in check.detail


def test_seven_of_eight_tp_ranks(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.start(ranks=7)
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    check = report.check("server_process")
    assert (check.status, check.detail) == (Status.CRITICAL, "7 of 8 sglang::scheduler_TP ranks running")


def test_port_closed(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.start(bind=False)
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    assert report.check("server_process").status is Status.OK
    port = report.check("port")
    assert (port.status, port.detail) == (Status.CRITICAL, f"nothing listening on port {sglang.port}")
    generation = report.check("generation")
    assert generation.status is Status.CRITICAL and "connection refused" in generation.detail


def test_port_held_by_another_process(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.start(bind=False)
    with socket.create_server(("127.0.0.1", sglang.port)):
        report, _ = run_health_tick(
            ssh_host, spec_for(sglang), thresholds_for(generation_timeout_s=0.5, metrics_timeout_s=0.5)
        )
    port = report.check("port")
    assert port.status is Status.CRITICAL
    assert (
        port.detail.startswith(f"port {sglang.port} held by pid {os.getpid()} (") and "not by the server" in port.detail
    )


def test_health_ok_while_generation_hangs(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.set(generate="hang")
    sglang.start()
    assert httpx.get(sglang.base_url + "/health", timeout=5).status_code == 200
    started = time.monotonic()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for(generation_timeout_s=1.5))
    assert time.monotonic() - started < 5
    generation = report.check("generation")
    assert generation.status is Status.CRITICAL
    assert generation.detail == f"no answer from {sglang.base_url}/v1/chat/completions within 1.5 s (generation hung?)"
    assert not report.healthy


@pytest.mark.parametrize(("probe", "path"), [("chat", "/v1/chat/completions"), ("health_generate", "/health_generate")])
def test_http_500_is_critical(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin, probe: str, path: str) -> None:
    sglang.set(generate="error")
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang, generation_probe=probe), thresholds_for())
    generation = report.check("generation")
    assert (generation.status, generation.detail) == (Status.CRITICAL, f"HTTP 500 from {sglang.base_url}{path}")


def test_frozen_token_counter_with_running_requests_is_stalled(
    ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin
) -> None:
    gpus.set_gpus([gpu_row(i, util="100") for i in range(8)])  # busy-looking GPUs
    sglang.set(tokens="frozen", running=6)
    sglang.start()
    spec, thresholds = spec_for(sglang), thresholds_for()
    first, state = run_health_tick(ssh_host, spec, thresholds)
    assert first.check("throughput").status is Status.WARN  # a baseline, not yet a verdict
    second, _ = run_health_tick(ssh_host, spec, thresholds, state)
    throughput = second.check("throughput")
    assert throughput.status is Status.CRITICAL
    assert throughput.detail.startswith("stalled: generated-token counter frozen at 1000 for ")
    assert throughput.detail.endswith(" with 6 requests running")
    assert second.check("gpus").status is Status.OK and "mean util 100%" in second.check("gpus").detail


def test_uncorrected_ecc_errors(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    rows = healthy_gpu_rows()
    rows[3] = gpu_row(3, ecc="2")
    gpus.set_gpus(rows)
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    check = report.check("gpus")
    assert (check.status, check.detail) == (Status.CRITICAL, "ECC uncorrected errors on GPU 3: 2")


def test_seven_gpus_where_eight_expected(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    gpus.set_gpus(healthy_gpu_rows(7))
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    check = report.check("gpus")
    assert (check.status, check.detail) == (Status.CRITICAL, "7 GPUs visible, 8 expected")


def test_critical_xid_in_kernel_log(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    gpus.set_dmesg(
        [
            "[ 1234.5] NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics Exception",
            "[ 2345.6] NVRM: Xid (PCI:0000:5d:00): 79, pid=0, GPU has fallen off the bus.",
        ]
    )
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    check = report.check("gpus")
    assert (check.status, check.detail) == (Status.CRITICAL, "Xid 79 on 0000:5d:00 (x1); Xid 13 on 0000:3b:00 (x1)")


def test_renamed_nvidia_smi_field_is_unknown(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    gpus.set_fields([f.replace("retired_pages.pending", "retired_pages.pending_blacklist") for f in GPU_QUERY_FIELDS])
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    check = report.check("gpus")
    assert check.status is Status.UNKNOWN
    assert check.detail == 'nvidia-smi failed (exit 2): Field "retired_pages.pending" is not a valid field to query.'
    assert not report.healthy


def test_nvidia_smi_hang_is_unknown_within_its_timeout(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    gpus.set_mode("hang")
    sglang.start()
    started = time.monotonic()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for(shell_section_timeout_s=1.0))
    assert time.monotonic() - started < 4
    assert report.check("gpus").status is Status.UNKNOWN
    assert report.check("gpus").detail == "nvidia-smi timed out after 1 s"
    assert all(c.status is Status.OK for c in report.checks if c.name != "gpus"), report.summary()


def test_nvidia_smi_wedged_beyond_timeout_is_unknown(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    """A process `timeout` cannot reap (here: its `timeout` is stopped) must not hold up the tick."""
    gpus.set_mode("wedged")
    sglang.start()
    started = time.monotonic()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for(shell_section_timeout_s=1.0))
    assert time.monotonic() - started < 6
    assert (report.check("gpus").status, report.check("gpus").detail) == (
        Status.UNKNOWN,
        "nvidia-smi still hung after 3 s (uninterruptible?)",
    )
    assert report.check("server_process").status is Status.OK


def test_disk_below_floor(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin, watched: Watched) -> None:
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for(watched, min_disk_free_gb=100_000))
    check = report.check("disk")
    assert check.status is Status.CRITICAL
    assert check.detail.endswith("(floor 100000 GiB)") and " GiB free on " in check.detail


@pytest.mark.parametrize(("running", "status"), [(4, Status.CRITICAL), (0, Status.OK)])
def test_log_stalled(
    ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin, watched: Watched, running: int, status: Status
) -> None:
    hour_ago = time.time() - 3600
    os.utime(watched.log_path, (hour_ago, hour_ago))
    sglang.set(running=running)
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for(watched))
    check = report.check("progress")
    assert check.status is status
    assert re.search(r"log last written 360[0-2] s ago \(stall window 60 s\)", check.detail), check.detail
    assert check.detail.startswith("stalled: " if running else "idle: ")


def test_ssh_auth_failure_makes_shell_checks_unknown(sshd: Sshd, sglang: FakeSglang, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    sglang.start()
    started = time.monotonic()
    report, _ = run_health_tick(sshd.host(key_file=stranger), spec_for(sglang), thresholds_for(make_watched(tmp_path)))
    assert time.monotonic() - started < 3
    for name in SHELL_CHECKS:
        assert report.check(name).status is Status.UNKNOWN
        assert "authentication failed" in report.check(name).detail
    assert report.check("generation").status is Status.OK
    assert not report.healthy


def test_connection_dropped_mid_tick_is_unknown(
    sshd: Sshd, sglang: FakeSglang, gpus: FakeBin, watched: Watched, tmp_path: Path
) -> None:
    proxy = TcpProxy(sshd.port)
    try:
        host = sshd.host(port=proxy.port, known_hosts=_known_hosts_via(sshd, proxy, tmp_path))
        sglang.start()
        spec, thresholds = spec_for(sglang), thresholds_for(watched)
        gpus.set_mode("hang")  # keeps the shell round trip busy for the section timeout
        threading.Timer(0.5, proxy.cut).start()
        report, _ = run_health_tick(host, spec, thresholds)
        for name in SHELL_CHECKS:
            assert report.check(name).status is Status.UNKNOWN, report.summary()
            assert "dropped" in report.check(name).detail
        assert report.check("generation").status is Status.OK
        gpus.set_mode("ok")
        recovered, _ = run_health_tick(host, spec, thresholds)
        assert all(recovered.check(name).status is Status.OK for name in SHELL_CHECKS), recovered.summary()
        host.close()
    finally:
        proxy.close()


def test_hostile_dataset_ids_and_paths_are_not_executed(
    ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin, tmp_path: Path
) -> None:
    pwned = tmp_path / "pwned"
    dataset_id = f"B1'; touch {pwned} #"
    artifacts = tmp_path / f"art$(touch {pwned})" / "responses" / dataset_id
    artifacts.mkdir(parents=True)
    (artifacts / "part-0.jsonl").write_text("{}\n")
    log = tmp_path / "logs" / f'`touch {pwned}`"; touch {pwned}; ".log'
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("line\n")
    sglang.start()
    thresholds = thresholds_for(artifacts_dir=str(artifacts), log_path=str(log))
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds)
    assert not pwned.exists()
    assert report.check("progress").status is Status.OK, report.check("progress").detail
    assert report.check("disk").status is Status.OK


def test_cpu_profile_needs_no_gpus(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    gpus.set_mode("hang")  # would time out if it were called
    sglang.start()
    started = time.monotonic()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for(expected_gpus=0))
    assert time.monotonic() - started < 1.5
    assert (report.check("gpus").status, report.check("gpus").detail) == (Status.OK, "no GPUs required")


@pytest.mark.slow
def test_hung_host_tick_returns_within_20_s(sshd: Sshd, sglang: FakeSglang, gpus: FakeBin, tmp_path: Path) -> None:
    """The file's timeouts at 10 s for the generation check and 15 s for the tick; the link freezes (no RST,
    no data) and the server stops answering."""
    proxy = TcpProxy(sshd.port)
    try:
        host = sshd.host(
            port=proxy.port,
            known_hosts=_known_hosts_via(sshd, proxy, tmp_path),
            connect_timeout_s=10.0,
            auth_timeout_s=10.0,
        )
        sglang.start()
        watched = make_watched(tmp_path)
        health = HealthConfig(
            expected_gpus=8, min_disk_free_gb=0.01, min_mem_free_gb=0.01, generation_timeout_s=10, tick_timeout_s=15
        )
        thresholds = replace(file_thresholds(health, watched.artifacts_dir), log_path=str(watched.log_path))
        spec = spec_for(sglang)
        assert host.run("true", timeout_s=10).exit_code == 0  # connected before the host hangs
        proxy.freeze()
        sglang.set(hang_all=True)
        for _ in range(2):  # first on the frozen connection, then on a fresh connection attempt
            started = time.monotonic()
            report, _ = run_health_tick(host, spec, thresholds)
            assert time.monotonic() - started < 20
            assert all(report.check(name).status is Status.UNKNOWN for name in SHELL_CHECKS), report.summary()
            assert report.check("generation").status is Status.CRITICAL
            assert not report.healthy
        host.close()
    finally:
        proxy.close()


def _known_hosts_via(sshd: Sshd, proxy: TcpProxy, tmp_path: Path) -> Path:
    entry = sshd.known_hosts.read_text().replace(f"]:{sshd.port} ", f"]:{proxy.port} ")
    path = tmp_path / "known_hosts_via_proxy"
    path.write_text(entry)
    return path


def test_host_only_tick_without_a_server(tmp_path: Path) -> None:
    """No server to probe is no evidence: UNKNOWN, and optional only when a run will probe it."""
    thresholds = file_thresholds(HealthConfig(expected_gpus=0, min_disk_free_gb=0, min_mem_free_gb=0), tmp_path)
    report, _ = run_health_tick(LocalHost(), None, thresholds)
    assert {c.name for c in report.checks} == {"generation", "gpus", "disk", "host_memory", "progress"}
    assert report.check("generation").status is Status.UNKNOWN and not report.healthy
    deferred, _ = run_health_tick(LocalHost(), None, thresholds, deferred="the run starts it and probes it")
    generation = deferred.check("generation")
    assert (generation.status, generation.required, generation.detail) == (
        Status.UNKNOWN,
        False,
        "the run starts it and probes it",
    )
    assert deferred.healthy, deferred.summary()


# -- GPU rules against the scripted nvidia-smi / dmesg / journalctl (no GPU on this machine) ------


def test_pending_row_remap_is_critical(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    remaps = healthy_remap_rows()
    remaps[2] = remap_row(2, uncorrectable=1, pending="1")
    remaps[5] = remap_row(5, uncorrectable=9, failure="1")
    gpus.set_remaps(remaps)
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    check = report.check("gpus")
    assert (check.status, check.detail) == (
        Status.CRITICAL,
        "GPU 2 has a row remap pending (reset needed); GPU 5 row remapping failed (the GPU needs service)",
    )
    assert check.data["gpus"][2]["remap_pending"] is True and check.data["gpus"][0]["remap_pending"] is False


def test_retired_pages_na_without_remap_query_is_unknown(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    gpus.set_remaps(None)  # a driver without --query-remapped-rows
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    check = report.check("gpus")
    assert check.status is Status.UNKNOWN and not report.healthy
    assert check.detail.startswith("GPU 0, 1, 2, 3, 4, 5, 6, 7: neither retired pages nor row remapping readable (")
    assert "--query-remapped-rows failed (exit 2)" in check.detail


def test_retired_pages_reported_need_no_remap_rows(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    gpus.set_gpus([gpu_row(i, retired="No") for i in range(8)])  # a pre-Ampere GPU retires pages
    gpus.set_remaps([])
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    assert report.check("gpus").status is Status.OK, report.check("gpus").detail


def test_restricted_dmesg_falls_back_to_journalctl(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin) -> None:
    gpus.set_dmesg([], restricted=True)
    gpus.set_journal(
        ["Dec 02 10:00:00 gpu-box kernel: NVRM: Xid (PCI:0000:5d:00): 79, pid=0, GPU has fallen off the bus."]
    )
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for())
    check = report.check("gpus")
    assert (check.status, check.detail) == (Status.CRITICAL, "Xid 79 on 0000:5d:00 (x1)")
    assert check.data["xid_source"] == "journalctl"


def test_unreadable_kernel_log_is_unknown(ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin, tmp_path: Path) -> None:
    gpus.set_dmesg([], restricted=True)  # and journalctl shows this user no kernel message
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for(kernel_log_path=str(tmp_path / "absent")))
    check = report.check("gpus")
    assert (check.status, check.detail) == (
        Status.UNKNOWN,
        "Xids unknown: no readable kernel log (dmesg, journalctl -k, kern.log)",
    )
    assert not report.healthy


def test_kernel_log_file_is_the_last_fallback(
    ssh_host: SshHost, sglang: FakeSglang, gpus: FakeBin, tmp_path: Path
) -> None:
    gpus.set_dmesg([], restricted=True)
    kern_log = tmp_path / "kern.log"
    kern_log.write_text(
        "Dec 1 gpu-box kernel: NVRM: Xid (PCI:0000:3b:00): 79, before the last boot\n"
        "Dec 2 gpu-box kernel: Linux version 6.1.0-18-amd64\n"
        "Dec 2 gpu-box kernel: NVRM: Xid (PCI:0000:3b:00): 13, pid=42, Graphics Exception\n"
    )
    sglang.start()
    report, _ = run_health_tick(ssh_host, spec_for(sglang), thresholds_for(kernel_log_path=str(kern_log)))
    check = report.check("gpus")
    assert (check.status, check.detail, check.data["xid_source"]) == (
        Status.WARN,
        "Xid 13 on 0000:3b:00 (x1)",
        "kern.log",
    )


# -- every server work is sent to is asked, whether or not a server is monitored on the host ---


def _cpu_thresholds(tmp_path: Path, **overrides: Any) -> HealthThresholds:
    """A CPU machine's health section (no GPU, no floors), watching ``tmp_path`` on this host."""
    health = HealthConfig(expected_gpus=0, min_disk_free_gb=0, min_mem_free_gb=0, generation_timeout_s=2, **overrides)
    return file_thresholds(health, tmp_path)


def test_every_endpoint_is_asked_for_a_completion(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    live = GenerationTarget(base_url=fake_openai.base_url, model="fake")
    report, _ = run_health_tick(LocalHost(), None, _cpu_thresholds(tmp_path), targets=[live])
    assert report.healthy and report.check("generation").status is Status.OK, report.summary()
    assert [r["max_tokens"] for r in fake_openai.requests] == [1]
    both, _ = run_health_tick(
        LocalHost(), None, _cpu_thresholds(tmp_path), targets=[live, GenerationTarget(base_url=dead, model="fake")]
    )
    check = both.check("generation")
    assert check.status is Status.CRITICAL and not both.healthy
    assert check.detail == f"connection refused for {dead}/chat/completions (server not listening)"
    assert check.host == f"{fake_openai.base_url}, {dead}"
    assert [e["status"] for e in check.data["endpoints"]] == ["ok", "critical"]


def test_hosted_endpoint_is_asked_once_per_interval_and_its_key_never_shows(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script = lambda body, n: Reply(status=401)
    hosted = GenerationTarget(
        base_url=fake_openai.base_url, model="fake", api_key="sk-live-123456", api_key_env="ROUTER_API_KEY"
    )
    thresholds = _cpu_thresholds(tmp_path, hosted_probe_interval_s=3600)
    first, state = run_health_tick(LocalHost(), None, thresholds, targets=[hosted])
    cursor = state.to_json()
    second, state = run_health_tick(LocalHost(), None, thresholds, TickState.from_json(cursor), targets=[hosted])
    assert len(fake_openai.requests) == 1, "a hosted endpoint is asked at most once per interval"
    assert fake_openai.headers_seen[0]["Authorization"] == "Bearer sk-live-123456"
    check = second.check("generation")
    assert check.status is Status.CRITICAL and check.data["endpoints"][0]["cached"] is True
    assert check.detail.startswith(
        f"HTTP 401 from {fake_openai.base_url}/chat/completions (check the API key) (probed "
    )
    for text in (cursor, state.to_json(), repr(first), repr(second), str(second.to_dict()), repr(hosted)):
        assert "sk-live" not in text
    expired, _ = run_health_tick(
        LocalHost(), None, _cpu_thresholds(tmp_path, hosted_probe_interval_s=0.001), state, targets=[hosted]
    )
    assert len(fake_openai.requests) == 2 and "probed" not in expired.check("generation").detail
    unset = GenerationTarget(base_url=fake_openai.base_url, model="fake", api_key_env="ROUTER_API_KEY")
    missing, _ = run_health_tick(LocalHost(), None, thresholds, targets=[unset])
    assert missing.check("generation").detail == f"{fake_openai.base_url}: API key variable ROUTER_API_KEY is not set"
    assert len(fake_openai.requests) == 2
