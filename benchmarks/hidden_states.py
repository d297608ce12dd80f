"""Extraction against a bare transformers loop, memory at 1× and 4× the data, bytes per token.

    .venv/bin/python -m benchmarks.hidden_states [--samples 8] [--min-len 32] [--max-len 96]

Each scale runs in a fresh process on the embedded target (SmolLM2-135M-Instruct, CPU float32):
the `extract` phase over a synthetic training_data folder (seeded random token ids), then, in the
same process and over the same samples, a bare loop (`model.model(input_ids)` one sample at a time
under inference_mode, nothing stored). Printed: tokens/s of both and their ratio (target ≥ 0.8),
peak RSS after extraction at 1× and 4× (target: 4× ≤ 1.2 × 1×), and bytes/token on disk against
(3 aux + teacher) × hidden × 2 + 5 (target: within 5 %).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHARD_TOKENS = 256


class Quiet:
    def log(self, message: str) -> None:
        pass

    def progress(self, metrics: Any) -> None:
        pass


def write_training_data(folder: Path, samples: int, min_len: int, max_len: int) -> Path:
    """One train shard of seeded random token ids (contract C2), half of each sample masked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_pipeline.training_data import SHARD_SCHEMA

    rng = random.Random(7)
    rows = []
    for i in range(samples):
        length = rng.randint(min_len, max_len)
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        rows.append(
            {
                "id": f"s{i:05d}",
                "dataset": "bench",
                "input_ids": [rng.randrange(49152) for _ in range(length)],
                "loss_mask": mask,
                "num_tokens": length,
                "num_masked": sum(mask),
            }
        )
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SHARD_SCHEMA), folder / "train-00000.parquet")
    (folder / "manifest.json").write_text(
        json.dumps({"shards": {"train": ["train-00000.parquet"], "eval": []}, "vocab_size": 49152})
    )
    return folder


def child(samples: int, min_len: int, max_len: int) -> dict[str, Any]:
    import torch

    from eagle3_pipeline.hidden_states.extract import run
    from eagle3_pipeline.hidden_states.store import HiddenStateStore
    from eagle3_pipeline.target.local_model import local_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        data = write_training_data(Path(tmp) / "td", samples, min_len, max_len)
        spec = {
            "training_data": str(data),
            "output": str(Path(tmp) / "hs"),
            "model": str(local_model_dir()),
            "target_name": "SmolLM2-135M-Instruct",
            "device": "cpu",
            "shard_tokens": SHARD_TOKENS,
            "spot_check_samples": 0,
        }
        meta = run(spec, Quiet())
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        sequences = [s.input_ids for s in HiddenStateStore(Path(tmp) / "hs").iter_samples()]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(local_model_dir()), dtype=torch.float32).eval()
    started = time.monotonic()
    with torch.inference_mode():
        for ids in sequences:
            model.model(input_ids=ids[None], use_cache=False)
    bare_s = time.monotonic() - started
    tokens = sum(len(s) for s in sequences)
    return {
        "samples": samples,
        "tokens": meta["tokens"],
        "extract_tokens_per_s": meta["tokens_per_s"],
        "bare_tokens_per_s": round(tokens / bare_s, 1),
        "peak_rss": peak_rss,
        "bytes_per_token": meta["bytes_per_token"],
        "bytes_per_token_formula": meta["bytes_per_token_formula"],
        "shards": meta["shards"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=96)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.samples, args.min_len, args.max_len)))
        return
    results = []
    for scale in (1, 4):
        command = [
            sys.executable,
            "-m",
            "benchmarks.hidden_states",
            "--child",
            "--samples",
            str(args.samples * scale),
            "--min-len",
            str(args.min_len),
            "--max-len",
            str(args.max_len),
        ]
        out = subprocess.run(
            command, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1]
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for scale, r in zip((1, 4), results, strict=True):
        ratio = r["extract_tokens_per_s"] / r["bare_tokens_per_s"]
        print(
            f"{scale}x: {r['samples']} samples, {r['tokens']} tokens, {r['shards']} shards | extraction "
            f"{r['extract_tokens_per_s']:.1f} tok/s, bare loop {r['bare_tokens_per_s']:.1f} tok/s, ratio {ratio:.2f} | "
            f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB | bytes/token {r['bytes_per_token']} vs formula "
            f"{r['bytes_per_token_formula']} ({r['bytes_per_token'] / r['bytes_per_token_formula'] - 1:+.2%})"
        )
    one, four = results
    print(f"peak RSS 4x / 1x = {four['peak_rss'] / one['peak_rss']:.3f} (target ≤ 1.2)")
    print(
        f"tokens/s ratio extraction / bare = {one['extract_tokens_per_s'] / one['bare_tokens_per_s']:.2f} at 1x, "
        f"{four['extract_tokens_per_s'] / four['bare_tokens_per_s']:.2f} at 4x (target ≥ 0.8)"
    )


if __name__ == "__main__":
    main()
