"""The pure parts of health checking: report, settings, nvidia-smi/Xid/Prometheus parsing, the
throughput and progress rules, and the composite probe script run by a real `sh`."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.config import HealthConfig
from eagle3_pipeline.health import CheckResult, HealthReport, ServerSpec, Status, TickState
from eagle3_pipeline.health.checks.generation import CachedVerdict
from eagle3_pipeline.health.checks.gpus import (
    GpuParseError,
    evaluate_gpus,
    parse_gpu_csv,
    parse_remap_csv,
    parse_xid_summary,
)
from eagle3_pipeline.health.checks.progress import evaluate_progress
from eagle3_pipeline.health.checks.server_process import ProcessInfo, evaluate_server_process
from eagle3_pipeline.health.checks.throughput import (
    MetricsScrape,
    ThroughputBaseline,
    ThroughputVerdict,
    evaluate_throughput,
    parse_metrics,
)
from eagle3_pipeline.health.gate import thresholds_for
from eagle3_pipeline.health.script import SectionOutput, build_probe_script, parse_probe_output
from eagle3_pipeline.health.settings import GenerationTarget
from eagle3_pipeline.hosts import LocalHost


def _report(*statuses: Status, required: bool = True) -> HealthReport:
    checks = tuple(CheckResult(f"c{i}", s, f"detail {i}", "h", required=required) for i, s in enumerate(statuses))
    return HealthReport(checks, datetime.now(UTC))


# -- report ------------------------------------------------------------------------------------


def test_status_order_puts_unknown_between_warn_and_critical() -> None:
    assert Status.OK < Status.WARN < Status.UNKNOWN < Status.CRITICAL
    assert max(Status.UNKNOWN, Status.WARN) is Status.UNKNOWN


def test_report_overall_healthy_and_failing() -> None:
    assert _report(Status.OK, Status.WARN).healthy
    unknown = _report(Status.OK, Status.UNKNOWN, Status.WARN)
    assert not unknown.healthy and unknown.overall is Status.UNKNOWN
    mixed = _report(Status.UNKNOWN, Status.CRITICAL, Status.OK)
    assert [c.name for c in mixed.failing()] == ["c1", "c0"]
    assert not _report().healthy and _report().overall is Status.UNKNOWN


def test_optional_checks_never_gate() -> None:
    """`overall` is the gate's verdict (sensor and `status` alike): optional checks do not count."""
    optional_critical = HealthReport(
        (CheckResult("a", Status.OK, "", "h"), CheckResult("b", Status.CRITICAL, "", "h", required=False)),
        datetime.now(UTC),
    )
    assert optional_critical.healthy and optional_critical.overall is Status.OK
    only_optional = _report(Status.OK, required=False)
    assert not only_optional.healthy and only_optional.overall is Status.UNKNOWN  # no evidence at all


def test_report_to_dict_and_summary() -> None:
    report = HealthReport(
        (
            CheckResult("port", Status.CRITICAL, "nothing listening on port 30000", "gpu-box"),
            CheckResult("disk", Status.UNKNOWN, "host down", "gpu-box"),
            CheckResult("gpus", Status.UNKNOWN, "host down", "gpu-box"),
        ),
        datetime(2025, 1, 2, tzinfo=UTC),
    )
    data = report.to_dict()
    assert data["overall"] == "critical" and data["healthy"] is False
    assert data["checks"][0] == {
        "name": "port",
        "status": "critical",
        "detail": "nothing listening on port 30000",
        "host": "gpu-box",
        "required": True,
    }
    assert (
        report.summary() == "unhealthy: port critical: nothing listening on port 30000; disk, gpus unknown: host down"
    )


# -- settings ----------------------------------------------------------------------------------


def server(**fields: Any) -> ServerSpec:
    """An SGLang server on port 30000 of host ``h``, one rank, its kind's own process pattern."""
    return ServerSpec(**{"kind": "sglang", "port": 30000, "base_url": "http://h:30000", "model": "m", "tp_size": 1,
                         "process_pattern": "", **fields})  # fmt: skip


