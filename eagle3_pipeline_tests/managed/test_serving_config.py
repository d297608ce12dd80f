"""The `serving:` section: a managed server described once provides its endpoint and the health checks'
server; files without one load as before; contradictions are refused with the settings named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_pipeline.config import ConfigError, PipelineConfig, ServingConfig, load_config
from eagle3_pipeline.managed import managed_server, managed_servers
from eagle3_pipeline_tests.pipeline_files import load_pipeline

PROFILES = sorted((Path(__file__).parents[2] / "eagle3_pipeline" / "profiles").glob("*.yaml"))
# The profiles whose server is the user's (the Kimi profile's is managed: location/test_kimi_profile.py).
UNMANAGED = [p for p in PROFILES if "serving" not in yaml.safe_load(p.read_text())]
KIMI_SERVING = {
    "managed": True,
    "engine": "sglang",
    "python": "/opt/sglang/.venv/bin/python",
    "model": "/models/Kimi-K2.5",
    "tp_size": 8,
    "port": 30000,
    "extra_args": ["--mem-fraction-static", "0.88"],
    "log_dir": "/var/log/sglang",
}
GPU_BOX = {"host": {"kind": "ssh", "hostname": "gpu-box.internal", "username": "eagle3"}, "expected_gpus": 8}


@pytest.mark.parametrize("profile", UNMANAGED, ids=lambda p: p.stem)
def test_shipped_profiles_load_unchanged(profile: Path) -> None:
    """No serving section: unmanaged, and the endpoints and health server are exactly the file's."""
    config = load_config(profile, runtime_checks=False)
    raw = yaml.safe_load(profile.read_text())
    assert config.serving == ServingConfig() and not config.serving.managed
    assert managed_servers(config) == []
    assert config.inference.model_dump(exclude_unset=True).get("endpoints", []) == raw.get("inference", {}).get(
        "endpoints", []
    )
    server = config.health.server
    assert (server.model_dump(exclude_unset=True) if server else None) == raw.get("health", {}).get("server")


def test_a_managed_server_provides_its_endpoint_and_health_server(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, {"serving": KIMI_SERVING, "health": GPU_BOX})
    assert config.inference.kind == "endpoints"
    assert [(e.name, e.base_url, e.model) for e in config.inference.endpoints] == [
        ("managed", "http://gpu-box.internal:30000/v1", None)
    ]
    server = config.health.server
    assert server is not None
    assert (server.kind, server.port, server.tp_size, server.generation_probe, server.log_path) == (
        "sglang",
        30000,
        8,
        "health_generate",
        "/var/log/sglang/managed-30000.log",
    )
    setup = managed_server(config)
    assert setup is not None
    assert (setup.base_url, setup.bind_host, setup.served_name, setup.expected_gpus) == (
        "http://gpu-box.internal:30000/v1",
        "127.0.0.1",
        "target",
        8,
    )
    assert setup.serving.pid_path == "/var/log/sglang/managed-30000.json"


def test_the_filled_in_file_dumps_and_reloads_to_the_same_config(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, {"serving": KIMI_SERVING, "health": GPU_BOX})
    again = PipelineConfig.model_validate(config.model_dump())
    assert (again.serving, again.inference, again.health) == (config.serving, config.inference, config.health)


def test_the_process_pattern_finds_only_this_server(tmp_path: Path) -> None:
    import re

    config = load_pipeline(tmp_path, {"serving": {**KIMI_SERVING, "engine": "vllm", "port": 8001}})
    assert config.health.server is not None
    pattern = re.compile(config.health.server.process_pattern)
    ours = "/venv/bin/python -m vllm.entrypoints.openai.api_server --model /m --host 0.0.0.0 --port 8001 --x"
    assert pattern.search(ours)
    assert not pattern.search(ours.replace("8001", "8000"))
    assert not pattern.search("/venv/bin/python -m sglang.launch_server --port 8001")


