"""`eagle3-pipeline fit`: will this target serve and capture on these GPUs — weights per GPU, KV bytes per token,
KV tokens and the largest batch, for serving and for SGLang's in-process capture, from the model folder's
config.json and safetensors index (headers when the shards are there), no weights loaded."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_fit_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fit = sub.add_parser("fit", help="will a target serve / capture on these GPUs (memory per GPU, KV tokens)")
    fit.add_argument("--model", required=True, help="the model folder: config.json and model.safetensors.index.json")
    fit.add_argument("--engine", choices=("sglang", "vllm"), default="sglang")
    fit.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs)")
    card = fit.add_mutually_exclusive_group(required=True)
    card.add_argument("--gpu", help="the card by name (H100, H200, B200, RTX PRO 6000, …)")
    card.add_argument(
        "--gpu-memory-gb", type=float, help="memory per GPU in GiB, as nvidia-smi's memory.total / 1024 (96 GB: 95.6)"
    )
    fit.add_argument("--mem-fraction", type=float, help="SGLang --mem-fraction-static / vLLM --gpu-memory-utilization")
    fit.add_argument("--kv-dtype", default="auto", help="auto (the model's dtype), bfloat16, fp8_e4m3, fp8_e5m2")
    fit.add_argument("--context-len", type=int, default=4096, help="tokens per request, for the largest batch")
    fit.add_argument("--json", action="store_true", help="print the figures as JSON")
    fit.set_defaults(func=cmd_fit)


def cmd_fit(args: argparse.Namespace) -> int:
    from eagle3_pipeline.fit.checkpoint import CheckpointError, read_config_json, read_weights
    from eagle3_pipeline.fit.engines import (
        CONTEXT_BYTES,
        FitError,
        capture_activation_bytes,
        capture_share,
        serving_fit,
    )
    from eagle3_pipeline.fit.gpus import GIB, gpu_spec, known_gpus

    if args.gpu is not None:
        spec = gpu_spec(args.gpu)
        if spec is None:
            print(
                f"eagle3-pipeline fit: --gpu {args.gpu!r}: unknown card ({known_gpus()}); use --gpu-memory-gb",
                file=sys.stderr,
            )
            return 2
        gpu_bytes, card = spec.memory_bytes, spec.name
    else:
        gpu_bytes, card = int(args.gpu_memory_gb * GIB), f"{args.gpu_memory_gb:g} GiB"
    try:
        folder = Path(args.model)
        raw = read_config_json(folder)
        weights = read_weights(folder, raw)
        serving = serving_fit(
            args.engine, weights, raw, tp=args.tp, gpu_bytes=gpu_bytes, fraction=args.mem_fraction,
            kv_dtype=args.kv_dtype, context_len=args.context_len,
        )  # fmt: skip
        before = gpu_bytes - CONTEXT_BYTES
        capture = {}
        for batch in (16384, 8192, 4096):
            reserve = capture_activation_bytes(raw, args.tp, batch)
            fraction = capture_share(raw, args.tp, batch, before)
            pool = before * fraction - serving.weights
            capture[batch] = (fraction, pool, reserve)
    except (CheckpointError, FitError, KeyError, ValueError) as exc:
        print(f"eagle3-pipeline fit: {exc}", file=sys.stderr)
        return 2
    out = {
        "model": str(folder),
        "gpu": card,
        "weights_basis": weights.basis,
        "quantization": weights.quantization,
        "checkpoint_gib": round(weights.total_bytes / GIB, 2),
        "serving": serving.as_dict(),
        "capture": [
            {
                "batch_tokens": batch,
                "mem_fraction_static": fraction,
                "kv_pool_gib": round(pool / GIB, 2),
                "kv_tokens": int(max(pool, 0) // serving.kv_per_token),
                "reserve_gib": round(reserve / GIB, 2),
                "fits": pool >= batch * serving.kv_per_token,
            }
            for batch, (fraction, pool, reserve) in capture.items()
        ],
        "notes": weights.notes,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if serving.fits else 1
    print(
        f"{folder} on {args.tp} × {card} ({gpu_bytes / GIB:.1f} GiB), {args.engine}: checkpoint "
        f"{weights.total_bytes / GIB:,.1f} GiB ({weights.quantization}; from {weights.basis})"
    )
    print(f"  weights per GPU      {serving.weights / GIB:.2f} GiB")
    print(f"  KV per token per GPU {serving.kv_per_token:,.0f} bytes ({args.kv_dtype})")
    verdict = "fits" if serving.fits else "DOES NOT FIT"
    print(f"  serving ({args.engine} fraction {serving.fraction:g}): {verdict}: {serving.reason()}")
    for row in out["capture"]:
        print(
            f"  capture (SGLang in process) batch_tokens {row['batch_tokens']:,}: mem_fraction_static "
            f"{row['mem_fraction_static']:g}, KV pool {row['kv_pool_gib']:.1f} GiB = {row['kv_tokens']:,} tokens, "
            f"{row['reserve_gib']:.1f} GiB beside it — {'fits' if row['fits'] else 'DOES NOT FIT'}"
        )
    for note in weights.notes:
        print(f"  note: {note}")
    return 0 if serving.fits else 1