def test_settings_validation() -> None:
    valid = thresholds_for(HealthConfig(), Path("/artifacts"))
    with pytest.raises(ValueError, match="artifacts_dir: expected an absolute path"):
        replace(valid, artifacts_dir="relative/dir")
    with pytest.raises(ValueError, match="process_pattern: required"):
        server(kind="custom")
    with pytest.raises(ValueError, match="optional_checks: unknown"):
        replace(valid, optional_checks=frozenset({"gpu"}))
    spec = server(base_url="http://h:30000/", api_key="sk-secret")
    assert "sk-secret" not in repr(spec) and spec.url("/metrics") == "http://h:30000/metrics"


def test_generation_target_names_its_url_without_credentials() -> None:
    target = GenerationTarget(
        "https://user:pw@router.example:8443/api/v1/?org=1", "m", api_key="sk-abc123", api_key_env="ROUTER_KEY"
    )
    assert target.label == "https://router.example:8443/api/v1" and target.hosted
    assert target.probe_url == "https://router.example:8443/api/v1/chat/completions"
    assert "sk-abc123" not in repr(target) and "pw" not in target.label
    sglang = server(generation_probe="health_generate")
    assert sglang.target().probe_url == "http://h:30000/health_generate" and not sglang.target().hosted


@pytest.mark.parametrize(
    ("kind", "args", "matches"),
    [
        ("sglang", "python -m sglang.launch_server --model-path /m --tp-size 8", True),
        ("sglang", "/opt/venv/bin/python3.11 -u -m sglang.launch_server --port 30000", True),
        ("sglang", "bash -c python -m sglang.launch_server --port 30000", False),
        ("sglang", "bash /opt/health_loop.sh sglang.launch_server", False),
        ("sglang", "tail -f /var/log/sglang/python -m sglang.launch_server.log", False),
        ("sglang", "python -m sglang.launch_server_helper", False),
        ("vllm", "/usr/bin/python3 /usr/local/bin/vllm serve meta/llama --tensor-parallel-size 8", True),
        ("vllm", "python -m vllm.entrypoints.openai.api_server --model m", True),
        ("transformers", "/venv/bin/python /venv/bin/transformers serve --port 8000", True),
    ],
)
def test_default_process_patterns(kind: str, args: str, matches: bool) -> None:
    spec = server(kind=kind)
    assert bool(re.search(spec.command_pattern, args)) is matches


def test_server_process_tree_ranks_and_own_probe_excluded() -> None:
    spec = server(tp_size=2)
    processes = [
        ProcessInfo(10, 1, "python -m sglang.launch_server --tp-size 2"),
        ProcessInfo(11, 10, "sglang::scheduler_TP0"),
        ProcessInfo(12, 10, "sglang::scheduler_DP0_TP1"),
        ProcessInfo(13, 1, "sglang::scheduler_TP5"),  # not ours: another server's rank
        ProcessInfo(20, 1, "sh -c probe abc123"),
        ProcessInfo(21, 20, "timeout 5 sh -c stat sh /var/log/sglang.log"),
    ]
    verdict, tree = evaluate_server_process(processes, spec, exclude="abc123")
    assert (verdict.status, verdict.detail) == (Status.OK, "sglang server pid 10 with 2 of 2 scheduler ranks")
    assert tree == {10, 11, 12}
    verdict, _ = evaluate_server_process(processes[3:], spec, exclude="abc123")
    assert verdict.status is Status.CRITICAL and "other process" not in verdict.detail


# -- nvidia-smi and Xid ------------------------------------------------------------------------


_BUS = "00000000:3B:00.0"


def test_gpu_csv_with_not_available_fields() -> None:
    gpus = parse_gpu_csv(
        f"0, {_BUS}, NVIDIA H100 80GB HBM3, 1, 81559, 0, 31, [N/A], [N/A]\n"
        "1, 00000000:5D:00.0, Tesla T4, 0, 15360, [N/A], 40, 0, No\n"
    )
    assert gpus[0].ecc_uncorrected is None and gpus[0].retired_pages_pending is None
    assert gpus[0].bus_id == "0000:3b:00.0"
    assert gpus[1].utilization_pct is None and gpus[1].retired_pages_pending is False
    remaps = parse_remap_csv(f"{_BUS}, 0, 0, 0, 0\n")
    verdict = evaluate_gpus(gpus, [], expected=2, temp_warn_c=85, temp_critical_c=92, remaps=remaps)
    assert (verdict.status, verdict.detail) == (Status.OK, "2 GPUs OK, max 40 C, mean util 0%")


