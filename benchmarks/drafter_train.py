"""Training throughput of the drafter: our training loop against a bare PyTorch loop.

Both train the same model (same seed, same config) on the same batches for the same number of
steps in this process, alternately (``--rounds``: bare, ours, bare, ours, ...; the best rate of
each is compared, as load from other processes on a shared machine slows whichever runs then).
Ours is ``eagle3_pipeline.drafter.train.phase.run``: it reads each batch from the hidden-state store,
logs metrics, and checkpoints at the end (checkpoint time excluded; it is printed apart). The
bare loop has every batch in memory already and does only teacher + TTT forward + loss + backward
+ clip + AdamW step. Prints tokens/s of both and the ratio (goal: >= 0.8).
Our loop's loss, accuracy and token sums stay on the device and are synced every ``log_every``
steps (here 5).

The store comes from the embedded model's hidden states over the shipped prompts (built once into
--work, reused on later runs).

    .venv/bin/python -m benchmarks.drafter_train [--samples 200] [--steps 12] [--rounds 2] [--work DIR]

``--memory``: peak memory and time of one training step (teacher, ``ttt_loss`` forward and backward,
7 TTT steps, one sequence of T tokens, random data whose target argmax always falls in the draft
vocabulary so every position counts) for the full-score pass of before (``old``,
``eagle3_pipeline.testing.drafter_reference``), the blockwise pass (``new``) and
the blockwise pass with ``drafter.activation_checkpointing`` (``new+ckpt``), each configuration in a
fresh subprocess. CPU: peak = the subprocess's RSS high-water (glibc's mmap threshold pinned at 1 MiB
so freed tensors leave RSS), step memory = peak − RSS before the batch exists; CUDA:
``torch.cuda.max_memory_allocated``. A configuration whose memory, extrapolated from the same pass
at the shorter lengths of this run (old: ∝ T², new: ∝ T), exceeds ``--limit-gib`` is not run (a
watchdog also kills one that gets there). Shapes: ``embedded`` (the embedded model's draft) and
``kimi-like`` (Kimi's draft default at 1/8 width: hidden 896 = 7 heads × 128, 1 KV head,
intermediate 5120, draft vocabulary 32000, Kimi's 163840 vocabulary and YaRN), and ``kimi-like-16k``
(the same with a 16000-token draft vocabulary: it checks the modelled draft-vocabulary part of the
memory). From the fitted per-token (and, old pass, per-T²) step memory of kimi-like it predicts the
longest sequence one 96 GB GPU trains for the full Kimi draft (see ``_kimi_prediction``).

    .venv/bin/python -m benchmarks.drafter_train --memory [--lengths 512,2048,4096,8192,16384] \
        [--old-lengths ...] [--dtype bfloat16] [--limit-gib 10]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eagle3_pipeline.drafter.model.attention import ATTENTION_BLOCK
from eagle3_pipeline.drafter.model.draft_config import DrafterConfig, drafter_config
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.drafter.train.backend import ADAM_BETAS
from eagle3_pipeline.drafter.train.data import (
    TEACHER_CHUNK_TOKENS,
    Batch,
    BatchReader,
    epoch_batches,
    store_rows,
    teacher,
)
from eagle3_pipeline.drafter.train.loss import ttt_loss
from eagle3_pipeline.drafter.train.phase import build_model, run
from eagle3_pipeline.hidden_states.store import HiddenStateStore, default_aux_layer_ids, load_draft_vocab
from eagle3_pipeline.target.local_model import local_model_dir
from eagle3_pipeline.target.weights import load_target_weights
from eagle3_pipeline.testing.drafter_reference import KIMI_AUX, kimi_k25_text_config, reference_ttt_loss
from eagle3_pipeline.testing.tiny_store import real_store
from eagle3_pipeline.testing.train_settings import train_settings


class Quiet:
    def log(self, message: str) -> None:
        print(f"  [ours] {message}")

    def progress(self, metrics: Any) -> None:
        return None


def bare_loop(store: Path, vocab: Path, target_dir: Path, settings: dict[str, Any], steps: int) -> tuple[int, float]:
    d2t, t2d, _ = load_draft_vocab(vocab)
    target = load_target_weights(target_dir)
    manifest = HiddenStateStore(store).manifest()
    model = build_model(
        drafter_config(target.config, int(d2t.shape[0]), manifest.aux_layer_ids, {}), target, d2t, t2d, settings["seed"]
    )
    order = epoch_batches(
        store_rows(HiddenStateStore(store), "train"),
        settings["seed"],
        0,
        settings["batch_tokens"],
        settings["max_seq_len"],
    )
    reader = BatchReader(store, settings["max_seq_len"])
    batches = [reader.read(rows) for rows in order[:steps]]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings["lr"], betas=ADAM_BETAS)
    lm_head = target.lm_head.float()
    tokens = 0
    started = time.monotonic()
    for batch in batches:
        target_signal = teacher(batch.hidden, lm_head, model.t2d, F.pad(batch.loss_mask[:, 1:], (0, 1)))
        masks = [
            F.pad(batch.loss_mask[:, j + 2 :], (0, j + 2)).float()
            * model.t2d[F.pad(target_signal.argmax[:, j + 1 :], (0, j + 1))].float()
            for j in range(settings["ttt_steps"])
        ]
        keep = [mask.bool() for mask in masks]
        logits = model.ttt_forward(batch.aux, batch.input_ids, settings["ttt_steps"], batch.attention_mask, keep)
        loss = torch.zeros(())
        for j, step_logits in enumerate(logits):
            probs = F.pad(target_signal.probs[:, j + 1 :], (0, 0, 0, j + 1))[keep[j]]
            ce = -(probs * torch.log_softmax(step_logits, -1)).sum()
            loss = loss + 0.8**j * ce / masks[j].sum().clamp(min=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings["grad_clip"])
        optimizer.step()
        tokens += batch.tokens
    return tokens, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--rounds", type=int, default=2, help="bare then ours, this many times; the best rate of each is compared"
    )
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-drafter-bench")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="peak memory and step time of the old and new TTT pass (see the module docstring)",
    )
    parser.add_argument(
        "--lengths", default="512,2048,4096,8192,16384", help="--memory: sequence lengths T of the new passes"
    )
    parser.add_argument(
        "--old-lengths",
        default="512,1024,1536,2048,3072,4096,8192",
        help="--memory: sequence lengths T of the old pass (its T² fit wants short steps)",
    )
    parser.add_argument(
        "--vocab-lengths",
        default="512,1024,2048",
        help="--memory: sequence lengths of kimi-like-16k, every pass (the draft-vocabulary slope)",
    )
    parser.add_argument(
        "--shapes", default="embedded,kimi-like,kimi-like-16k", help=f"--memory: among {', '.join(MEMORY_SHAPES)}"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(AUTOCAST),
        default="bfloat16",
        help="--memory: autocast dtype of the step (bfloat16 as training on a GPU)",
    )
    parser.add_argument(
        "--limit-gib", type=float, default=10.0, help="--memory: skip (and kill) a configuration past this peak"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="--memory: timed steps after one warm-up step; the fastest is reported"
    )
    parser.add_argument(
        "--ttt-steps", type=int, default=MEMORY_TTT_STEPS, help="--memory: TTT steps of the pass (the fit's: 7)"
    )
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(MemoryJob(**json.loads(args.memory_child)))
        return
    if args.memory:
        memory_main(args)
        return
    store, vocab, target_dir = args.work / "store", args.work / "vocab", local_model_dir()
    if not (store / "manifest.json").is_file():
        started = time.monotonic()
        real_store(store, vocab, model_dir=target_dir, samples=args.samples, draft_vocab_size=args.draft_vocab)
        print(f"built a store of {args.samples} samples from the embedded model in {time.monotonic() - started:.1f} s")
    settings = train_settings(ttt_steps=7, lr=1e-3, batch_tokens=args.batch_tokens, max_seq_len=256, grad_clip=0.5,
                              seed=0, epochs=1, max_steps=args.steps, checkpoint_every=10**9, log_every=5,
                              eval_samples=8)  # fmt: skip
    load_before = os.getloadavg()[0]
    bare_rates, our_rates = [], []
    for round_number in range(1, args.rounds + 1):  # alternate the loops: load from other processes hits both alike
        bare_tokens, bare_s = bare_loop(store, vocab, target_dir, settings, args.steps)
        run_dir = Path(tempfile.mkdtemp(prefix="drafter-bench-run-"))
        spec = {"store": str(store), "draft_vocab": str(vocab), "target_weights": str(target_dir),
                "run_dir": str(run_dir / "run"), "export_dir": str(run_dir / "export"),
                "settings": settings}  # fmt: skip
        ours = run(spec, Quiet())
        assert ours["trained_tokens_this_run"] == bare_tokens, "the loops trained on different tokens"
        bare_rates.append(bare_tokens / bare_s)
        our_rates.append(ours["tokens_per_s"])
        print(f"round {round_number}: {ours['steps']} steps, {bare_tokens} tokens; bare {bare_rates[-1]:.1f} tokens/s "
              f"({bare_s:.1f} s), ours {our_rates[-1]:.1f} tokens/s ({ours['train_loop_s']:.1f} s; checkpoint+eval "
              f"{ours['checkpoint_s']:.1f} s apart)")  # fmt: skip
    print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"bare PyTorch loop : {max(bare_rates):10.1f} tokens/s (best of {args.rounds})")
    print(f"our training loop : {max(our_rates):10.1f} tokens/s (best of {args.rounds})")
    print(f"ratio ours/bare   : {max(our_rates) / max(bare_rates):.3f} (goal >= 0.8)")
    print(f"loss first {ours['first_loss']:.4f} -> last {ours['last_loss']:.4f}")


# --- --memory ---------------------------------------------------------------------------------------

PASSES = ("old", "new", "new+ckpt")
MEMORY_TTT_STEPS = 7
AUTOCAST = {"bfloat16": torch.bfloat16, "float32": None}
GIB = 1024**3
KIMI_WIDTH_FACTOR = (
    8  # the full Kimi draft is the kimi-like shape at 8× its width (hidden, heads, intermediate, target hidden)
)
GPU_BYTES = 96e9
GPU_RESERVED = 2 * GIB  # CUDA context and the caching allocator's slack
GPU_MARGIN = 0.05  # of the GPU, for fragmentation


def _kimi(hidden: int, draft_vocab: int, kv_heads: int | None) -> DrafterConfig:
    return drafter_config(
        kimi_k25_text_config(hidden_size=hidden),
        draft_vocab,
        KIMI_AUX,
        {"num_key_value_heads": kv_heads} if kv_heads else {},
    )


def _embedded() -> DrafterConfig:
    target = json.loads((local_model_dir() / "config.json").read_text())
    return drafter_config(target, 2048, default_aux_layer_ids(int(target["num_hidden_layers"])), {})


MEMORY_SHAPES = {
    "embedded": _embedded,
    "kimi-like": lambda: _kimi(7168 // KIMI_WIDTH_FACTOR, 32000, 1),
    "kimi-like-16k": lambda: _kimi(7168 // KIMI_WIDTH_FACTOR, 16000, 1),
}


@dataclass(frozen=True)
class MemoryJob:
    shape: str
    pass_name: str
    length: int
    dtype: str
    repeats: int
    ttt_steps: int = MEMORY_TTT_STEPS


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(job: MemoryJob) -> None:
    """One configuration (in its own process): prints base, peak and step memory and the step time."""
    config = MEMORY_SHAPES[job.shape]()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = AUTOCAST[job.dtype]
    torch.manual_seed(0)
    model = Eagle3Drafter(config).to(device)
    model.embed_tokens.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    used = torch.sort(torch.randperm(config.vocab_size, generator=g)[: config.draft_vocab_size]).values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab((used - torch.arange(config.draft_vocab_size)).to(device), t2d.to(device))
    # The target head's rows outside the draft vocabulary are zero: every target argmax is a draft token.
    lm_head = (torch.randn(config.vocab_size, config.target_hidden_size, generator=g) * t2d[:, None]).to(
        device, autocast or torch.float32
    )
    t = job.length
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    batch = Batch(
        aux=torch.randn(1, t, 3 * config.target_hidden_size, generator=g).to(device, torch.bfloat16),
        hidden=torch.randn(1, t, config.target_hidden_size, generator=g).to(device, torch.bfloat16),
        input_ids=torch.randint(0, config.vocab_size, (1, t), generator=g).to(device),
        loss_mask=torch.ones(1, t, dtype=torch.bool, device=device),
        attention_mask=torch.ones(1, t, dtype=torch.bool, device=device),
    )
    times, cpu_times = [], []
    for _ in range(1 + job.repeats):
        model.zero_grad(set_to_none=True)
        started, cpu_started = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            if job.pass_name == "old":
                loss = reference_ttt_loss(model, batch, lm_head, job.ttt_steps)
            else:
                loss = ttt_loss(
                    model,
                    batch,
                    lm_head=lm_head,
                    steps=job.ttt_steps,
                    activation_checkpointing=job.pass_name == "new+ckpt",
                ).loss
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    print(
        json.dumps(
            {
                "base_gib": base / GIB,
                "peak_gib": peak / GIB,
                "step_gib": (peak - base) / GIB,
                "step_s": min(times[1:] or times),
                "cpu_s": min(cpu_times[1:] or cpu_times),
            }
        )
    )


def _run_child(job: MemoryJob, limit_gib: float) -> dict[str, float]:
    """The child's result, or ``{"killed_gib": ...}`` when the watchdog stopped it at the limit."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.drafter_train", "--memory-child", json.dumps(job.__dict__)],
            stdout=out,
            stderr=err,
            env=env,
            text=True,
        )
        while child.poll() is None:
            try:
                rss_kib = next(
                    int(line.split()[1])
                    for line in Path(f"/proc/{child.pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS:")
                )
            except (FileNotFoundError, StopIteration, ProcessLookupError):
                rss_kib = 0
            if rss_kib * 1024 > limit_gib * GIB:
                child.kill()
                child.wait()
                return {"killed_gib": rss_kib * 1024 / GIB}
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        if child.returncode:
            raise RuntimeError(f"{job}: exit {child.returncode}\n{err.read()[-4000:]}")
        return json.loads(out.read().strip().splitlines()[-1])


