"""Does each GPU phase of a pipeline fit its machine: GPU memory per GPU, host memory, disk and time, from the
target's checkpoint (eagle3_pipeline.fit.checkpoint), the engines' budget rules (eagle3_pipeline.fit.engines)
and the machine (eagle3_pipeline.fit.machine), one row per phase of the phase table (config/phases.py).

Settings left ``auto`` are chosen here and said why (:class:`Choice`); a value the user set is kept and
refused with the figures when it cannot fit. Figures are labelled: ``formula`` (arithmetic on the
checkpoint and the settings), ``fit`` (a fit of measured figures: the drafter's training memory,
docs/measurements.md "Drafter memory"), ``estimate`` (time from the card's datasheet at a stated
utilisation), ``measured`` (a rate an earlier run recorded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.config.phases import PHASES, GpuPhase
from eagle3_pipeline.fit.checkpoint import Weights
from eagle3_pipeline.fit.engines import (
    DraftShape,
    Engine,
    ServingFit,
    capture_activation_bytes,
    capture_share,
    flag_value,
    kv_per_token,
    serving_fit,
)
from eagle3_pipeline.fit.gpus import GIB
from eagle3_pipeline.fit.machine import Machine
from eagle3_pipeline.fit.records import Choice, FitReport, Need, PhaseFit, Workload
from eagle3_pipeline.hidden_states.disk import specforge_bytes_per_token, vllm_file_bytes_per_token
from eagle3_pipeline.target.folder import text_config

if TYPE_CHECKING:
    from eagle3_pipeline.drafter.model.draft_config import DrafterConfig

# Utilisation of the datasheet figures for the time estimates (stated on every figure).
DECODE_BANDWIDTH_UTIL = 0.6
PREFILL_MFU = 0.4
TRAIN_MFU = 0.3
# The drafter's training memory, docs/measurements.md "Drafter memory" (benchmarks/drafter_train.py --memory):
# per token of a step at 7 TTT steps, a part that scales with the draft's width (KiB at hidden 896, × hidden/896)
# and a part that scales with the draft vocabulary (KiB at 32000 ids), both proportional to the TTT steps
# (measured: 52–54 KiB per token and step on the embedded draft at 3 and 7 steps); with checkpointing a further
# 83 KiB per token that depends on neither (measured on the embedded draft, not in the kimi-like fit);
# fixed: 18 bytes per trained parameter.
TRAIN_KIB_PER_TOKEN = {False: (496.9, 625.1), True: (26.3, 624.7)}  # activation_checkpointing → (width, vocab)
TRAIN_FIT_HIDDEN, TRAIN_FIT_VOCAB, TRAIN_FIT_STEPS = 896, 32000, 7
TRAIN_CHECKPOINTING_KIB = 83.0
TRAIN_BYTES_PER_PARAM = 18
CUDA_SLACK = 2 * GIB
MARGIN = 0.95  # of a GPU's memory a phase may plan to use
AUTO_BATCH_TOKENS = (16384, 8192, 4096, 2048)


# --- inputs ---------------------------------------------------------------------------------------


def _draft(config: PipelineConfig, raw: Mapping[str, Any]) -> DrafterConfig:
    """The draft the trainer builds for this target (aux layer ids do not change its shape: any three do)."""
    from eagle3_pipeline.drafter.model.draft_config import drafter_config

    text = text_config(raw)
    layer_ids = config.hidden_states.aux_layer_ids or [1, 2, 3]
    overrides = config.drafter.model.model_dump(exclude_none=True)
    return drafter_config(text, config.draft_vocab.size or int(text["vocab_size"]), layer_ids, overrides)


def draft_shape(config: PipelineConfig, raw: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(trained parameters, frozen bytes, KV bytes per token, served weight bytes) of the EAGLE-3 draft."""
    from eagle3_pipeline.drafter.model.draft_config import attention_parameters, kv_cache_elements_per_token

    text = text_config(raw)
    draft = _draft(config, raw)
    hidden, inter = draft.hidden_size, draft.intermediate_size
    trained = (
        attention_parameters(draft)
        + 3 * hidden * inter
        + 3 * draft.target_hidden_size * hidden
        + draft.draft_vocab_size * hidden
    )
    frozen = int(text["vocab_size"]) * draft.target_hidden_size * 2 * 2  # the embedding and the target's lm_head, bf16
    kv = kv_cache_elements_per_token(draft) * 2
    served = trained * 2 + int(text["vocab_size"]) * hidden * 2
    return trained, frozen, kv, served


