"""The launch-line builder: what each purpose adds, from the serving section and the target, never typed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_pipeline.config import load_config
from eagle3_pipeline.drafter.serve.servers import launch_command
from eagle3_pipeline.drafter.serve.sweep import SpeculativeConfig
from eagle3_pipeline.managed import (
    EagleDrafter,
    LaunchError,
    ServerPurpose,
    build_launch,
    launch_for,
    managed_server,
    target_model_types,
)
from eagle3_pipeline.managed.launch import serves
from eagle3_pipeline.target.layer_ids import extraction_layer_ids
from eagle3_pipeline_tests.pipeline_files import load_pipeline

KIMI_PROFILE = Path(__file__).parents[2] / "eagle3_pipeline" / "profiles" / "kimi-k25.yaml"
KIMI_SERVING = {
    "managed": True,
    "engine": "sglang",
    "python": "/opt/sglang/.venv/bin/python",
    "model": "/models/Kimi-K2.5",
    "tp_size": 8,
    "port": 30000,
    "extra_args": ["--mem-fraction-static", "0.88", "--enable-hierarchical-cache"],
    "log_dir": "/var/log/sglang",
}


def kimi_checkpoint(folder: Path) -> Path:
    """A folder with Kimi-K2.5's config.json shape (model_type kimi_k25 over a deepseek_v3 text_config)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 61}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def kimi_profile(tmp_path: Path, **serving: Any) -> Any:
    """The shipped Kimi profile with a managed SGLang TP 8 server (health.server left to the server; a keyed
    one's key variable on the GPU box's endpoint too)."""
    raw = yaml.safe_load(KIMI_PROFILE.read_text())
    raw["target"]["tokenizer"] = str(kimi_checkpoint(tmp_path / "Kimi-K2.5"))
    raw["serving"] = {**KIMI_SERVING, **serving}
    raw["health"].pop("server", None)
    if "api_key_env" in serving:  # the GPU box's endpoint sends the key the server requires
        raw["inference"]["endpoints"][0]["api_key_env"] = serving["api_key_env"]
    path = tmp_path / "kimi.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path, runtime_checks=False)


def test_the_kimi_profile_generation_server(tmp_path: Path) -> None:
    """SGLang TP 8, remote code, Kimi's parsers (tools: B3/B8 carry them), the user's extra args last."""
    config = kimi_profile(tmp_path)
    setup = managed_server(config)
    assert setup is not None
    assert target_model_types(config.target, setup) == ["kimi_k25", "deepseek_v3"]
    launch = launch_for(config.target, setup, ServerPurpose.generation(needs_tools=True))
    assert launch.shell() == (
        "/opt/sglang/.venv/bin/python -m sglang.launch_server --model-path /models/Kimi-K2.5 --host 127.0.0.1 "
        "--port 30000 --tp-size 8 --served-model-name kimi-k2.5 --trust-remote-code --reasoning-parser kimi_k2 "
        "--tool-call-parser kimi_k2 --mem-fraction-static 0.88 --enable-hierarchical-cache"
    )
    without_tools = launch_for(config.target, setup, ServerPurpose.generation(needs_tools=False))
    assert "--tool-call-parser" not in without_tools.argv and "--reasoning-parser" in without_tools.argv


def test_the_kimi_profile_on_vllm_takes_vllms_flags(tmp_path: Path) -> None:
    config = kimi_profile(tmp_path, engine="vllm", python="/opt/vllm/bin/python", extra_args=[])
    setup = managed_server(config)
    assert setup is not None
    launch = launch_for(config.target, setup, ServerPurpose.generation(needs_tools=True))
    assert launch.argv == (
        "/opt/vllm/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/Kimi-K2.5",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--tensor-parallel-size",
        "8",
        "--served-model-name",
        "kimi-k2.5",
        "--trust-remote-code",
        "--reasoning-parser",
        "kimi_k2",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "kimi_k2",
    )


def vllm_smol(tmp_path: Path, **serving: Any) -> Any:
    """A managed vLLM of a Llama-family target (SmolLM2's config.json model_type), on this machine."""
    folder = tmp_path / "smol"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    section = {"managed": True, "engine": "vllm", "python": "/v/bin/python", "model": str(folder), "port": 8000}
    config = load_pipeline(
        tmp_path, {"target": {"model": "smol", "tokenizer": str(folder)}, "serving": {**section, **serving}}
    )
    setup = managed_server(config)
    assert setup is not None
    return config, setup