def _fit(points: list[tuple[int, float]], quadratic: bool) -> list[float]:
    """Least-squares (a, b[, c]) of step bytes = a + b·T (+ c·T²)."""
    x = torch.tensor([[1.0, t] + ([t * t] if quadratic else []) for t, _ in points], dtype=torch.float64)
    y = torch.tensor([[m * GIB] for _, m in points], dtype=torch.float64)
    return torch.linalg.lstsq(x, y).solution.flatten().tolist()


def _extrapolated_peak_gib(measured: dict[int, dict[str, float]], length: int, quadratic: bool) -> float:
    """Peak at ``length`` from the shorter lengths' step memory: a + c·T² (old pass; the linear part
    counted as quadratic, so an overestimate) or a + b·T, through one point the proportional share."""
    points = sorted((t, r["step_gib"]) for t, r in measured.items())
    base = measured[points[-1][0]]["base_gib"]
    if len(points) == 1:
        return base + points[0][1] * (length / points[0][0]) ** (2 if quadratic else 1)
    x = torch.tensor([[1.0, float(t) ** (2 if quadratic else 1)] for t, _ in points], dtype=torch.float64)
    a, slope = (
        torch.linalg.lstsq(x, torch.tensor([[m] for _, m in points], dtype=torch.float64)).solution.flatten().tolist()
    )
    return base + a + slope * float(length) ** (2 if quadratic else 1)