def test_not_available_retired_pages_alone_are_not_evidence() -> None:
    """An H100 reports retired pages as [N/A]: only its row-remapping state says its memory is fine."""
    gpus = parse_gpu_csv(f"0, {_BUS}, NVIDIA H100, 1, 81559, 0, 31, 0, [N/A]\n")
    blind = evaluate_gpus(gpus, [], expected=1, temp_warn_c=85, temp_critical_c=92, remaps=None, remap_why="exit 2")
    assert (blind.status, blind.detail) == (
        Status.UNKNOWN,
        "GPU 0: neither retired pages nor row remapping readable (exit 2)",
    )
    not_reported = parse_remap_csv(f"{_BUS}, [N/A], [N/A], [N/A], [N/A]\n")
    assert evaluate_gpus(gpus, [], expected=1, temp_warn_c=85, temp_critical_c=92, remaps=not_reported).status is (
        Status.UNKNOWN
    )
    pre_ampere = parse_gpu_csv(f"0, {_BUS}, Tesla V100, 1, 16000, 0, 31, 0, No\n")
    assert evaluate_gpus(pre_ampere, [], expected=1, temp_warn_c=85, temp_critical_c=92, remaps={}).status is Status.OK


@pytest.mark.parametrize(
    ("row", "status", "detail"),
    [
        ("0, 0, 0, 0", Status.OK, "1 GPUs OK, max 31 C, mean util 0%"),
        ("0, 3, No, No", Status.OK, "1 GPUs OK, max 31 C, mean util 0%"),
        ("0, 1, 1, 0", Status.CRITICAL, "GPU 0 has a row remap pending (reset needed)"),
        ("0, 1, Yes, No", Status.CRITICAL, "GPU 0 has a row remap pending (reset needed)"),
        ("0, 9, 0, 1", Status.CRITICAL, "GPU 0 row remapping failed (the GPU needs service)"),
    ],
)
def test_row_remap_rules(row: str, status: Status, detail: str) -> None:
    gpus = parse_gpu_csv(f"0, {_BUS}, NVIDIA H200, 1, 143771, 0, 31, 0, [N/A]\n")
    verdict = evaluate_gpus(
        gpus, [], expected=1, temp_warn_c=85, temp_critical_c=92, remaps=parse_remap_csv(f"{_BUS}, {row}\n")
    )
    assert (verdict.status, verdict.detail) == (status, detail)


def test_unreadable_xid_log_is_unknown_not_none() -> None:
    gpus = parse_gpu_csv(f"0, {_BUS}, Tesla V100, 1, 16000, 0, 31, 0, No\n")
    verdict = evaluate_gpus(gpus, [], expected=1, temp_warn_c=85, temp_critical_c=92, remaps={}, xid_source="none")
    assert (verdict.status, verdict.detail) == (
        Status.UNKNOWN,
        "Xids unknown: no readable kernel log (dmesg, journalctl -k, kern.log)",
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"0, {_BUS}, H100, 1, 81559, 0, 31, 0\n", "expected 9 nvidia-smi fields, got 8"),
        (f"0, {_BUS}, H100, 1, 81559, 0, 31 C, 0, No\n", "unparsable temperature.gpu '31 C' on GPU 0"),
        (f"0, {_BUS}, H100, 1, 81559, 0, 31, 0, Maybe\n", "unparsable retired_pages.pending 'Maybe' on GPU 0"),
        ("", "nvidia-smi printed no GPU rows"),
    ],
)
def test_gpu_csv_format_changes_raise(text: str, message: str) -> None:
    with pytest.raises(GpuParseError, match=re.escape(message)):
        parse_gpu_csv(text)


def test_remap_csv_format_changes_raise() -> None:
    with pytest.raises(GpuParseError, match="expected 5 remapped-rows fields, got 4"):
        parse_remap_csv(f"{_BUS}, 0, 0, 0\n")
    with pytest.raises(GpuParseError, match="unparsable remapped_rows.pending 'Perhaps'"):
        parse_remap_csv(f"{_BUS}, 0, 0, Perhaps, 0\n")