# --- the phases -----------------------------------------------------------------------------------


@dataclass
class Inputs:
    config: PipelineConfig
    raw: Mapping[str, Any]
    weights: Weights
    machine: Machine
    workload: Workload
    extraction_rate: float | None = None  # tokens/s an earlier extraction recorded
    choices: list[Choice] = field(default_factory=list)
    store_peak: float | None = None  # the hidden-state store's peak on disk, which training shares

    def checkpoints_disk(self) -> float:
        """The drafter's checkpoints and export on disk (formula): kept + 1 being written, fp32 weights and
        AdamW moments, and the bf16 export."""
        trained, _, _, _ = draft_shape(self.config, self.raw)
        return (self.config.drafter.keep_checkpoints + 1) * trained * 12 + trained * 2


def _gpu_need(need: float | None, machine: Machine, detail: str, setting: str = "") -> Need:
    have = machine.gpu_bytes * MARGIN if machine.gpu_bytes else None
    return Need("gpu", need, have, detail, setting)


def _serving(
    inputs: Inputs, engine: Engine, tp: int, args: Sequence[str], draft: DraftShape | None
) -> ServingFit | None:
    if inputs.machine.gpu_bytes is None:
        return None
    fraction = flag_value(args, "--mem-fraction-static", "--gpu-memory-utilization")
    kv_dtype = flag_value(args, "--kv-cache-dtype") or "auto"
    context = flag_value(args, "--context-length", "--max-model-len")
    return serving_fit(
        engine,
        inputs.weights,
        inputs.raw,
        tp=tp,
        gpu_bytes=inputs.machine.gpu_bytes,
        fraction=float(fraction) if fraction else None,
        kv_dtype=kv_dtype,
        context_len=int(context) if context else inputs.config.target.max_seq_len,
        draft=draft,
    )


def _serving_needs(fit: ServingFit | None, setting: str) -> list[Need]:
    if fit is None:
        return [Need("gpu", None, None, "the GPU's memory is unknown (declare machine.gpu or run on the host)")]
    share = fit.fraction * fit.usable - (0 if fit.engine == "sglang" else fit.reserve)
    need = fit.weights + fit.draft_weights + fit.context_len * fit.kv_per_token
    return [Need("gpu", need, share, f"{fit.engine} TP {fit.tp}: {fit.reason()}", setting)]


def _hicache(args: Sequence[str], fit: ServingFit | None, tp: int, machine: Machine) -> Need | None:
    if "--enable-hierarchical-cache" not in args or fit is None:
        return None
    ratio = float(flag_value(args, "--hicache-ratio") or 2.0)
    size = flag_value(args, "--hicache-size")
    need = float(size) * GIB * tp if size and float(size) > 0 else ratio * max(fit.kv_pool, 0) * tp
    return Need(
        "host",
        need,
        machine.host_bytes,
        f"hierarchical cache: pinned host memory {ratio:g} × the KV pool × {tp} ranks",
        "--hicache-ratio/--hicache-size in serving.extra_args",
    )


def _decode_rate(inputs: Inputs, tp: int, batch: int) -> tuple[float, str] | None:
    spec = inputs.machine.spec
    if spec is None:
        return None
    text = text_config(inputs.raw)
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or 0)
    top_k = int(text.get("num_experts_per_tok") or 0)
    touched = 1 - (1 - top_k / experts) ** batch if experts else 1.0
    per_gpu = sum(
        m.bytes * (touched if ".experts." in m.name else 1.0) / (1 if m.split == "replicated" else tp)
        for m in inputs.weights.loaded()
    )
    memory_s = per_gpu / (spec.bandwidth_tbs * 1e12 * DECODE_BANDWIDTH_UTIL)
    active = _active_params(inputs)
    compute_s = 2 * active * batch / (tp * spec.bf16_tflops * 1e12 * PREFILL_MFU)
    step = max(memory_s, compute_s)
    return batch / step, (
        f"estimate: {batch} requests per decode step, {per_gpu / GIB:.1f} GiB read per GPU per step at "
        f"{DECODE_BANDWIDTH_UTIL:.0%} of {spec.name}'s {spec.bandwidth_tbs} TB/s"
    )


