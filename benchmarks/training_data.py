"""Benchmark: ``build_training_data`` against a bare template + tokenize loop, and its peak memory
as the rows grow.

Rows are synthesized from the shipped sample prompts (no downloads): every sample prompt, copied
with a perturbed id, answered by a generated turn made of other samples' text (a quarter of them
cut by ``length``, some conversations multi-turn), stored as contract-C1 responses tables.

Measured in the same run and printed:
  * tokens/s of the whole phase (read, template, mask, tokenize in batches, bucket sort, shard,
    token frequencies) over a bare loop that reads the same tables and runs
    ``tokenizer.apply_chat_template`` + tokenize on each conversation (target ratio ≥ 0.8);
  * peak RSS of the phase, each in a fresh process, at 1× and 4× the rows (target ≤ 1.2×), beside
    the RSS of a process that only loaded the tokenizer.

    .venv/bin/python -m benchmarks.training_data [--rows 4000] [--buffer-rows 1024] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_pipeline.generation.prompts import parse_record
from eagle3_pipeline.records import content_id
from eagle3_pipeline.target.local_model import prepare_local_model

# The tables are written with the tests' copy of contract C1.
from eagle3_pipeline.testing.c1_records import generated, message, response_row, write_responses
from eagle3_pipeline.training_data import build_training_data, load_tokenizer, stored_conversation

REPO = Path(__file__).resolve().parents[1]

SAMPLES = REPO / "eagle3_pipeline" / "samples"
DATASETS = {"chat": "sharegpt", "code": "openai", "math": "sharegpt", "tools": "openai"}
MAX_SEQ_LEN = 8192


def sample_prompts() -> list[tuple[str, list[dict[str, str]], str | None]]:
    out = []
    for name, fmt in DATASETS.items():
        for line in (SAMPLES / f"{name}.jsonl").read_text().splitlines():
            messages, tools = parse_record(json.loads(line), fmt)
            out.append((name, messages, tools))
    return out


def synthesize(rows: int, folder: Path) -> list[Path]:
    """``rows`` C1 responses rows over four tables, replicating the samples with perturbed ids."""
    prompts = sample_prompts()
    texts = [m[-1]["content"] for _, m, _ in prompts]
    tables: dict[str, list[dict[str, Any]]] = {name: [] for name in DATASETS}
    for i in range(rows):
        name, messages, tools = prompts[i % len(prompts)]
        answer = " ".join(texts[(i * 7 + k) % len(texts)] for k in range(4))
        finish = "length" if i % 4 == 0 else "stop"
        stored = [message(m["role"], m["content"]) for m in messages]
        if i % 5 == 0:  # a regenerated earlier turn: two generated turns in one conversation
            stored = [*stored, generated(texts[(i * 3) % len(texts)]), message("user", "Go on, in more detail.")]
        stored.append(generated(answer, finish))
        row_id = content_id([{"role": "copy", "content": str(i)}, *messages], tools)
        tables[name].append(response_row(row_id, f"B_{name}", stored, json.loads(tools) if tools else None))
    return [write_responses(folder / f"{name}.parquet", table) for name, table in tables.items()]


def bare_loop(tokenizer: Any, conversations: list[Any]) -> int:
    tokens = 0
    for conv in conversations:
        text = tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False)
        tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return tokens


def child(mode: str, files: list[Path], model: str, out: Path, buffer_rows: int) -> None:
    """One measurement in this fresh process, printed as JSON. transformers is imported and the
    tokenizer loaded once before the clock starts; both contenders then load it (again), read
    the same tables and render and tokenize every conversation on the clock."""
    tokenizer = load_tokenizer(model)
    if mode == "floor":
        print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return
    if mode == "bare":
        started = time.perf_counter()
        tokenizer = load_tokenizer(model)
        conversations = [
            stored_conversation(row, "render") for path in files for row in pq.read_table(path).to_pylist()
        ]
        tokens = bare_loop(tokenizer, conversations)
        print(json.dumps({"seconds": time.perf_counter() - started, "tokens": tokens}))
        return
    started = time.perf_counter()
    stats = build_training_data(
        files,
        model,
        out,
        seed=1,
        eval_fraction=0.02,
        shard_rows=10_000,
        max_seq_len=MAX_SEQ_LEN,
        buffer_rows=buffer_rows,
    )
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "seconds": seconds,
                "tokens": stats.tokens,
                "rows": stats.train_rows + stats.eval_rows,
                "mismatch": stats.template_mismatch,
                "rss_mb": rss,
            }
        )
    )


def run_child(mode: str, files: list[Path], model: str, out: Path, buffer_rows: int) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.training_data",
        "--child",
        mode,
        "--model",
        model,
        "--out",
        str(out),
        "--buffer-rows",
        str(buffer_rows),
        *map(str, files),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO)
    parsed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def runs(results: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['seconds']:.1f}" for r in results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--buffer-rows", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--child", choices=["floor", "bare", "build"])
    parser.add_argument("--model")
    parser.add_argument("--out", type=Path)
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.files, args.model, args.out, args.buffer_rows)
        return

    model = str(prepare_local_model()[0])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "1x").mkdir()
        (root / "4x").mkdir()
        one = synthesize(args.rows, root / "1x")
        four = synthesize(4 * args.rows, root / "4x")
        floor = run_child("floor", [], model, root / "unused", args.buffer_rows)
        # Alternated and repeated, the fastest of each kept: the machine's other load varies.
        bares, builds = [], []
        for _ in range(args.repeat):
            bares.append(run_child("bare", one, model, root / "unused", args.buffer_rows))
            builds.append(run_child("build", one, model, root / "td1", args.buffer_rows))
        bare, ours = min(bares, key=lambda r: r["seconds"]), min(builds, key=lambda r: r["seconds"])
        ours4 = run_child("build", four, model, root / "td4", args.buffer_rows)

    bare_rate, our_rate = bare["tokens"] / bare["seconds"], ours["tokens"] / ours["seconds"]
    print(
        f"rows: {ours['rows']} at 1x, {ours4['rows']} at 4x (buffer_rows {args.buffer_rows}); "
        f"tokens: {ours['tokens']} at 1x; template mismatches: {ours['mismatch']} / {ours4['mismatch']}"
    )
    print(
        f"bare apply_chat_template + tokenize: {bare_rate:,.0f} tokens/s ({bare['tokens']} tokens, "
        f"{bare['seconds']:.1f} s; runs {runs(bares)} s)"
    )
    print(
        f"build_training_data (whole phase):   {our_rate:,.0f} tokens/s ({ours['seconds']:.1f} s; "
        f"runs {runs(builds)} s)   ratio {our_rate / bare_rate:.2f} (target >= 0.8)"
    )
    print(
        f"build_training_data at 4x rows:      {ours4['tokens'] / ours4['seconds']:,.0f} "
        f"tokens/s ({ours4['seconds']:.1f} s)"
    )
    print(
        f"peak RSS: tokenizer only {floor['rss_mb']:.0f} MB; 1x {ours['rss_mb']:.0f} MB; 4x {ours4['rss_mb']:.0f} MB   "
        f"ratio 4x/1x {ours4['rss_mb'] / ours['rss_mb']:.2f} (target <= 1.2)"
    )


if __name__ == "__main__":
    main()