def test_gpu_faults_temperatures_and_retired_pages() -> None:
    gpus = parse_gpu_csv(
        "0, 00000000:18:00.0, H100, 1, 81559, 50, 88, 0, No\n"
        "1, 00000000:28:00.0, H100, 1, 81559, 50, 95, 0, No\n"
        "2, 00000000:38:00.0, H100, 1, 81559, 50, [GPU is lost], 0, Yes\n"
    )
    verdict = evaluate_gpus(gpus, [], expected=3, temp_warn_c=85, temp_critical_c=92)
    assert verdict.status is Status.CRITICAL
    assert verdict.detail == (
        "GPU 1 at 95 C (critical 92 C); GPU 2 reports [GPU is lost] for temperature.gpu; "
        "GPU 2 has retired pages pending (reset needed) (+1 more)"
    )


def test_xid_summary_and_classification() -> None:
    source, xids = parse_xid_summary(
        "source dmesg\n      3 NVRM: Xid (PCI:0000:3b:00): 13\n      1 NVRM: Xid (0000:5d:00): 48\n"
    )
    assert source == "dmesg" and [(x.device, x.code, x.count) for x in xids] == [
        ("0000:3b:00", 13, 3),
        ("0000:5d:00", 48, 1),
    ]
    assert [x.status for x in xids] == [Status.WARN, Status.CRITICAL]
    gpus = parse_gpu_csv(f"0, {_BUS}, H100, 1, 81559, 50, 40, 0, No\n")
    warn_only = evaluate_gpus(gpus, xids[:1], expected=1, temp_warn_c=85, temp_critical_c=92)
    assert (warn_only.status, warn_only.detail) == (Status.WARN, "Xid 13 on 0000:3b:00 (x3)")
    assert parse_xid_summary("source none\n") == ("none", [])
    with pytest.raises(GpuParseError):
        parse_xid_summary("source dmesg\n  2 something else\n")


# -- metrics and throughput --------------------------------------------------------------------

_SGLANG_METRICS = """# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{mode="prefill_compute",model_name="k2"} 9000.0
sglang:realtime_tokens_total{mode="decode",model_name="k2"} 500.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="k2",tp_rank="0"} 300.0
sglang:generation_tokens_total{model_name="k2",tp_rank="1"} 100.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="k2"} 7.0
"""


def test_parse_metrics_prefers_realtime_decode_counter() -> None:
    assert parse_metrics(_SGLANG_METRICS) == MetricsScrape("sglang:realtime_tokens_total", 500.0, 7.0)
    older = "\n".join(line for line in _SGLANG_METRICS.splitlines() if "realtime" not in line)
    assert parse_metrics(older) == MetricsScrape("sglang:generation_tokens_total", 400.0, 7.0)
    vllm = (
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{model_name="m"} 42\n'
        'vllm:num_requests_running{model_name="m"} 0\n'
    )
    assert parse_metrics(vllm) == MetricsScrape("vllm:generation_tokens_total", 42.0, 0.0)
    assert parse_metrics("# nothing here\n") == MetricsScrape(None, None, None)


def _throughput(
    tokens: float,
    running: float | None,
    previous: ThroughputBaseline | None,
    now: float = 130.0,
    min_interval_s: float = 10.0,
) -> ThroughputVerdict:
    scrape = MetricsScrape("sglang:generation_tokens_total", tokens, running)
    return evaluate_throughput(scrape, previous, server="h:30000", now=now, min_interval_s=min_interval_s)


