"""The `extract` phase: the target's hidden states for every training_data sample, into a store.

``run(spec, report) -> metadata`` (contract C5) is what ``compute: local`` calls in process and
what the worker calls on a GPU host; every path in the spec is a path on the machine it runs on.
A store already complete for these settings is returned as recorded, with no state source opened;
else every backend (:mod:`.sources`) goes through the one loop here, shard by shard, resumable, with
the serving target checked before the first shard and a spot check after the last. The order of
the steps, tensor parallelism and rolling mode: hidden_states/DESIGN.md "The extract phase".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import HiddenStatesConfig, PipelineConfig, TargetConfig
from eagle3_pipeline.hidden_states.capture import SampleError, check_layer_ids
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError, ExtractSpec, aux_layer_ids, parse_spec
from eagle3_pipeline.hidden_states.resume import (
    GB,
    delete_shards,
    finished_result,
    free_bytes,
    on_disk,
    prepare_store,
    record_result,
    selected_shards,
)
from eagle3_pipeline.hidden_states.sharding import ASSIGNMENT_FILE, ROLLING_LAYOUT_FILE, ShardAssignment, assign_shards
from eagle3_pipeline.hidden_states.sources import StateSource, decided, open_source
from eagle3_pipeline.hidden_states.spot_check import SPOT_CHECK_TOLERANCE, spot_check
from eagle3_pipeline.hidden_states.store import (
    HiddenStateStore,
    ShardWriter,
    StoreError,
    StoreManifest,
    bytes_per_token,
)
from eagle3_pipeline.hidden_states.validation import validate_first
from eagle3_pipeline.training_data.reader import TrainingData, TrainingDataError, iter_rows

ROW_COLUMNS = ["id", "dataset", "input_ids", "loss_mask"]


def target_weights(config: PipelineConfig) -> str:
    """What transformers loads as the target: `hidden_states.model`, else the embedded model's
    folder (embedded profile) or `target.tokenizer` (endpoints: the served model's repository).
    On a GPU host (`compute.kind` ssh or command) it is read there: the embedded model's folder is
    a path on this machine, so `hidden_states.model` must then name the target's folder there."""
    if config.hidden_states.model:
        return config.hidden_states.model
    if config.inference.kind == "embedded":
        if config.compute.kind != "local":
            raise ExtractionError(
                f"hidden_states.model: required with compute.kind {config.compute.kind!r}: the target model's folder "
                "(or Hugging Face id) on the GPU host; the embedded model's folder is a path on this machine"
            )
        from eagle3_pipeline.target.local_model import local_model_dir

        return str(local_model_dir())
    return str(config.target.tokenizer)


def spec_from_config(
    hidden_states: HiddenStatesConfig,
    target: TargetConfig,
    training_data: str,
    output: str,
    model: str,
    serving_reference: str | None = None,
) -> dict[str, Any]:
    """The phase's spec from the pipeline file's `hidden_states` and `target` sections, with paths as
    seen where the phase will run."""
    settings = hidden_states.model_dump(exclude={"model"})
    return {
        **settings,
        "training_data": training_data,
        "output": output,
        "model": model,
        "target_name": target.model,
        "trust_remote_code": target.trust_remote_code,
        "serving_reference": serving_reference,
    }


class _Rows:
    """Reads the rows assigned to shards in assignment order, keeping one training_data shard's reader open."""

    def __init__(self, data: TrainingData) -> None:
        self.data = data
        self.source: str | None = None
        self.position = 0
        self.rows: Any = iter(())

    def take(self, shard: ShardAssignment) -> list[dict[str, Any]]:
        if shard.source != self.source or shard.start != self.position:
            self.rows = iter_rows(self.data.folder / shard.source, ROW_COLUMNS, shard.start)
            self.source, self.position = shard.source, shard.start
        taken = [next(self.rows) for _ in shard.sample_ids]
        self.position += len(taken)
        found = tuple(r["id"] for r in taken)
        if found != shard.sample_ids:
            raise ExtractionError(
                f"{self.data.folder / shard.source}: rows changed while extracting {shard.name}; rerun"
            )
        return taken


def batches(lengths: Sequence[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Indices grouped longest first, each group's padded size (count × longest) ≤ batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for index in order:
        if (
            groups
            and len(groups[-1]) < max_batch_size
            and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens
        ):
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def extract_shard(
    store: HiddenStateStore,
    source: StateSource,
    spec: ExtractSpec,
    aux_ids: Sequence[int],
    shard: ShardAssignment,
    rows: list[dict[str, Any]],
) -> int:
    """Extract one assigned shard and write it (the writer only); returns its tensor file's size (0 elsewhere)."""
    import torch

    states: dict[int, tuple[Any, Any]] = {}
    for group in batches([len(r["input_ids"]) for r in rows], spec.batch_tokens, spec.max_batch_size):
        try:
            found = source.batch_states(aux_ids, [rows[i]["input_ids"] for i in group])
        except SampleError as exc:
            row = rows[group[exc.index]]
            raise ExtractionError(f"{shard.name} ({shard.split}), sample {row['id']!r}: {exc.message}") from None
        for index, (aux, hidden) in zip(group, found, strict=True):
            states[index] = (aux.to("cpu", torch.bfloat16), hidden.to("cpu", torch.bfloat16))
    if not source.writer:
        return 0
    writer = ShardWriter(store.root, int(shard.name.split("-")[1]), spec.storage_dtype)
    for index, row in enumerate(rows):
        aux, hidden = states.pop(index)
        ids = torch.tensor(row["input_ids"], dtype=torch.int32)
        mask = torch.tensor(row["loss_mask"], dtype=torch.uint8)
        try:
            writer.add(
                row["id"], row["dataset"], split=shard.split, input_ids=ids, loss_mask=mask, aux=aux, hidden=hidden
            )
        except StoreError as exc:
            raise ExtractionError(
                f"{shard.name} ({shard.split}, {shard.source} row {shard.start + index}): {exc}; "
                "the shard is not written"
            ) from None
    return writer.close()


def nothing_to_do(spec: dict[str, Any]) -> bool:
    """Whether the phase with ``spec`` (paths as seen here) would find its store complete
    (:func:`finished_result`): so that a caller asks no server for it. False where it cannot be told here
    (on a GPU host's store only its index and manifest are on this machine)."""
    settings = parse_spec(spec)
    try:
        data = TrainingData.open(Path(settings.training_data))
    except TrainingDataError:
        return False
    return finished_result(settings, data, assign_shards(data, settings.shard_tokens)) is not None


def run(spec: dict[str, Any], report: Reporter, source: StateSource | None = None) -> dict[str, Any]:
    """The phase (C5): extract every sample of ``spec['training_data']`` into ``spec['output']``.
    ``source``: a state source already open in this process, used instead of opening the one the spec
    names (one loaded target for several rolling windows)."""
    settings = parse_spec(spec)
    if settings.delete_shards is not None:
        return delete_shards(HiddenStateStore(Path(settings.output)), settings.delete_shards, report)
    data = TrainingData.open(Path(settings.training_data))
    assigned = assign_shards(data, settings.shard_tokens)
    if not assigned:
        raise ExtractionError(f"{data.folder}: training_data has no sample")
    unknown = sorted(set(settings.shards or []) - {s.name for s in assigned})
    if unknown:
        raise ExtractionError(
            f"extract spec: shards {unknown} are not in the shard assignment of {data.folder} "
            f"at shard_tokens {settings.shard_tokens}"
        )
    if source is not None:
        return _extract(settings, data, assigned, source, report)
    done = finished_result(settings, data, assigned)
    if done is not None:
        report.log(
            f"extract: {settings.output} is complete for these settings ({done['shards']} shards, {done['samples']} "
            f"samples): nothing to extract, no state source opened; its checks as recorded when it was completed "
            f"({done['completed_at']})"
        )
        return {
            **done,
            **_run_figures(0, done["shards"], 0, 0.0),
            "disk_free_bytes": free_bytes(Path(settings.output)),
            "disk_estimate_bytes": 0,
        }
    with open_source(settings) as opened:
        return _extract(settings, data, assigned, opened, report)


def _extract(
    settings: ExtractSpec, data: TrainingData, assigned: list[ShardAssignment], source: StateSource, report: Reporter
) -> dict[str, Any]:
    store = HiddenStateStore(Path(settings.output))
    selected = selected_shards(settings, assigned)
    identity = source.identity
    aux_ids = aux_layer_ids(settings, identity)
    check_layer_ids(aux_ids, identity.num_layers)
    wanted = StoreManifest(
        target=identity,
        aux_layer_ids=list(aux_ids),
        training_data_version=data.version(),
        dtype=settings.storage_dtype,
        capture=source.capture(aux_ids),
    )
    per_token = bytes_per_token(identity.hidden_size, len(aux_ids), settings.storage_dtype)
    # A rolling window extends a store whose hidden_states run already validated the source.
    validated = validate_first(source, settings, data, aux_ids, report) if settings.shards is None else {}
    reused_names, todo_names, disk = decided(
        source,
        lambda: prepare_store(
            store, wanted, assigned=assigned, selected=selected, data=data, settings=settings, per_token=per_token
        ),
    )
    reused = [s for s in assigned if s.name in reused_names]
    todo = [s for s in assigned if s.name in todo_names]
    report.log(
        f"extract: {len(assigned)} shards assigned, {len(selected)} to hold, {len(reused)} complete, {len(todo)} to do "
        f"({sum(s.tokens for s in todo)} tokens, ~{disk['disk_estimate_bytes'] / GB:.2f} GB in "
        f"{settings.storage_dtype}, {per_token} bytes/token); "
        f"target {identity.name} ({identity.num_layers} layers, H={identity.hidden_size}) with {source.describe()}, "
        f"aux layers {aux_ids} (output-of-layer ids)"
    )
    if reused:
        report.log(f"extract: reusing {', '.join(s.name for s in reused)}")
    started = time.monotonic()
    tokens_now = _write_shards(
        store,
        source,
        settings=settings,
        aux_ids=aux_ids,
        data=data,
        todo=todo,
        done_before=len(reused),
        total=len(selected),
        report=report,
    )
    this_run = _run_figures(len(todo), len(reused), tokens_now, time.monotonic() - started)
    if settings.shards is not None:
        return {**this_run, **(on_disk(store) if source.writer else {})}
    names = [s.name for s in selected]
    if source.writer:
        index = store.write_index(names)
        wanted.shards, wanted.samples, wanted.bytes = (
            names,
            index.num_rows,
            sum((store.root / f"{n}.safetensors").stat().st_size for n in names),
        )
        wanted.tokens = int(sum(index.column("length").to_pylist()))
        store.write_manifest(wanted)
    tolerance = settings.spot_check_tolerance or SPOT_CHECK_TOLERANCE[settings.backend]
    checked = spot_check(store, source, aux_ids, settings.spot_check_samples, tolerance, settings.storage_dtype)
    if not source.writer:
        return {"shards_written": len(todo)}
    report.log(
        f"extract: spot check of {checked['spot_check_samples']} samples ({source.spot_check_method}): "
        "max relative error "
        f"{checked['spot_check_max_rel_error']:.2e} (tolerance {tolerance})"
    )
    meta = {
        **_store_figures(
            store, settings, manifest=wanted, index=index, assigned=assigned, shards=len(selected), per_token=per_token
        ),
        **this_run,
        **disk,
        **checked,
        **validated,
    }
    record_result(store, settings, meta)
    return meta


def _write_shards(
    store: HiddenStateStore,
    source: StateSource,
    *,
    settings: ExtractSpec,
    aux_ids: Sequence[int],
    data: TrainingData,
    todo: Sequence[ShardAssignment],
    done_before: int,
    total: int,
    report: Reporter,
) -> int:
    """Extract and write ``todo`` in assignment order, a progress point after each shard; the tokens written."""
    rows = _Rows(data)
    started, tokens_now = time.monotonic(), 0
    for number, shard in enumerate(todo, start=1):
        size = extract_shard(store, source, settings, aux_ids, shard, rows.take(shard))
        tokens_now += shard.tokens
        elapsed = time.monotonic() - started
        report.log(
            f"extract: wrote {shard.name} ({shard.split}, {len(shard.sample_ids)} samples, "
            f"{shard.tokens} tokens, {size} bytes)"
        )
        report.progress(
            {
                "shards_done": done_before + number,
                "shards_total": total,
                "tokens_done": tokens_now,
                "tokens_per_s": round(tokens_now / elapsed, 1) if elapsed else 0.0,
                "bytes_per_token": round(size / shard.tokens, 1),
            }
        )
    return tokens_now


def _run_figures(written: int, reused: int, tokens: int, seconds: float) -> dict[str, Any]:
    """What this run did: shards written and reused, tokens extracted, how long, how fast."""
    return {
        "shards_written": written,
        "shards_reused": reused,
        "tokens_extracted_now": tokens,
        "extract_seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1) if tokens and seconds else 0.0,
    }


def _store_figures(
    store: HiddenStateStore,
    settings: ExtractSpec,
    *,
    manifest: StoreManifest,
    index: Any,
    assigned: Sequence[ShardAssignment],
    shards: int,
    per_token: int,
) -> dict[str, Any]:
    """What the completed store holds: samples, tokens and bytes, the layers and teacher, the target and
    how its states were captured; in rolling mode, the train rows' layout."""
    splits = index.column("split").to_pylist()
    identity = manifest.target
    rolling: dict[str, Any] = {}
    if settings.rolling_window_shards is not None:
        train = [s for s in assigned if s.split == "train"]
        rolling = {
            "rolling_window_shards": settings.rolling_window_shards,
            "rolling_train_shards": len(train),
            "rolling_train_tokens": sum(s.tokens for s in train),
            "rolling_layout": str(store.root / ROLLING_LAYOUT_FILE),
        }
    return {
        "store": str(store.root),
        "samples": index.num_rows,
        "train_samples": splits.count("train"),
        "eval_samples": splits.count("eval"),
        "tokens": manifest.tokens,
        "bytes": manifest.bytes,
        "bytes_per_token": round(manifest.bytes_per_token, 2),
        "bytes_per_token_formula": per_token,
        "bytes_per_token_ratio": round(manifest.bytes_per_token / per_token, 4),
        "storage_dtype": settings.storage_dtype,
        "disk_training_data_bytes": sum(s.tokens for s in assigned) * per_token,
        "shards": shards,
        "aux_layer_ids": list(manifest.aux_layer_ids),
        "layer_convention": manifest.layer_convention,
        "teacher": manifest.teacher,
        "capture": manifest.capture,
        "target": identity.name,
        "target_config_sha256": identity.config_sha256,
        "target_layers": identity.num_layers,
        "target_hidden_size": identity.hidden_size,
        "training_data_version": manifest.training_data_version,
        "backend": settings.backend,
        "device": manifest.capture.get("device", ""),
        "dtype": manifest.capture.get("dtype", ""),
        "shard_assignment": str(store.root / ASSIGNMENT_FILE),
        **rolling,
    }