def _longest(per_token: float, per_t2: float, budget: float) -> int:
    if per_t2 <= 0:
        return int(budget / per_token)
    return int((-per_token + math.sqrt(per_token**2 + 4 * per_t2 * budget)) / (2 * per_t2))


def _kimi_fixed_bytes() -> tuple[float, str]:
    """What one GPU holds before the first activation, full Kimi draft, bf16 autocast: float32 master
    weights, gradients and AdamW's two moments of the trained parameters, autocast's bf16 copies of
    them, the frozen float32 target embedding, the target's bf16 lm_head (teacher), one attention
    block's temporaries, the CUDA context and allocator slack."""
    config = _kimi(7168, 32000, None)
    with torch.device("meta"):
        model = Eagle3Drafter(config)
    trained = sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    embed = model.embed_tokens.weight.numel()
    lm_head = config.vocab_size * config.target_hidden_size
    block = 4 * config.num_attention_heads * ATTENTION_BLOCK**2 * 4
    teacher_chunk = TEACHER_CHUNK_TOKENS * config.vocab_size * 2
    fixed = trained * (16 + 2) + embed * 4 + lm_head * 2 + block + GPU_RESERVED
    text = (f"{trained / 1e9:.3f}B trained parameters × (4 weight + 4 grad + 8 AdamW + 2 autocast copy) B "
            f"= {trained * 18 / GIB:.1f} GiB, frozen embedding {embed * 4 / GIB:.1f} GiB, target lm_head "
            f"bf16 {lm_head * 2 / GIB:.1f} GiB, attention blocks {block / GIB:.2f} GiB, CUDA "
            f"context/slack {GPU_RESERVED / GIB:.0f} GiB (the teacher's {teacher_chunk / GIB:.2f} GiB "
            "logits chunk is freed before the forward)")  # fmt: skip
    return fixed, text