def test_throughput_rules() -> None:
    base = ThroughputBaseline("h:30000", "sglang:generation_tokens_total", 1000.0, 100.0)
    advancing = _throughput(4000.0, 8, base)
    assert (advancing.verdict.status, advancing.verdict.detail) == (
        Status.OK,
        "100 tokens/s over 30.0 s, 8 requests running",
    )
    assert advancing.baseline is not None and advancing.baseline.tokens == 4000.0
    frozen = _throughput(1000.0, 8, base)
    assert frozen.verdict.status is Status.CRITICAL and frozen.baseline == base  # the stall keeps its start
    assert frozen.verdict.detail == "stalled: generated-token counter frozen at 1000 for 30 s with 8 requests running"
    too_soon = _throughput(1000.0, 8, base, now=105.0)
    assert too_soon.verdict.status is Status.WARN and too_soon.baseline == base
    assert _throughput(1000.0, 0, base).verdict.status is Status.OK
    assert _throughput(1000.0, None, base).verdict.status is Status.UNKNOWN
    assert _throughput(10.0, 8, base).verdict.detail.startswith("counter reset (server restarted?)")
    assert _throughput(10.0, 8, None).verdict.status is Status.WARN
    other_server = ThroughputBaseline("elsewhere:1", "sglang:generation_tokens_total", 1000.0, 100.0)
    assert _throughput(1000.0, 8, other_server).verdict.detail.startswith("first scrape")
    missing = evaluate_throughput(MetricsScrape(None, None, 3), base, server="h:30000", now=1.0, min_interval_s=1)
    assert missing.verdict.status is Status.UNKNOWN and missing.baseline == base


def test_tick_state_round_trips_through_json() -> None:
    state = TickState(
        ThroughputBaseline("h:1", "vllm:generation_tokens_total", 12.5, 1700000000.25),
        {"https://api.example/v1": CachedVerdict(Status.OK, "1-token completion in 0.2 s", 1700000000.5)},
    )
    assert TickState.from_json(state.to_json()) == state
    assert TickState.from_json(TickState().to_json()) == TickState()
    for broken in (None, "", "not json", "[]", '{"throughput": {"server": "x"}}'):
        assert TickState.from_json(broken) == TickState()


# -- progress ----------------------------------------------------------------------------------


def test_progress_depends_on_whether_requests_run() -> None:
    log = SectionOutput("log", 0, "1000\n400 77")
    outputs = SectionOutput("outputs", 0, "1000\n12 1073741824 990")
    for busy, status in ((True, Status.CRITICAL), (False, Status.OK), (None, Status.WARN)):
        verdict = evaluate_progress(log, outputs, busy=busy, stall_window_s=300, timeout_s=5, missing="?")
        assert verdict.status is status
        assert "log last written 600 s ago (stall window 300 s)" in verdict.detail
    fresh = evaluate_progress(
        SectionOutput("log", 0, "1000\n990 77"), outputs, busy=True, stall_window_s=300, timeout_s=5, missing="?"
    )
    assert (fresh.status, fresh.detail) == (
        Status.OK,
        "log last written 10 s ago; newest output last written 10 s ago (12 files, 1.0 GiB)",
    )
    gone = evaluate_progress(
        SectionOutput("log", 1, "1000\nstat: cannot statx"),
        None,
        busy=True,
        stall_window_s=300,
        timeout_s=5,
        missing="?",
    )
    assert (gone.status, gone.detail) == (
        Status.CRITICAL,
        "stalled: log missing (stall window 300 s) while requests are running",
    )
    hung = evaluate_progress(
        SectionOutput("log", 124, ""), None, busy=True, stall_window_s=300, timeout_s=5, missing="?"
    )
    assert (hung.status, hung.detail) == (Status.UNKNOWN, "stat of the log timed out after 5 s")


# -- the composite script, run by a real sh ----------------------------------------------------


def test_probe_script_runs_sections_in_parallel_and_reports_each() -> None:
    sections = [
        ("fast", ("printf", "%s\\n", "a'b", "@@not a marker@@")),
        ("slow", ("sleep", "5")),
        ("fails", ("sh", "-c", "echo broken; exit 3")),
        ("missing", ("no-such-command-e3h",)),
    ]
    marker = "0123abcd0123abcd"
    result = LocalHost().run(build_probe_script(sections, marker, section_timeout_s=1), timeout_s=10)
    assert result.duration_s < 3
    parsed = parse_probe_output(result.stdout, marker)
    assert parsed["fast"] == SectionOutput("fast", 0, "a'b\n@@not a marker@@")
    assert parsed["slow"].exit_code == 124
    assert parsed["fails"] == SectionOutput("fails", 3, "broken")
    assert parsed["missing"].exit_code == 127
    assert set(parsed) == {"fast", "slow", "fails", "missing"}
