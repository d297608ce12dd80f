"""The check to run on a GPU machine (sized for one H200): what a CPU cannot measure, in sections that each print
their figures as they finish and a ``FIGURES {json}`` line — ``toolchain`` (the CUDA toolchain FlashInfer and
DeepGEMM JIT need; ``--toolchain`` alone), ``chain`` (KV-cache chain drafting against the training-time pass),
``extract`` (the transformers CUDA extractor and its spot check), ``train-16K``/``train-32K`` (50 training
steps of a Kimi-like draft), and ``sglang`` (``--sglang`` alone: the SGLang worker against the transformers
extractor). What each measures, on what, and how to run it: docs/measurements.md, "GPU check".
``--smoke`` runs every section at toy sizes on a CPU (eagle3_pipeline_tests/benchmarks/test_gpu_check.py)::

    .venv/bin/python -m benchmarks.gpu_check 2>&1 | tee gpu_check.log
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cuda_toolchain import toolchain

SEED = 0
KIMI_HIDDEN = 7168
KIMI_DRAFT_KV_HEADS = 8
# SmolLM2-135M-Instruct's shape (the embedded target), as its config.json gives it.
EMBEDDED_SHAPE: dict[str, Any] = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
}  # fmt: skip
GIB = 1024**3


@dataclass(frozen=True)
class Sizes:
    """What each section runs on; ``--smoke`` shrinks every one."""

    chain_length: int = 1024
    chain_prefixes: int = 16
    chain_steps: int = 7
    extract_samples: int = 192
    extract_min_len: int = 256
    extract_max_len: int = 2048
    target_shape: dict[str, Any] | None = None  # None: EMBEDDED_SHAPE
    fixture_samples: int = 32
    draft_hidden: int = KIMI_HIDDEN // 4
    target_vocab: int = 163840
    draft_vocab: int = 32000
    seq_len: int = 2048
    store_samples: int = 35  # every 10th is eval: 32 train, 3 eval
    batch_tokens: tuple[int, ...] = (16384, 32768)
    train_steps: int = 50
    sglang_samples: int = 16  # per target, for --sglang
    sglang_min_len: int = 64
    sglang_max_len: int = 512


SMOKE = Sizes(
    chain_length=24, chain_prefixes=4, chain_steps=3, extract_samples=6, extract_min_len=8, extract_max_len=32,
    target_shape={**EMBEDDED_SHAPE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
    fixture_samples=4, draft_hidden=128, target_vocab=1024, draft_vocab=256, seq_len=32, store_samples=12,
    batch_tokens=(64, 128), train_steps=2, sglang_samples=4, sglang_min_len=8, sglang_max_len=32,
)  # fmt: skip


def say(line: str) -> None:
    print(line, flush=True)


def figures(section: str, values: dict[str, Any]) -> None:
    say(f"FIGURES {json.dumps({'section': section, **values})}")


class Guard:
    """The run's total time limit: at ``limit`` seconds the process ends (exit code 3), whatever it
    is doing; the figures printed before stand."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.started = time.monotonic()
        timer = threading.Timer(limit, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        say(f"TIME GUARD: {self.limit:.0f} s reached; stopped here (the sections above are complete)")
        os._exit(3)

    def left(self) -> float:
        return self.limit - (time.monotonic() - self.started)


class Printer:
    """The phases' Reporter: log lines as they come, training progress points in one line each."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def log(self, message: str) -> None:
        say(f"  [{self.prefix}] {message}")

    def progress(self, metrics: Any) -> None:
        if "step" in metrics:
            say(
                f"  [{self.prefix}] step {metrics['step']}: loss {metrics['loss']:.4f}, "
                f"{metrics['tokens_per_s']:.0f} tokens/s (window)"
            )


def describe_machine(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": (
            "bfloat16 (extraction weights; training and chain under bf16 autocast)" if device == "cuda"
            else "bfloat16 extraction; float32 training (CPU)"
        ),
    }  # fmt: skip
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update({"gpu": props.name, "gpu_memory_gib": round(props.total_memory / GIB, 1),
                     "cuda": torch.version.cuda, "sm": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count})  # fmt: skip
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> dict[str, float | None]:
    import torch

    if device != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2),
    }


# --- the draft shape ---------------------------------------------------------------------------------


def kimi_like_target(sizes: Sizes) -> dict[str, Any]:
    """Kimi-K2.5's language model config at the width of ``sizes.draft_hidden`` (vocabulary ``target_vocab``)."""
    from eagle3_pipeline.testing.drafter_reference import kimi_k25_text_config

    return kimi_k25_text_config(hidden_size=sizes.draft_hidden, vocab_size=sizes.target_vocab)


def draft_overrides(sizes: Sizes) -> dict[str, Any]:
    """Kimi's 8 draft KV heads scaled with the width (at least 1)."""
    return {"num_key_value_heads": max(1, KIMI_DRAFT_KV_HEADS * sizes.draft_hidden // KIMI_HIDDEN)}


# --- 1. chain drafting against the unrolled pass -----------------------------------------------------


def chain_section(sizes: Sizes, device: str) -> dict[str, Any]:
    import torch

    from eagle3_pipeline.drafter.model.draft_config import drafter_config
    from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
    from eagle3_pipeline.hidden_states.store import default_aux_layer_ids
    from eagle3_pipeline.testing.drafter_reference import chain_draft

    target = kimi_like_target(sizes)
    config = drafter_config(
        target, sizes.draft_vocab, default_aux_layer_ids(int(target["num_hidden_layers"])), draft_overrides(sizes)
    )
    torch.manual_seed(SEED)
    model = Eagle3Drafter(config)
    used = torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab(used - torch.arange(config.draft_vocab_size), t2d)
    model = model.to(device).eval()
    g = torch.Generator().manual_seed(SEED)
    t_total, steps = sizes.chain_length, sizes.chain_steps
    aux = torch.randn(1, t_total, 3 * config.target_hidden_size, generator=g).to(device)
    ids = torch.randint(0, config.vocab_size, (1, t_total), generator=g).to(device)
    last = t_total - steps - 2
    prefixes = sorted({round(i * last / max(1, sizes.chain_prefixes - 1)) for i in range(sizes.chain_prefixes)})
    result: dict[str, Any] = {
        "length": t_total,
        "prefixes": len(prefixes),
        "steps": steps,
        "draft_hidden": config.hidden_size,
    }
    for name, autocast in (("float32", None), ("bf16", torch.bfloat16)):
        errors = [0.0] * steps
        equal = [0] * steps
        started = time.perf_counter()
        with torch.no_grad(), torch.autocast(device, dtype=autocast or torch.float32, enabled=autocast is not None):
            unrolled = model.ttt_forward(aux, ids, steps)
            for t in prefixes:
                chained = chain_draft(model, aux, ids, t, steps)
                for j in range(steps):
                    ref, got = unrolled[j][:, t].float(), chained[j].float()
                    errors[j] = max(errors[j], float((got - ref).abs().max() / ref.abs().max()))
                    equal[j] += int((got.argmax(-1) == ref.argmax(-1)).sum())
        seconds = time.perf_counter() - started
        result[name] = {"max_rel_error_per_depth": [float(f"{e:.3g}") for e in errors],
                        "same_draft_token_share_per_depth": [e / len(prefixes) for e in equal],
                        "seconds": round(seconds, 2)}  # fmt: skip
        say(f"  {name}: largest |chain − unrolled| / largest |logit| per depth "
            f"{result[name]['max_rel_error_per_depth']}; same greedy draft token "
            f"{sum(equal)}/{steps * len(prefixes)} ({seconds:.2f} s)")  # fmt: skip
    return result


# --- 2. extraction -----------------------------------------------------------------------------------


def extract_once_spec(spec: dict[str, Any], prefix: str) -> dict[str, Any]:
    from eagle3_pipeline.hidden_states.extract import run

    return run(spec, Printer(prefix))


def extract_once(
    name: str, model_dir: Path, data: Path, output: Path, device: str, trust_remote_code: bool
) -> dict[str, Any]:
    spec = {"training_data": str(data), "output": str(output), "model": str(model_dir), "target_name": name,
            "device": device, "dtype": "bfloat16", "spot_check_samples": 4,
            "trust_remote_code": trust_remote_code}  # fmt: skip
    reset_peak(device)
    started = time.perf_counter()
    meta = extract_once_spec(spec, f"extract {name}")
    out = {
        "target": name, "samples": meta["samples"], "tokens": meta["tokens"], "tokens_per_s": meta["tokens_per_s"],
        "extract_seconds": meta["extract_seconds"], "wall_s": round(time.perf_counter() - started, 1),
        "spot_check_samples": meta["spot_check_samples"],
        "spot_check_max_rel_error": float(f"{meta['spot_check_max_rel_error']:.3g}"),
        "spot_check_tolerance": meta["spot_check_tolerance"], "spot_check_passed": meta["spot_check_passed"],
        "bytes_per_token": meta["bytes_per_token"], "bytes_per_token_formula": meta["bytes_per_token_formula"],
        "capture_device": meta["device"], "capture_dtype": meta["dtype"], **peak_gib(device),
    }  # fmt: skip
    say(f"  {name}: {out['samples']} samples, {out['tokens']} tokens at {out['tokens_per_s']:.0f} tokens/s "
        f"on {out['capture_device']}/{out['capture_dtype']}; spot check max relative error "
        f"{out['spot_check_max_rel_error']} (tolerance {out['spot_check_tolerance']}, "
        f"{'passed' if out['spot_check_passed'] else 'FAILED'}); peak GPU memory "
        f"{out['peak_allocated_gib']} GiB")  # fmt: skip
    return out


def llama_target(folder: Path, shape: dict[str, Any]) -> Path:
    """A random-weight Llama of ``shape`` (seeded), saved in bf16 as transformers loads it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    model.bfloat16().save_pretrained(folder)
    return folder


def extract_section(sizes: Sizes, device: str, work: Path) -> dict[str, Any]:
    from eagle3_pipeline.testing.kimi.fixture import VOCAB_SIZE, build_kimi_checkpoint
    from eagle3_pipeline.testing.training_data import sample_rows, write_training_data

    shape = sizes.target_shape or EMBEDDED_SHAPE
    rows = sample_rows(
        "s", sizes.extract_samples, SEED, sizes.extract_min_len, sizes.extract_max_len, vocab=shape["vocab_size"]
    )
    data = write_training_data(work / "td-llama", {"train": [rows]}, vocab_size=shape["vocab_size"])
    llama = extract_once(
        "random-llama-smollm2-shape", llama_target(work / "llama", shape), data, work / "hs-llama", device, False
    )
    fixture_rows = sample_rows(
        "k", sizes.fixture_samples, SEED, sizes.extract_min_len, sizes.extract_max_len, vocab=VOCAB_SIZE
    )
    fixture_data = write_training_data(work / "td-kimi", {"train": [fixture_rows]}, vocab_size=VOCAB_SIZE)
    kimi = extract_once(
        "kimi-k25-tiny-fixture",
        build_kimi_checkpoint(work / "kimi", seed=SEED),
        fixture_data,
        work / "hs-kimi",
        device,
        True,
    )
    return {"llama": llama, "kimi_fixture": kimi}


# --- 3. training -------------------------------------------------------------------------------------


def train_inputs(sizes: Sizes, work: Path) -> tuple[Path, Path, Path]:
    """The Kimi-like target folder (config, random embedding, lm_head zero outside the draft
    vocabulary), a random hidden-state store of ``store_samples`` sequences and its draft vocabulary."""
    import torch
    from safetensors.torch import save_file

    from eagle3_pipeline.hidden_states.store import load_draft_vocab
    from eagle3_pipeline.testing.tiny_store import random_store

    target_dir, store, vocab = work / "kimi-like", work / "train-store", work / "train-vocab"
    target_dir.mkdir(parents=True)
    config = kimi_like_target(sizes)
    (target_dir / "config.json").write_text(json.dumps(config))
    random_store(
        store,
        vocab,
        target_dir=target_dir,
        samples=sizes.store_samples,
        draft_vocab_size=sizes.draft_vocab,
        length=sizes.seq_len,
        seed=SEED,
    )
    _, t2d, _ = load_draft_vocab(vocab)
    g = torch.Generator().manual_seed(SEED)
    shape = (sizes.target_vocab, sizes.draft_hidden)
    tensors = {
        "model.embed_tokens.weight": torch.randn(shape, generator=g).to(torch.bfloat16),
        "lm_head.weight": (torch.randn(shape, generator=g) * t2d[:, None]).to(torch.bfloat16),
    }
    save_file(tensors, str(target_dir / "model.safetensors"))
    return target_dir, store, vocab


def train_section(
    sizes: Sizes, device: str, inputs: tuple[Path, Path, Path], batch_tokens: int, work: Path
) -> dict[str, Any]:
    from eagle3_pipeline.drafter.train.phase import run
    from eagle3_pipeline.testing.train_settings import train_settings

    target_dir, store, vocab = inputs
    train_per_epoch = sizes.store_samples - sizes.store_samples // 10
    batches_per_epoch = -(-train_per_epoch // (batch_tokens // sizes.seq_len))
    settings = train_settings(
        max_steps=sizes.train_steps, epochs=-(-sizes.train_steps // batches_per_epoch),
        batch_tokens=batch_tokens, max_seq_len=sizes.seq_len, seed=SEED,
        log_every=10 if sizes.train_steps >= 10 else 1, checkpoint_every=10**9, keep_checkpoints=1,
        eval_samples=4, model=draft_overrides(sizes),
    )  # fmt: skip
    run_dir = work / f"run-{batch_tokens}"
    spec = {"store": str(store), "draft_vocab": str(vocab), "target_weights": str(target_dir),
            "run_dir": str(run_dir / "run"), "export_dir": str(run_dir / "export"), "settings": settings}  # fmt: skip
    reset_peak(device)
    started = time.perf_counter()
    meta = run(spec, Printer(f"train {batch_tokens}"))
    drafter = meta["drafter"]
    warm = meta["curve"][-1]["tokens_per_s"] if meta["curve"] else None
    out = {
        "batch_tokens": batch_tokens, "steps": meta["steps"], "trained_tokens": meta["trained_tokens_this_run"],
        "tokens_per_s": meta["tokens_per_s"], "last_window_tokens_per_s": warm, "train_loop_s": meta["train_loop_s"],
        "checkpoint_eval_export_s": meta["checkpoint_s"], "wall_s": round(time.perf_counter() - started, 1),
        "autocast": meta["autocast"], "first_loss": meta["first_loss"], "last_loss": meta["last_loss"],
        "draft": {k: drafter[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "draft_vocab_size", "vocab_size")},
        **peak_gib(device),
    }  # fmt: skip
    say(f"  batch_tokens {batch_tokens}: {out['steps']} steps, {out['trained_tokens']} tokens, {out['tokens_per_s']} "
        f"tokens/s (last window {warm}), loop {out['train_loop_s']} s + checkpoint/eval/export "
        f"{out['checkpoint_eval_export_s']} s; peak GPU memory allocated {out['peak_allocated_gib']} GiB, reserved "
        f"{out['peak_reserved_gib']} GiB; draft {out['draft']}")  # fmt: skip
    return out


# --- 4. SGLang capture (--sglang) --------------------------------------------------------------------


def extract_apart(spec: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``extract`` in a fresh process (spawned: a clean CUDA context and SGLang state, its GPU memory
    handed back when it ends)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(extract_once_spec, spec, prefix).result()


def compare_stores(found: Path, expected: Path) -> dict[str, Any]:
    """Per sample and tensor, the relative L2 error of ``found`` against ``expected`` (the spot
    check's measure), the largest and the mean, and whether the ids and lengths agree."""
    from eagle3_pipeline.hidden_states.store import HiddenStateStore

    errors: dict[str, list[float]] = {"aux": [], "teacher": []}
    theirs = {sample.sample_id: sample for sample in HiddenStateStore(expected).iter_samples()}
    same_ids = True
    for sample in HiddenStateStore(found).iter_samples():
        reference = theirs.pop(sample.sample_id)
        same_ids &= bool((sample.input_ids == reference.input_ids).all())
        for key, mine, other in (
            ("aux", sample.aux_hidden_states, reference.aux_hidden_states),
            ("teacher", sample.hidden_states, reference.hidden_states),
        ):
            scale = other.float().norm()
            errors[key].append(float((mine.float() - other.float()).norm() / scale) if float(scale) else 0.0)
    return {
        "samples": len(errors["aux"]),
        "same_ids_and_samples": same_ids and not theirs,
        **{f"{key}_max_rel_error": float(f"{max(v):.3g}") for key, v in errors.items()},
        **{f"{key}_mean_rel_error": float(f"{sum(v) / len(v):.3g}") for key, v in errors.items()},
    }


def sglang_once(
    name: str, model_dir: Path, data: Path, work: Path, device: str, trust_remote_code: bool
) -> dict[str, Any]:
    """SGLang's capture (the worker of ``backend: sglang``, one rank) against the transformers
    extractor on the same samples and device."""
    common = {"training_data": str(data), "model": str(model_dir), "target_name": name,
              "dtype": "bfloat16" if device == "cuda" else "auto", "trust_remote_code": trust_remote_code,
              "shard_tokens": 1 << 20}  # fmt: skip
    sglang_spec = {**common, "output": str(work / f"hs-sglang-{name}"), "backend": "sglang",
                   "sglang_python": sys.executable, "tp_size": 1, "batch_tokens": 4096, "max_batch_size": 8,
                   "mem_fraction_static": 0.5, "spot_check_samples": 2}  # fmt: skip
    started = time.perf_counter()
    ours = extract_apart(sglang_spec, f"sglang {name}")
    sglang_s = time.perf_counter() - started
    reset_peak(device)
    theirs = extract_once_spec(
        {**common, "output": str(work / f"hs-transformers-{name}"), "device": device, "spot_check_samples": 0},
        f"transformers {name}",
    )
    compared = compare_stores(work / f"hs-sglang-{name}", work / f"hs-transformers-{name}")
    capture = ours["capture"]
    out = {
        "target": name, "tokens": ours["tokens"], "sglang_tokens_per_s": ours["tokens_per_s"],
        "sglang_wall_s": round(sglang_s, 1), "transformers_tokens_per_s": theirs["tokens_per_s"],
        "spot_check_passed": ours["spot_check_passed"], "spot_check_max_rel_error": ours["spot_check_max_rel_error"],
        "tolerance": ours["spot_check_tolerance"], **compared,
        "within_tolerance": compared["same_ids_and_samples"]
        and max(compared["aux_max_rel_error"], compared["teacher_max_rel_error"]) <= ours["spot_check_tolerance"],
        "capture": {k: capture[k] for k in ("sglang_version", "model_class", "family", "aux_form",
                                            "set_eagle3_layers_to_capture", "layers_to_capture")},
    }  # fmt: skip
    say(f"  {name}: SGLang {capture['sglang_version']} {capture['model_class']} ({capture['aux_form']} aux) "
        f"{out['tokens']} tokens at {out['sglang_tokens_per_s']:.0f} tokens/s; against transformers: aux max "
        f"relative error {out['aux_max_rel_error']}, teacher {out['teacher_max_rel_error']} (tolerance "
        f"{out['tolerance']}: {'within' if out['within_tolerance'] else 'OUTSIDE'}); layers captured "
        f"{capture['layers_to_capture']}")  # fmt: skip
    return out


def sglang_section(sizes: Sizes, device: str, work: Path) -> dict[str, Any]:
    from eagle3_pipeline.hidden_states.sglang_api import SGLangApi
    from eagle3_pipeline.testing.kimi.fixture import VOCAB_SIZE, build_kimi_checkpoint
    from eagle3_pipeline.testing.training_data import sample_rows, write_training_data

    version = SGLangApi().release.version
    shape = sizes.target_shape or EMBEDDED_SHAPE
    results: dict[str, Any] = {"sglang_version": version}
    targets = (
        ("llama", "random-llama-smollm2-shape", shape["vocab_size"], lambda f: llama_target(f, shape), False),
        ("kimi_fixture", "kimi-k25-tiny-fixture", VOCAB_SIZE, lambda f: build_kimi_checkpoint(f, seed=SEED), True),
    )
    for key, name, vocab, build, remote in targets:
        rows = sample_rows("g", sizes.sglang_samples, SEED, sizes.sglang_min_len, sizes.sglang_max_len, vocab=vocab)
        data = write_training_data(work / f"td-sglang-{key}", {"train": [rows]}, vocab_size=vocab)
        results[key] = sglang_once(name, build(work / f"sglang-{key}"), data, work, device, remote)
    return results


# --- main --------------------------------------------------------------------------------------------


def section(name: str, guard: Guard, need_s: float, body: Callable[[], dict[str, Any]]) -> float | None:
    """Run one section if ``need_s`` seconds are left; print its figures or its error. Returns its seconds."""
    if guard.left() < need_s:
        say(f"== {name}: SKIPPED, {guard.left():.0f} s left of the time limit, it needs about {need_s:.0f} s")
        figures(name, {"skipped": True, "seconds_left": round(guard.left())})
        return None
    say(f"== {name} ({guard.left():.0f} s left)")
    started = time.perf_counter()
    try:
        values = body()
    except Exception as exc:  # one section's failure must not lose the others' figures
        say(f"  {name} FAILED: {type(exc).__name__}: {exc}")
        figures(name, {"failed": f"{type(exc).__name__}: {exc}"})
        return None
    seconds = time.perf_counter() - started
    figures(name, {**values, "section_s": round(seconds, 1)})
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes, seconds on a CPU (the test runs this)")
    parser.add_argument(
        "--time-limit", type=float, default=450.0, help="seconds; the run ends there with what it printed"
    )
    parser.add_argument(
        "--width-divisor", type=int, default=4, help="training/chain shape: Kimi's width (hidden 7168) divided by this"
    )
    parser.add_argument(
        "--work", type=Path, help="folder for the models and stores (default: a temporary folder, removed at the end)"
    )
    parser.add_argument(
        "--toolchain", action="store_true", help="only the CUDA toolchain section (CUDA_HOME, nvcc), in seconds"
    )
    parser.add_argument(
        "--sglang",
        action="store_true",
        help="only the SGLang capture section, with the sglang (0.5.14 or 0.5.23) of this python's environment",
    )
    args = parser.parse_args()
    guard = Guard(args.time_limit)
    try:
        import pydantic  # noqa: F401
    except ImportError:
        say(
            "pydantic is missing: run this script with the python of a venv where this project is installed "
            "(docs/measurements.md, GPU check)"
        )
        return 2
    if args.sglang:
        from eagle3_pipeline.hidden_states.sglang_api import SGLangApi, SGLangError

        try:
            SGLangApi()
        except SGLangError as exc:
            say(f"--sglang: {exc}. Run this script with the python of an SGLang venv (benchmarks/gpu_check.py)")
            return 2
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # carriage-return bars would crowd the figures out of the log's tail
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = SMOKE if args.smoke else Sizes(draft_hidden=KIMI_HIDDEN // args.width_divisor)
    say(f"MEASURED ON {json.dumps(describe_machine(device))}")
    section("toolchain", guard, 1, lambda: toolchain(torch_cuda=torch.version.cuda))
    if args.toolchain:
        return 0
    say(f"sizes: {'smoke' if args.smoke else 'full'}, seed {SEED}, time limit {args.time_limit:.0f} s")
    if device == "cpu" and not args.smoke:
        say("no CUDA device: these figures are not the GPU check's (use --smoke on a CPU)")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.sglang:
            section("sglang", guard, 60, lambda: sglang_section(sizes, device, work))
            say(f"done in {time.monotonic() - guard.started:.0f} s")
            return 0
        section("chain", guard, 10, lambda: chain_section(sizes, device))
        section("extract", guard, 60, lambda: extract_section(sizes, device, work))
        inputs: list[tuple[Path, Path, Path]] = []

        def make_inputs() -> dict[str, Any]:
            inputs.append(train_inputs(sizes, work))
            return {"target": str(inputs[0][0]), "store": str(inputs[0][1]), "draft_vocab": str(inputs[0][2])}

        took = section("train-inputs", guard, 60, make_inputs)
        last: float | None = 30.0 if took is not None else None
        for batch_tokens in sizes.batch_tokens:
            if last is None:
                say(f"== train-{batch_tokens}: SKIPPED, the section before did not finish")
                figures(f"train-{batch_tokens}", {"skipped": True})
                continue
            last = section(
                f"train-{batch_tokens}",
                guard,
                2 * last,
                lambda b=batch_tokens: train_section(sizes, device, inputs[0], b, work),
            )
    say(f"done in {time.monotonic() - guard.started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