def memory_main(args: argparse.Namespace) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    old_lengths = [int(x) for x in args.old_lengths.split(",")]
    vocab_lengths = [int(x) for x in args.vocab_lengths.split(",")]
    shapes = args.shapes.split(",")
    load_before = os.getloadavg()[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"training-step memory ({'max_memory_allocated' if device == 'cuda' else 'peak RSS of a fresh process'}) "
          f"and time; {device}, autocast {args.dtype}, {args.ttt_steps} TTT steps, batch of one sequence of T "
          f"tokens, limit {args.limit_gib} GiB")  # fmt: skip
    results: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for shape in shapes:
        c = MEMORY_SHAPES[shape]()
        print(f"\n== {shape}: hidden {c.hidden_size}, {c.num_attention_heads} heads × {c.head_dim}, "
              f"{c.num_key_value_heads} KV heads, intermediate {c.intermediate_size}, draft vocab "
              f"{c.draft_vocab_size}, vocab {c.vocab_size}, target hidden {c.target_hidden_size}")  # fmt: skip
        for pass_name in PASSES:
            measured = results.setdefault((shape, pass_name), {})
            for t in vocab_lengths if shape == "kimi-like-16k" else old_lengths if pass_name == "old" else lengths:
                key = f"  {pass_name:9s} T={t:6d}"
                if measured:
                    predicted = _extrapolated_peak_gib(measured, t, quadratic=pass_name == "old")
                    if predicted > args.limit_gib:
                        print(
                            f"{key}: did not fit (extrapolated {predicted:.1f} GiB > {args.limit_gib} GiB from "
                            f"T={', '.join(map(str, sorted(measured)))}; not run)",
                            flush=True,
                        )
                        continue
                job = MemoryJob(shape, pass_name, t, args.dtype, args.repeats, args.ttt_steps)
                out = _run_child(job, args.limit_gib)
                if "killed_gib" in out:
                    print(f"{key}: did not fit (killed at {out['killed_gib']:.1f} GiB)", flush=True)
                    continue
                measured[t] = out
                print(
                    f"{key}: peak {out['peak_gib']:6.3f} GiB, step memory {out['step_gib']:6.3f} GiB, "
                    f"{out['step_s']:7.2f} s/step ({out['cpu_s']:.1f} CPU s)",
                    flush=True,
                )
    print(
        f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} (other processes share the CPU: times are "
        "indicative, ratios taken in one run)"
    )
    _memory_table(results, shapes, sorted(set(lengths) | set(old_lengths) | set(vocab_lengths)))
    _kimi_prediction(results)


