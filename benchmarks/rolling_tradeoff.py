"""The rolling-window trade-off (``hidden_states.rolling_window_shards``) for a target at scale:
disk held against extraction repeated, from ``eagle3_pipeline.drafter.train.rolling.tradeoff``.

Defaults are Kimi-K2.5's planner figures: 88K prompts × ~1.25K tokens, 57,349 B/token in bf16
(3 aux layers + teacher at hidden 7168, + 5), ``training_data.eval_fraction`` 0.05, shards of
``hidden_states.shard_tokens`` 32,768, a window of 16 shards, 10 epochs (``drafter.epochs``).
No SGLang TP-8 extraction rate or load time of Kimi-K2.5 has been measured yet, so the extraction
rates are assumptions, given as a range (``--rates``), and so is the time to load the target for
each window's extraction (``--load-s``, default 600 s); at 57,349 B/token, 10K tokens/s is also
~0.57 GB/s written to disk.

    .venv/bin/python -m benchmarks.rolling_tradeoff [--prompts 88000] [--tokens-per-prompt 1250] [--window-shards 16] \
        [--rates 5000,10000,20000,50000] [--load-s 600]
"""

from __future__ import annotations

import argparse

from eagle3_pipeline.drafter.train.rolling import tradeoff

TB, GB, HOUR = 1e12, 1e9, 3600.0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=88_000)
    parser.add_argument("--tokens-per-prompt", type=float, default=1_250)
    parser.add_argument("--bytes-per-token", type=float, default=57_349)
    parser.add_argument("--eval-fraction", type=float, default=0.05)
    parser.add_argument("--shard-tokens", type=int, default=32_768)
    parser.add_argument("--window-shards", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--rates", default="5000,10000,20000,50000", help="assumed extraction tokens/s, comma-separated"
    )
    parser.add_argument(
        "--load-s", type=float, default=600.0, help="assumed seconds to load the target for one extraction"
    )
    args = parser.parse_args()
    tokens = args.prompts * args.tokens_per_prompt
    train, eval_ = tokens * (1 - args.eval_fraction), tokens * args.eval_fraction
    print(
        f"{tokens / 1e6:,.1f}M tokens ({train / 1e6:,.1f}M train, {eval_ / 1e6:,.1f}M eval), "
        f"{args.bytes_per_token:,.0f} B/token, {args.epochs} epochs"
    )
    for rate in (float(r) for r in args.rates.split(",")):
        settings = {
            "bytes_per_token": args.bytes_per_token,
            "shard_tokens": args.shard_tokens,
            "window_shards": args.window_shards,
            "epochs": args.epochs,
            "extract_tokens_per_s": rate,
        }
        bare = tradeoff(train, eval_, **settings)
        f = tradeoff(train, eval_, **settings, target_load_s=args.load_s)
        print(
            f"extraction at {rate:,.0f} tok/s (assumed): whole store {f.store_bytes / TB:.2f} TB on disk, extracted "
            f"once in {f.extract_once_s / HOUR:.1f} h | rolling ({args.window_shards} shards a window): peak "
            f"{f.rolling_peak_bytes / GB:,.0f} GB ({f.rolling_peak_bytes / f.store_bytes:.1%} of the store), "
            f"extraction {bare.rolling_extract_s / HOUR:.1f} h (×{bare.extract_ratio:.2f}), "
            f"{f.rolling_extract_s / HOUR:.1f} h (×{f.extract_ratio:.2f}) with {args.epochs} × {f.windows} + 1 "
            f"target loads of {args.load_s:.0f} s"
        )


if __name__ == "__main__":
    main()