def _active_params(inputs: Inputs) -> float:
    """Parameters one token passes through (routed experts at top-k / experts), from the module sizes at 2
    bytes per parameter equivalent."""
    text = text_config(inputs.raw)
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or 0)
    top_k = int(text.get("num_experts_per_tok") or 0)
    from eagle3_pipeline.fit.checkpoint import module_params

    total = 0.0
    for module in inputs.weights.loaded():
        params = module_params(module.name, text) or 0
        total += params * (top_k / experts if experts and ".experts." in module.name else 1.0)
    return total


def _responses(inputs: Inputs) -> PhaseFit:
    config = inputs.config
    phase = PhaseFit("responses")
    serving = config.serving
    if not serving.managed:
        phase.notes.append("the inference server is the user's (serving.managed is false): its memory is not modelled")
        return phase
    fit = _serving(inputs, serving.engine, serving.tp_size, serving.extra_args, None)
    phase.needs += _serving_needs(fit, "--mem-fraction-static / --context-length in serving.extra_args")
    cache = _hicache(serving.extra_args, fit, serving.tp_size, inputs.machine)
    if cache:
        phase.needs.append(cache)
    concurrency = config.generation.concurrency.short + config.generation.concurrency.long
    typical = config.generation.max_tokens  # a request holds its prompt and at most max_tokens answer tokens
    batch = min(concurrency, fit.kv_tokens // typical if fit and fit.kv_tokens >= typical else concurrency)
    rate = _decode_rate(inputs, serving.tp_size, max(batch, 1))
    left = inputs.workload.completion_left
    if rate and left is not None:
        phase.time_s, phase.time_basis = left / rate[0], f"{left:,} tokens at {rate[0]:,.0f} tokens/s ({rate[1]})"
    return phase


def _capture_fraction(inputs: Inputs, before: float, weights: float, per_token: float) -> tuple[float, int]:
    """(mem_fraction_static, batch_tokens) for SGLang's capture: the user's where set; else the largest batch whose
    prefill fits beside a pool that holds it, the share leaving the formula's prefill memory × the headroom."""
    hs = inputs.config.hidden_states
    fixed_batch = hs.batch_tokens if isinstance(hs.batch_tokens, int) else None
    candidates = [fixed_batch] if fixed_batch else list(AUTO_BATCH_TOKENS)
    chosen: tuple[float, int] | None = None
    for batch in candidates:
        reserve = capture_activation_bytes(inputs.raw, hs.tp_size, batch)
        fraction = hs.mem_fraction_static
        if fraction == "auto":
            fraction = capture_share(inputs.raw, hs.tp_size, batch, before)
        chosen = (float(fraction), batch)
        if before * chosen[0] - weights >= batch * per_token and before * (1 - chosen[0]) >= reserve:
            return chosen
    assert chosen is not None
    return chosen


def _hidden_states(inputs: Inputs, store_per_token: int) -> PhaseFit:
    config = inputs.config
    hs = config.hidden_states
    phase = PhaseFit("hidden_states")
    machine = inputs.machine
    backend = "command" if config.compute.kind == "command" else hs.backend
    if backend == "sglang" and machine.gpu_bytes:
        from eagle3_pipeline.fit.engines import CONTEXT_BYTES

        before = machine.gpu_bytes - CONTEXT_BYTES
        weights = inputs.weights.per_gpu_bytes(hs.tp_size)
        per_token = kv_per_token(inputs.raw, hs.tp_size)
        fraction, batch = _capture_fraction(inputs, before, weights, per_token)
        reserve = capture_activation_bytes(inputs.raw, hs.tp_size, batch)
        if hs.mem_fraction_static == "auto":
            inputs.choices.append(
                Choice(
                    "hidden_states.mem_fraction_static",
                    fraction,
                    f"leaves {(1 - fraction) * before / GIB:.1f} GiB per GPU for a prefill of {batch:,} tokens "
                    f"(needs {reserve / GIB:.1f} GiB: activations, captured states, 2 GiB slack); weights "
                    f"{weights / GIB:.1f} GiB",
                )
            )
        if hs.batch_tokens == "auto":
            inputs.choices.append(
                Choice(
                    "hidden_states.batch_tokens",
                    batch,
                    f"the largest of {AUTO_BATCH_TOKENS} the KV pool and the reserve hold",
                )
            )
        pool = before * fraction - weights
        phase.needs.append(
            Need(
                "gpu",
                weights + batch * per_token,
                before * fraction,
                f"SGLang capture, TP {hs.tp_size}: weights {weights / GIB:.1f} GiB + KV for {batch:,} tokens "
                f"{batch * per_token / GIB:.2f} GiB within {fraction:g} × {before / GIB:.1f} GiB "
                f"(pool {max(pool, 0) / GIB:.1f} GiB)",
                "hidden_states.mem_fraction_static (or auto) / hidden_states.batch_tokens",
            )
        )
        phase.needs.append(
            Need(
                "gpu",
                reserve,
                before * (1 - fraction),
                f"the prefill's activations beside the pool ({1 - fraction:.3f} × {before / GIB:.1f} GiB)",
                "hidden_states.mem_fraction_static / hidden_states.batch_tokens",
            )
        )
    elif backend == "vllm":
        fit = _serving(inputs, "vllm", config.serving.tp_size, config.serving.extra_args, None)
        phase.needs += _serving_needs(fit, "--gpu-memory-utilization in serving.extra_args")
    elif backend == "transformers" and machine.gpus:
        weights = inputs.weights.per_gpu_bytes(1) / machine.gpus
        phase.needs.append(
            _gpu_need(
                weights * 1.1 + CUDA_SLACK,
                machine,
                f"transformers, device_map over {machine.gpus} GPUs (+10 %, 2 GiB)",
                "hidden_states.backend sglang or vllm (tensor parallelism)",
            )
        )
    phase.needs += _store_disk(inputs, store_per_token)
    buffered = hs.shard_tokens + (hs.batch_tokens if isinstance(hs.batch_tokens, int) else AUTO_BATCH_TOKENS[0])
    phase.needs.append(
        Need(
            "host",
            buffered * store_per_token,
            machine.host_bytes,
            f"formula: the shard being written and one batch's states ({buffered:,} tokens × {store_per_token:,} B)",
            "hidden_states.shard_tokens",
        )
    )
    spec = machine.spec
    tokens = inputs.workload.tokens
    chosen = {c.setting: c.value for c in inputs.choices}
    window = (
        hs.rolling_window_shards
        if hs.rolling_window_shards != "auto"
        else chosen.get("hidden_states.rolling_window_shards")
    )
    # rolling: the eval tokens once here, the train tokens once per epoch in eagle3_drafter's windows
    passes = (
        1.0
        if window is None
        else config.training_data.eval_fraction + (1 - config.training_data.eval_fraction) * config.drafter.epochs
    )
    rolling = "" if window is None else f" × {passes:.2f} (rolling: the train tokens once per epoch)"
    if tokens is not None and inputs.extraction_rate:
        phase.time_s = tokens * passes / inputs.extraction_rate
        phase.time_basis = (
            f"measured: {tokens:,} tokens{rolling} / {inputs.extraction_rate:,.0f} tokens/s of the last extraction"
        )
    elif tokens is not None and spec is not None and machine.gpus:
        active = _active_params(inputs)
        rate_flops = machine.gpus * spec.bf16_tflops * 1e12 * PREFILL_MFU
        phase.time_s = 2 * active * tokens * passes / rate_flops
        phase.time_basis = (
            f"estimate: 2 × {active / 1e9:.1f} B active parameters × {tokens:,} tokens{rolling} at "
            f"{PREFILL_MFU:.0%} of {machine.gpus} × {spec.bf16_tflops:g} TFLOPS bf16"
        )
    if window is not None:
        phase.notes.append(
            "rolling: one target load per window per epoch, each at most serving.startup_timeout_s, not counted"
        )
    return phase


def _store_disk(inputs: Inputs, per_token: int) -> list[Need]:
    config = inputs.config
    hs = config.hidden_states
    tokens = inputs.workload.tokens
    have = inputs.machine.disk_bytes
    if tokens is None:
        return [Need("disk", None, have, f"the store's tokens are unknown ({inputs.workload.basis})")]
    store = tokens * per_token * hs.disk_margin
    eval_tokens = tokens * config.training_data.eval_fraction
    hidden = int(text_config(inputs.raw)["hidden_size"])
    batch = hs.batch_tokens if isinstance(hs.batch_tokens, int) else AUTO_BATCH_TOKENS[-1]
    if config.compute.kind == "command":
        transient, what = tokens * specforge_bytes_per_token(hidden), "SpecForge's output beside it until imported"
    elif hs.backend == "vllm":
        transient, what = batch * vllm_file_bytes_per_token(hidden), "the connector's files of one batch"
    else:
        transient, what = 0, ""
    window = hs.rolling_window_shards
    if window == "auto":
        if config.compute.kind == "command":
            inputs.choices.append(
                Choice("hidden_states.rolling_window_shards", None, "compute.kind command extracts a whole store: off")
            )
            window = None
        elif have is None or store <= have:
            inputs.choices.append(
                Choice(
                    "hidden_states.rolling_window_shards",
                    None,
                    "the whole store fits the disk (or the disk is unknown): off",
                )
            )
            window = None
        else:
            room = (have - inputs.checkpoints_disk() - transient) / hs.disk_margin / per_token - eval_tokens
            chosen = int(room // hs.shard_tokens) - 1
            if chosen < 1:
                return [
                    Need(
                        "disk",
                        (eval_tokens + 2 * hs.shard_tokens) * per_token * hs.disk_margin,
                        have,
                        "even one rolling window (the eval shards + 2 shards) does not fit",
                        "machine.disk_free_gib / training_data.eval_fraction / hidden_states.shard_tokens",
                    )
                ]
            inputs.choices.append(
                Choice(
                    "hidden_states.rolling_window_shards",
                    chosen,
                    f"the whole store ({store / GIB:,.0f} GiB with the margin) exceeds the free disk "
                    f"({have / GIB:,.0f} GiB): the largest window it holds; each epoch re-extracts the train tokens",
                )
            )
            window = chosen
    if isinstance(window, int):
        peak = (eval_tokens + (window + 1) * hs.shard_tokens) * per_token * hs.disk_margin + transient
        inputs.store_peak = peak - transient
        detail = f"rolling, {window} shards a window: the eval shards + {window + 1} shards × {per_token:,} B/token"
        return [
            Need("disk", peak, have, detail + (f" + {what}" if what else ""), "hidden_states.rolling_window_shards")
        ]
    inputs.store_peak = store
    return [
        Need(
            "disk",
            store + transient,
            have,
            f"the store: {tokens:,} tokens × {per_token:,} B/token × {hs.disk_margin:g} ({inputs.workload.basis})"
            + (f" + {what}" if what else ""),
            "hidden_states.rolling_window_shards (auto chooses a window) / hidden_states.storage_dtype float8_e4m3",
        )
    ]


def _store_per_token(inputs: Inputs) -> int:
    from eagle3_pipeline.hidden_states.store import bytes_per_token

    aux = len(inputs.config.hidden_states.aux_layer_ids or (0, 0, 0))
    hidden = int(text_config(inputs.raw)["hidden_size"])
    return bytes_per_token(hidden, aux, inputs.config.hidden_states.storage_dtype)


def train_memory(config: PipelineConfig, raw: Mapping[str, Any], checkpointing: bool, tokens: int) -> float:
    """Peak GPU memory of one training step of ``tokens`` padded tokens (fit + formula, module doc)."""
    trained, frozen, _, _ = draft_shape(config, raw)
    draft = _draft(config, raw)
    width, vocab = TRAIN_KIB_PER_TOKEN[checkpointing]
    steps = config.drafter.ttt_steps / TRAIN_FIT_STEPS
    scaled = width * draft.hidden_size / TRAIN_FIT_HIDDEN + vocab * draft.draft_vocab_size / TRAIN_FIT_VOCAB
    per_token = 1024 * (scaled * steps + (TRAIN_CHECKPOINTING_KIB if checkpointing else 0.0))
    return trained * TRAIN_BYTES_PER_PARAM + frozen + CUDA_SLACK + per_token * tokens


def _drafter(inputs: Inputs) -> PhaseFit:
    config = inputs.config
    phase = PhaseFit("eagle3_drafter")
    tokens = config.drafter.batch_tokens
    setting = config.drafter.activation_checkpointing
    have = inputs.machine.gpu_bytes * MARGIN if inputs.machine.gpu_bytes else None
    if setting == "auto":
        plain = train_memory(config, inputs.raw, False, tokens)
        checkpointing = have is not None and plain > have
        inputs.choices.append(
            Choice(
                "drafter.activation_checkpointing",
                checkpointing,
                (
                    f"without it a step of {tokens:,} tokens needs {plain / GIB:.1f} GiB of {have / GIB:.1f} GiB"
                    if have is not None
                    else "the GPU's memory is unknown: off"
                ),
            )
        )
    else:
        checkpointing = bool(setting)
    need = train_memory(config, inputs.raw, checkpointing, tokens)
    trained, _, _, _ = draft_shape(config, inputs.raw)
    phase.needs.append(
        Need(
            "gpu",
            need,
            have,
            f"fit: {trained / 1e9:.2f} B trained parameters × {TRAIN_BYTES_PER_PARAM} B + frozen embedding, lm_head + "
            f"activations of {tokens:,} tokens (activation_checkpointing {checkpointing}); each DDP rank holds it all",
            "drafter.batch_tokens / drafter.activation_checkpointing",
        )
    )
    ranks = (
        config.drafter.nproc_per_node if isinstance(config.drafter.nproc_per_node, int) else (inputs.machine.gpus or 1)
    )
    per_token_store = _store_per_token(inputs)
    loaded = (config.hidden_states.shard_tokens + tokens) * per_token_store * ranks
    phase.needs.append(
        Need(
            "host",
            loaded,
            inputs.machine.host_bytes,
            f"formula: each of {ranks} training processes reads one store shard and a batch of states",
            "hidden_states.shard_tokens / drafter.nproc_per_node",
        )
    )
    keep = config.drafter.keep_checkpoints
    store = inputs.store_peak
    phase.needs.append(
        Need(
            "disk",
            inputs.checkpoints_disk() + (store or 0.0),
            inputs.machine.disk_bytes,
            f"formula: {keep} kept checkpoints + 1 being written (fp32 weights and AdamW moments) and the export"
            + (f", beside the hidden-state store's {store / GIB:,.0f} GiB" if store else ""),
            "drafter.keep_checkpoints / hidden_states.rolling_window_shards",
        )
    )
    spec, gpus = inputs.machine.spec, inputs.machine.gpus
    if inputs.workload.tokens is not None and spec and gpus:
        train_tokens = inputs.workload.tokens * (1 - config.training_data.eval_fraction) * config.drafter.epochs
        flops = 6 * trained * train_tokens * config.drafter.ttt_steps * (4 / 3 if checkpointing else 1)
        phase.time_s = flops / (gpus * spec.bf16_tflops * 1e12 * TRAIN_MFU)
        phase.time_basis = (
            f"estimate: 6 × {trained / 1e9:.2f} B × {train_tokens:,.0f} tokens × {config.drafter.ttt_steps} TTT steps "
            f"at {TRAIN_MFU:.0%} of {gpus} × {spec.bf16_tflops:g} TFLOPS"
        )
    return phase


def _eval(inputs: Inputs) -> PhaseFit:
    config = inputs.config
    phase = PhaseFit("drafter_eval")
    trained, frozen, _, _ = draft_shape(config, inputs.raw)
    need = (
        trained * 2
        + frozen
        + CUDA_SLACK
        + train_memory(config, inputs.raw, True, config.drafter.batch_tokens)
        - (trained * TRAIN_BYTES_PER_PARAM + frozen + CUDA_SLACK)
    )
    phase.needs.append(
        _gpu_need(need, inputs.machine, "formula: the draft in bf16, the frozen embedding and lm_head, one batch")
    )
    spec, gpus, tokens = inputs.machine.spec, inputs.machine.gpus, inputs.workload.tokens
    if tokens is not None and spec and gpus:
        eval_tokens = tokens * config.training_data.eval_fraction
        flops = 2 * trained * eval_tokens * config.drafter.ttt_steps
        phase.time_s = flops / (gpus * spec.bf16_tflops * 1e12 * TRAIN_MFU)
        phase.time_basis = (
            f"estimate: forward only, 2 × {trained / 1e9:.2f} B × {eval_tokens:,.0f} eval tokens × "
            f"{config.drafter.ttt_steps} TTT steps at {TRAIN_MFU:.0%} of {gpus} × {spec.bf16_tflops:g} TFLOPS"
        )
    return phase


def _drafter_server(inputs: Inputs, name: GpuPhase) -> PhaseFit:
    config = inputs.config
    phase = PhaseFit(name)
    serving = config.serving
    if not serving.managed:
        phase.notes.append("the server is the user's: not modelled")
        return phase
    _, _, kv, served = draft_shape(config, inputs.raw)
    draft = DraftShape(served, kv)
    fit = _serving(inputs, serving.engine, serving.tp_size, serving.extra_args, draft)
    phase.needs += _serving_needs(fit, "--mem-fraction-static in serving.extra_args")
    bench = config.drafter_benchmark
    if name == "drafter_benchmark" and bench is not None:
        rates = [_decode_rate(inputs, serving.tp_size, c) for c in bench.concurrencies]
        if all(rates):
            arms = bench.max_server_starts  # at most: the sweep may list fewer configurations
            pairs = zip(bench.concurrencies, rates, strict=True)
            seconds = [max(bench.prompts, c) * bench.max_tokens / r[0] for c, r in pairs if r]
            phase.time_s = arms * sum(seconds)
            phase.time_basis = (
                f"estimate: at most {arms} arms × {bench.prompts} prompts × {bench.max_tokens} tokens at each of "
                f"concurrencies {bench.concurrencies} at the decode rate there (the server starts not counted)"
            )
    return phase


def fit_report(
    config: PipelineConfig,
    raw: Mapping[str, Any],
    weights: Weights,
    machine: Machine,
    workload: Workload,
    extraction_rate: float | None = None,
) -> FitReport:
    """The fit of every GPU phase of ``config`` (module doc), in the phase table's order."""
    inputs = Inputs(config, raw, weights, machine, workload, extraction_rate)
    builders = {
        "responses": lambda: _responses(inputs),
        "hidden_states": lambda: _hidden_states(inputs, _store_per_token(inputs)),
        "eagle3_drafter": lambda: _drafter(inputs),
        "drafter_eval": lambda: _eval(inputs),
        "drafter_benchmark": lambda: _drafter_server(inputs, "drafter_benchmark"),
        "served_drafter": lambda: _drafter_server(inputs, "served_drafter"),
    }
    phases = []
    for row in PHASES:
        if row.phase == "drafter_benchmark" and config.drafter_benchmark is None:
            continue
        if row.phase == "served_drafter" and not (config.serving.managed and config.serving.serve_drafter):
            continue
        phases.append(builders[row.phase]())
    notes = list(weights.notes)
    if re.search(r"int4|nvfp4|mxfp4", weights.quantization):
        notes.append(f"{weights.quantization}: time estimates count bf16 compute on dequantized weights")
    return FitReport(machine, phases, inputs.choices, weights.basis, notes)