def _memory_table(
    results: dict[tuple[str, str], dict[int, dict[str, float]]], shapes: list[str], lengths: list[int]
) -> None:
    """Step memory (peak), wall and CPU seconds per step; new/old ratios of step memory and of CPU time
    (wall time on a GPU): on a CPU shared with other processes the CPU time is the steadier measure."""
    clock = "cpu_s" if not torch.cuda.is_available() else "step_s"
    print(
        "\nstep memory GiB (peak GiB), s/step wall / CPU; ratios new/old of step memory and "
        f"{'CPU' if clock == 'cpu_s' else 'wall'} time, same run; '—' did not fit"
    )
    head = (
        f"{'shape':14s} {'T':>6s} | "
        + " | ".join(f"{p:>28s}" for p in PASSES)
        + " | "
        + " | ".join(f"{p + '/old':>15s}" for p in PASSES[1:])
    )
    print(head)
    for shape in shapes:
        for t in lengths:
            rows = [results.get((shape, p), {}).get(t) for p in PASSES]
            if not any(rows):
                continue
            cells = [
                f"{r['step_gib']:6.2f} ({r['peak_gib']:5.2f}) {r['step_s']:6.1f}/{r['cpu_s']:6.1f}"
                if r
                else f"{'—':>28s}"
                for r in rows
            ]
            old = rows[0]
            ratios = [
                f"{r['step_gib'] / old['step_gib']:7.3f} {r[clock] / old[clock]:7.2f}" if r and old else f"{'—':>15s}"
                for r in rows[1:]
            ]
            print(f"{shape:14s} {t:6d} | {' | '.join(cells)} | {' | '.join(ratios)}")