def test_a_vllm_extraction_server_captures_the_stores_layers(tmp_path: Path) -> None:
    config, setup = vllm_smol(tmp_path, extra_args=["--enforce-eager"])
    layers = extraction_layer_ids("llama", [1, 14, 26], 30)
    assert layers == [2, 15, 27, 30]
    launch = launch_for(config.target, setup, ServerPurpose.extraction_of(layers, "/data/states"))
    argv = list(launch.argv)
    speculative = json.loads(argv[argv.index("--speculative-config") + 1])
    connector = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert speculative == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}},
    }
    assert connector == {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/data/states"},
    }
    assert "--no-enable-chunked-prefill" in argv and "--no-enable-prefix-caching" in argv
    assert "--reasoning-parser" not in argv and "--tool-call-parser" not in argv
    assert argv[-1] == "--enforce-eager"
    assert shlex.split(launch.shell()) == argv


def test_kimis_extraction_layers_follow_the_deepseek_rule() -> None:
    """The same rule as the vLLM state source (VllmTarget.server_layers): inputs of layers id + 1, then N."""
    assert extraction_layer_ids("deepseek", [1, 29, 57], 61) == [2, 30, 58, 61]


def test_sglang_serves_no_extraction(tmp_path: Path) -> None:
    config = kimi_profile(tmp_path)
    setup = managed_server(config)
    assert setup is not None
    with pytest.raises(LaunchError, match=r"serving.engine: hidden states from a server are vLLM's"):
        launch_for(config.target, setup, ServerPurpose.extraction_of([2, 30, 58, 61], "/data/states"))


def test_the_drafter_flags_for_the_benchmark_and_the_served_drafter(tmp_path: Path) -> None:
    config = kimi_profile(tmp_path, extra_args=[])
    setup = managed_server(config)
    assert setup is not None
    drafter = EagleDrafter("/data/drafter", 3)
    served = launch_for(config.target, setup, ServerPurpose.served_drafter(drafter, needs_tools=True))
    assert served.purpose.role == "served-drafter"
    assert served.shell().endswith(
        "--reasoning-parser kimi_k2 --tool-call-parser kimi_k2 --speculative-algorithm EAGLE3 "
        "--speculative-draft-model-path /data/drafter --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4"
    )
    arm = launch_for(config.target, setup, ServerPurpose.benchmark(drafter))
    assert arm.purpose.role == "benchmark-speculative" and "--reasoning-parser" not in arm.argv
    vllm_config, vllm_setup = vllm_smol(tmp_path)
    vllm_arm = launch_for(vllm_config.target, vllm_setup, ServerPurpose.benchmark(drafter))
    assert vllm_arm.argv[-2:] == (
        "--speculative-config",
        '{"method": "eagle3", "model": "/data/drafter", "num_speculative_tokens": 3}',
    )


def test_the_generation_server_serves_the_benchmarks_baseline_arm(tmp_path: Path) -> None:
    """Token-id requests use no chat parser: Kimi's generation line (reasoning and tool-call parsers) serves the
    baseline arm as it is; not the speculative arm, not another memory setting, and not chat without its parsers."""
    config = kimi_profile(tmp_path)
    setup = managed_server(config)
    assert setup is not None
    generation = launch_for(config.target, setup, ServerPurpose.generation(needs_tools=True))
    baseline = launch_for(config.target, setup, ServerPurpose.benchmark(None))
    assert "--tool-call-parser" in generation.argv and "--reasoning-parser" not in baseline.argv
    assert serves(generation.argv, baseline) and serves(baseline.argv, baseline)
    assert serves([*baseline.argv, "--reasoning-parser=kimi_k2", "--enable-auto-tool-choice"], baseline)
    speculative = launch_for(config.target, setup, ServerPurpose.benchmark(EagleDrafter("/data/drafter", 3)))
    assert not serves(generation.argv, speculative)
    assert not serves(baseline.argv, generation), "chat needs its parsers"
    other = managed_server(kimi_profile(tmp_path, extra_args=["--mem-fraction-static", "0.80"]))
    assert other is not None
    assert not serves(launch_for(config.target, other, ServerPurpose.generation(needs_tools=True)).argv, baseline)


def test_the_benchmark_uses_the_same_builder(tmp_path: Path) -> None:
    """drafter_benchmark's default lines are the builder's (bench_servers.py keeps its templates for the user's),
    a tree configuration's flags too."""
    config = kimi_profile(tmp_path)
    setup = managed_server(config)
    assert setup is not None
    from eagle3_pipeline.config import DrafterBenchmarkConfig
    from eagle3_pipeline.managed import EngineSettings

    settings = DrafterBenchmarkConfig(target_model_path="/models/Kimi-K2.5", draft_model_path="/data/d", tp_size=8)
    engine = EngineSettings("sglang", "python", "/models/Kimi-K2.5", settings.port, "127.0.0.1", 8)
    for config in (SpeculativeConfig(settings.steps), SpeculativeConfig(5, 4, 16)):
        drafter = EagleDrafter("/data/d", config.steps, config.topk, config.draft_tokens)
        assert launch_command(settings, config) == build_launch(engine, ServerPurpose.benchmark(drafter)).shell()
    assert "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16" in launch_command(settings, config)
    assert launch_command(settings, None) == build_launch(engine, ServerPurpose.benchmark(None)).shell()


