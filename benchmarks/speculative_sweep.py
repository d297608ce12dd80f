"""Faster or not: the target alone against each speculative configuration on the real vLLM (CPU build), at
several concurrencies, with the pipeline's own benchmark (``drafter_benchmark``'s domain code), and the
configuration it would serve.

The target is the embedded model (SmolLM2-135M-Instruct), the drafter the one the local profile's main job
exported (``<artifacts>/drafter/export``), the prompts its eval split's (``training_data``). Each arm is one
vLLM server start (eager, bf16, 1 GiB KV cache, as the real-vLLM tests run it); every concurrency is measured
on it, the same prompts greedy for every arm. It prints the table (output tokens/s overall and per request,
TTFT, ITL, speedup with its paired-bootstrap 95 % interval, τ from vLLM's counters), the bar chart and the
choice at ``--serve-concurrency``, and writes the whole result as JSON to ``--out``. On a CPU a verify step
may cost more than it saves: the baseline may win, and then the baseline is what would be served.

    EAGLE3_VLLM_PYTHON=.vllm-venv/bin/python nice -n 5 .venv/bin/python -m benchmarks.speculative_sweep \\
        --concurrencies 1,2,4 --sweep-steps 1,2,5 --max-server-starts 5
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import DrafterBenchmarkConfig, load_config, local_profile_path
from eagle3_pipeline.drafter.serve.benchmark import eval_prompts, make_gate, run_benchmark
from eagle3_pipeline.health.gate import thresholds_for
from eagle3_pipeline.hosts import LocalHost
from eagle3_pipeline.inference.embedded import free_port
from eagle3_pipeline.target.local_model import prepare_local_model
from eagle3_pipeline.testing.real_vllm import DEFAULT_ARGS, DEFAULT_ENV, SERVER_MODULE, vllm_python


class Quiet:
    """The benchmark's log lines, each level's tokens/s as it finishes."""

    def log(self, message: str) -> None:
        print(f"  {message}", flush=True)

    def progress(self, metrics: Any) -> None:
        print(f"    {dict(metrics)}", flush=True)


def ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, help="the local profile's artifacts root (default: its own)")
    parser.add_argument("--concurrencies", type=ints, default=[1, 2, 4])
    parser.add_argument("--serve-concurrency", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sweep-steps", type=ints, default=[1, 2, 5])
    parser.add_argument("--max-server-starts", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("speculative_sweep.json"))
    args = parser.parse_args()

    config = load_config(local_profile_path())
    artifacts = args.artifacts or config.artifacts_root
    work = Path(tempfile.mkdtemp(prefix="speculative-sweep-"))
    # A copy: a main job that trains again meanwhile must not change the drafter under the benchmark.
    drafter = shutil.copytree(artifacts / "drafter" / "export", work / "drafter")
    prompts = eval_prompts(artifacts / "training_data", args.prompts)
    model, _ = prepare_local_model()
    env = " ".join(f"{name}={value}" for name, value in DEFAULT_ENV.items())
    line = f"{env} {shlex.quote(str(vllm_python()))} -m {SERVER_MODULE} --model {{target}} --port {{port}}"
    port = free_port()
    settings = DrafterBenchmarkConfig(
        server="vllm",
        target_model_path=str(model),
        draft_model_path=str(drafter),
        port=port,
        steps=args.steps,
        sweep_steps=args.sweep_steps,
        max_server_starts=args.max_server_starts,
        launch_command=f"{line} {shlex.join(DEFAULT_ARGS)} {{speculative}}",
        process_pattern=rf"-m vllm\.entrypoints\.openai\.api_server\s.*--port\s+{port}(\s|$)",
        log_dir=str(work / "logs"),
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        concurrencies=args.concurrencies,
        serve_concurrency=args.serve_concurrency,
        startup_timeout_s=900,
    )
    host = LocalHost()
    gate = make_gate(host, thresholds_for(config.health, config.artifacts_root))
    print(f"{len(prompts)} eval prompts, {args.max_tokens} tokens each, drafter {drafter}, logs {work / 'logs'}")
    result = run_benchmark(
        settings, host, base_url=f"http://127.0.0.1:{port}", prompts=prompts, gate=gate, report=Quiet()
    )
    metadata = result.as_metadata()
    print()
    print(metadata["table"])
    print()
    print(metadata["chart"])
    print(f"\nserved at concurrency {result.serve_concurrency}: {metadata['chosen']} — {result.choice.reason}")
    args.out.write_text(json.dumps(metadata, indent=1, ensure_ascii=False))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