def test_listed_endpoints_must_reach_the_managed_server(tmp_path: Path) -> None:
    endpoints = {
        "kind": "endpoints",
        "endpoints": [
            {"name": "gpu_box", "base_url": "http://gpu-box.internal:30000/v1"},
            {"name": "hosted", "base_url": "https://router.example.com/api/v1", "api_key_env": "KEY"},
        ],
    }
    config = load_pipeline(tmp_path, {"serving": KIMI_SERVING, "health": GPU_BOX, "inference": endpoints})
    assert [e.name for e in config.inference.endpoints] == ["gpu_box", "hosted"]
    assert config.health.server is not None and config.health.server.base_url == "http://gpu-box.internal:30000/v1"

    elsewhere = {**endpoints, "endpoints": [{"base_url": "http://other-box:30000/v1"}]}
    with pytest.raises(
        ConfigError,
        match=r"serving: no entry of inference.endpoints reaches the managed server at "
        r"http://gpu-box.internal:30000/v1; add one, set serving.base_url",
    ):
        load_pipeline(tmp_path, {"serving": KIMI_SERVING, "health": GPU_BOX, "inference": elsewhere})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"health": {**GPU_BOX, "server": {"kind": "sglang", "port": 30001, "tp_size": 8}}},
            r"health.server.port: 30001, but the managed server's is 30000 \(from serving\); the health checks must "
            r"watch the managed server: leave health.server out",
        ),
        (
            {"health": {**GPU_BOX, "server": {"kind": "vllm", "port": 30000, "tp_size": 8}}},
            r"health.server.kind: 'vllm', but the managed server's is 'sglang'",
        ),
        (
            {"health": {**GPU_BOX, "server": {"kind": "sglang", "port": 30000, "tp_size": 4}}},
            r"health.server.tp_size: 4, but the managed server's is 8",
        ),
        (
            {"serving": {**KIMI_SERVING, "served_name": "kimi"}},
            r"inference.endpoints: the endpoint at http://gpu-box.internal:30000/v1 requests model 'target', but the "
            r"managed server serves 'kimi'",
        ),
        ({"inference": {"kind": "embedded"}}, r"a managed server \(serving.managed\) needs kind 'endpoints'"),
        (
            {"serving": {k: v for k, v in KIMI_SERVING.items() if k != "model"}},
            r"serving.model: required when serving.managed is true",
        ),
        ({"serving": {**KIMI_SERVING, "env": {"BAD-NAME": "1"}}}, r"serving.env.BAD-NAME"),
        ({"serving": {**KIMI_SERVING, "tool_call_parser": " "}}, r"serving.tool_call_parser: .*expected auto"),
        ({"serving": {**KIMI_SERVING, "engine": "trt"}}, r"serving.engine: Input should be 'sglang' or 'vllm'"),
    ],
)
def test_contradictions_are_refused_with_the_settings_named(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    sections = {"serving": KIMI_SERVING, "health": GPU_BOX, **change}
    with pytest.raises(ConfigError, match=message):
        load_pipeline(tmp_path, sections)


def test_a_matching_health_server_is_kept(tmp_path: Path) -> None:
    server = {"kind": "sglang", "port": 30000, "tp_size": 8, "log_path": "/var/log/sglang/managed-30000.log"}
    config = load_pipeline(tmp_path, {"serving": KIMI_SERVING, "health": {**GPU_BOX, "server": server}})
    assert config.health.server is not None and config.health.server.process_pattern == ""


def test_each_inference_host_gets_its_managed_server(tmp_path: Path) -> None:
    """The top-level serving section is every host's default; a host's own keys override it."""

    def host(name: str, **serving: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": name, "health": {"host": {"kind": "ssh", "hostname": f"{name}.internal"}}}
        return {**entry, "serving": serving} if serving else entry

    inference = {"kind": "endpoints", "hosts": [host("a"), host("b", port=30001, tp_size=4)]}
    config = load_pipeline(tmp_path, {"serving": KIMI_SERVING, "health": GPU_BOX, "inference": inference})
    setups = managed_servers(config)
    assert [(p.name, p.base_url, p.serving.tp_size, p.setting) for p in setups] == [
        ("a", "http://a.internal:30000/v1", 8, "inference.hosts[0] (name 'a').serving"),
        ("b", "http://b.internal:30001/v1", 4, "inference.hosts[1] (name 'b').serving"),
    ]
    b = config.for_host("b")
    assert b.serving.port == 30001 and b.health.server is not None and b.health.server.port == 30001
    assert [e.base_url for e in b.inference.endpoints] == ["http://b.internal:30001/v1"]


def test_one_host_managed_among_unmanaged_ones(tmp_path: Path) -> None:
    inference = {
        "kind": "endpoints",
        "hosts": [
            {"name": "mine", "health": {"host": {"kind": "local"}}, "serving": KIMI_SERVING},
            {"name": "theirs", "endpoints": [{"base_url": "http://theirs:30000/v1"}]},
        ],
    }
    config = load_pipeline(tmp_path, {"inference": inference})
    assert [p.name for p in managed_servers(config)] == ["mine"]
    assert managed_server(config, "theirs") is None
    mine = config.for_host("mine")
    assert [e.base_url for e in mine.inference.endpoints] == ["http://127.0.0.1:30000/v1"]
    assert managed_server(config, "mine") is not None and managed_server(config, "mine").bind_host == "127.0.0.1"  # type: ignore[union-attr]
    assert config.for_host("theirs").health.server is None


def test_the_state_folder_defaults_to_the_artifacts_root_or_the_ssh_users_home(tmp_path: Path) -> None:
    """No `/tmp`: a local server's state is under the artifacts root, an SSH host's under its user's home (each
    inference host its own), and the health checks watch that log."""
    serving = {key: value for key, value in KIMI_SERVING.items() if key != "log_dir"}
    local = load_pipeline(tmp_path, {"serving": serving})
    assert local.serving.log_dir == f"{tmp_path / 'out'}/serving"
    assert (
        local.health.server is not None
        and local.health.server.log_path == f"{tmp_path / 'out'}/serving/managed-30000.log"
    )
    remote = load_pipeline(tmp_path, {"serving": serving, "health": GPU_BOX})
    assert remote.serving.pid_path == "/home/eagle3/.local/state/eagle3_pipeline/serving/managed-30000.json"
    root = {**GPU_BOX, "host": {**GPU_BOX["host"], "username": "root"}}
    assert load_pipeline(tmp_path, {"serving": serving, "health": root}).serving.log_dir == (
        "/root/.local/state/eagle3_pipeline/serving"
    )
    hosts = [
        {"name": "a", "health": {"host": {"kind": "ssh", "hostname": "a.internal", "username": "ann"}}},
        {"name": "b", "health": {"host": {"kind": "local"}}},
    ]
    config = load_pipeline(tmp_path, {"serving": serving, "inference": {"kind": "endpoints", "hosts": hosts}})
    assert [setup.serving.log_dir for setup in managed_servers(config)] == [
        "/home/ann/.local/state/eagle3_pipeline/serving",
        f"{tmp_path / 'out'}/serving",
    ]