@pytest.mark.parametrize(
    ("parser", "message"),
    [
        (
            "auto",
            r"serving.tool_call_parser: a dataset's prompts carry tools, but none is known for the target's model "
            r"family \(auto\); name the vllm parser",
        ),
        (None, r"serving.tool_call_parser: a dataset's prompts carry tools, but it is null"),
    ],
)
def test_tools_without_a_parser_are_refused(tmp_path: Path, parser: str | None, message: str) -> None:
    config, setup = vllm_smol(tmp_path, tool_call_parser=parser)
    with pytest.raises(LaunchError, match=message):
        launch_for(config.target, setup, ServerPurpose.generation(needs_tools=True))
    assert (
        "--tool-call-parser" not in launch_for(config.target, setup, ServerPurpose.generation(needs_tools=False)).argv
    )


def test_the_users_parsers_win(tmp_path: Path) -> None:
    config, setup = vllm_smol(tmp_path, tool_call_parser="hermes", reasoning_parser="qwen3")
    argv = launch_for(config.target, setup, ServerPurpose.generation(needs_tools=False)).argv
    assert argv[-5:] == ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    kimi = kimi_profile(tmp_path, reasoning_parser=None)
    setup = managed_server(kimi)
    assert setup is not None
    assert "--reasoning-parser" not in launch_for(kimi.target, setup, ServerPurpose.generation(needs_tools=False)).argv


def test_values_are_quoted_and_secrets_stay_out_of_the_display(tmp_path: Path) -> None:
    config, setup = vllm_smol(tmp_path, env={"HF_TOKEN": "hf_secret value"}, extra_args=["--chat-template", "a b;c"])
    launch = launch_for(config.target, setup, ServerPurpose.generation(needs_tools=False))
    assert shlex.split(launch.shell()) == ["env", "HF_TOKEN=hf_secret value", *launch.argv]
    assert "hf_secret" not in launch.display() and launch.display().startswith("HF_TOKEN=… /v/bin/python -m vllm")
    assert launch.shell().endswith("--chat-template 'a b;c'")


def test_the_prompts_say_whether_tools_are_needed(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_pipeline.managed import prompts_need_tools

    plain, with_tools = tmp_path / "B1.parquet", tmp_path / "B3.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "tools": pa.array([None, None], pa.string())}), plain)
    pq.write_table(pa.table({"id": ["c", "d"], "tools": [None, '[{"type": "function"}]']}), with_tools)
    assert not prompts_need_tools([plain])
    assert prompts_need_tools([plain, with_tools])


@pytest.mark.parametrize("keyed", [False, True])
def test_every_kimi_launch_line_is_bound_to_loopback_or_keyed(
    tmp_path: Path, keyed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation, the benchmark's arms, the served drafter: the shipped profile binds the GPU host's 127.0.0.1
    (reached through the tunnel); bound to another interface, it is keyed by a file, the key on no line."""
    monkeypatch.setenv("EAGLE3_KIMI_SERVER_KEY", "sk-kimi-secret-0042")
    exposure = {"bind_host": "0.0.0.0", "api_key_env": "EAGLE3_KIMI_SERVER_KEY"} if keyed else {}
    config = kimi_profile(tmp_path, **exposure)
    setup = managed_server(config)
    assert setup is not None and setup.tunnelled is not keyed
    drafter = EagleDrafter("/data/eagle3/kimi_k25/drafter/export", 3)
    purposes = [
        ServerPurpose.generation(needs_tools=True),
        ServerPurpose.generation(needs_tools=False),
        ServerPurpose.benchmark(None),
        ServerPurpose.benchmark(drafter),
        ServerPurpose.served_drafter(drafter, needs_tools=True),
    ]
    for purpose in purposes:
        launch = launch_for(config.target, setup, purpose)
        host = launch.argv[launch.argv.index("--host") + 1]
        if keyed:
            assert host == "0.0.0.0" and launch.argv[launch.argv.index("--config") + 1] == setup.serving.key_path
        else:
            assert host == "127.0.0.1" and "--config" not in launch.argv
        for shown in (launch.display(), launch.shell(), " ".join(launch.argv)):
            assert "sk-kimi-secret-0042" not in shown and "--api-key" not in shown