def _vocab_bytes_per_token(pass_name: str, draft_vocab: int) -> float:
    """Draft-vocabulary-sized bytes per token at a step's peak (bf16 autocast; every position counted):
    new passes: the teacher's float32 distributions (4·Vd) that the chunked loss reads, each TTT step's
    bf16 logits that it keeps for the backward (7 × 2·Vd) and one step's bf16 logits gradient (2·Vd);
    old pass: per TTT step the float32 log-probabilities and the copied float32 soft labels the product
    keeps (7 × 8·Vd), the teacher's distributions (4·Vd) and one step's float32 gradients (8·Vd)."""
    per_vocab = 4 + 7 * 8 + 8 if pass_name == "old" else 4 + MEMORY_TTT_STEPS * 2 + 2
    return per_vocab * draft_vocab


def _kimi_prediction(results: dict[tuple[str, str], dict[int, dict[str, float]]]) -> None:
    """Per-token (and old pass per-T²) step memory of the full Kimi draft from the kimi-like shape's
    fit: the draft-vocabulary part (:func:`_vocab_bytes_per_token`; checked against the measured
    difference between the 32000- and 16000-token draft vocabularies) stays, the rest (every other
    activation is a multiple of hidden, heads × head_dim, KV heads × head_dim, intermediate or target
    hidden, all 8× at full size) and the old pass's T² scores (∝ heads) are multiplied by 8."""
    if not all(len(results.get(("kimi-like", p), {})) >= (3 if p == "old" else 2) for p in PASSES):
        print("\nKimi prediction: needs kimi-like at >= 2 lengths per pass (old: 3)")
        return
    fixed, fixed_text = _kimi_fixed_bytes()
    budget = GPU_BYTES * (1 - GPU_MARGIN) - fixed
    print("\n== full Kimi draft (hidden 7168, 56 heads × 128, 8 KV heads, intermediate 40960, "
          f"draft vocab 32000, target hidden 7168, {MEMORY_TTT_STEPS} steps), bf16 autocast, "
          f"one {GPU_BYTES / 1e9:.0f} GB GPU")  # fmt: skip
    print(
        f"fixed: {fixed / GIB:.1f} GiB = {fixed_text}; {GPU_MARGIN:.0%} margin; activations get {budget / GIB:.1f} GiB"
    )
    for pass_name in PASSES:
        quadratic = pass_name == "old"
        measured = results[("kimi-like", pass_name)]
        a, per_token_like, *rest = _fit(sorted((t, r["step_gib"]) for t, r in measured.items()), quadratic)
        per_t2_like = rest[0] if quadratic else 0.0
        vocab_part = _vocab_bytes_per_token(pass_name, 32000)
        width_part = per_token_like - vocab_part
        per_token = KIMI_WIDTH_FACTOR * width_part + vocab_part
        per_t2 = KIMI_WIDTH_FACTOR * per_t2_like
        check = ""
        small = results.get(("kimi-like-16k", pass_name), {})
        common = sorted(set(small) & set(measured))
        if common:
            t = common[-1]
            check = (f"; check at T={t}: 32000 − 16000 draft vocab measured "
                     f"{(measured[t]['step_gib'] - small[t]['step_gib']) * GIB / t / 1024:.0f} KiB/token, modelled "
                     f"{(vocab_part - _vocab_bytes_per_token(pass_name, 16000)) / 1024:.0f} KiB/token + the 16000 "
                     "extra lm_head rows' gradient and bf16 copies")  # fmt: skip
        formula = f"{per_token / 1024:.0f} KiB·T" + (f" + {per_t2:.0f} B·T²" if quadratic else "")
        print(f"  {pass_name:9s}: kimi-like step memory ≈ {a / GIB:.2f} GiB + {per_token_like / 1024:.1f} KiB·T"
              + (f" + {per_t2_like:.1f} B·T²" if quadratic else "")
              + f" (draft-vocabulary part {vocab_part / 1024:.0f} KiB/token, "
              f"width part {width_part / 1024:.0f} KiB/token{check})\n"
              f"             full Kimi ≈ {formula} → longest T per batch ≈ "
              f"{_longest(per_token, per_t2, budget):,} tokens")  # fmt: skip


if __name__ == "__main__":
    main()
