"""The `extract` phase: the target's hidden states for every training_data sample, into a store.

``run(spec, report) -> metadata`` (contract C5) is what ``compute: local`` calls in process and
what the worker calls on a GPU host; every path in the spec is a path on the machine it runs on.

In order: open ``training_data`` and compute the shard plan (:mod:`.plan`); load the target and
check the store's identity (a store made under other settings is an error naming the fields, or is
replaced with ``overwrite``); estimate the bytes still to write and refuse when the disk has less
free than that times ``disk_margin``; extract every shard that is not complete (length-sorted,
right-padded batches of at most ``batch_tokens`` padded tokens; one shard in memory at a time);
write the index and the manifest; then re-compute ``spot_check_samples`` samples one by one through
an independent code path and compare (relative L2 error per tensor ≤ ``spot_check_tolerance``).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import HiddenStatesConfig, PipelineConfig
from eagle3_pipeline.hidden_states.capture import Target, batch_states, check_layer_ids, load_target, reference_states
from eagle3_pipeline.hidden_states.inputs import TrainingData, iter_rows
from eagle3_pipeline.hidden_states.plan import PLAN_FILE, PlannedShard, plan_shards, write_plan
from eagle3_pipeline.hidden_states.store import (
    AUX_KEY,
    HIDDEN_KEY,
    IDS_KEY,
    HiddenStateStore,
    ShardWriter,
    StoreError,
    StoreManifest,
    bytes_per_token,
    default_aux_layer_ids,
    identity_mismatch,
)

ROW_COLUMNS = ["id", "dataset", "input_ids", "loss_mask"]
GB = 1e9


class ExtractionError(RuntimeError):
    """The phase cannot (or must not) go on; the message says why and what to change."""


class ExtractSpec(HiddenStatesConfig):
    """The spec of the `extract` phase (JSON): the `hidden_states:` settings plus where things are.
    Paths are on the machine where the phase runs."""

    training_data: str
    output: str
    model: str
    target_name: str
    trust_remote_code: bool = False


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
        from eagle3_pipeline.serving import local_model_dir

        return str(local_model_dir())
    return str(config.target.tokenizer)


def spec_from_config(config: PipelineConfig, training_data: str, output: str, model: str) -> dict[str, Any]:
    """The phase's spec from the pipeline file, with paths as seen where the phase will run."""
    settings = config.hidden_states.model_dump(exclude={"model"})
    return {
        **settings,
        "training_data": training_data,
        "output": output,
        "model": model,
        "target_name": config.target.model,
        "trust_remote_code": config.target.trust_remote_code,
    }


def parse_spec(spec: dict[str, Any]) -> ExtractSpec:
    try:
        return ExtractSpec.model_validate(spec)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ExtractionError(f"extract spec: {problems}") from None


def free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem that holds ``folder`` (or its nearest existing parent)."""
    probe = folder.resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_disk(folder: Path, tokens: int, per_token: int, margin: float) -> dict[str, int]:
    estimate = tokens * per_token
    free = free_bytes(folder)
    if free < estimate * margin:
        raise ExtractionError(
            f"not enough free disk for the hidden states under {folder}: {free} bytes ({free / GB:.2f} GB) free, "
            f"the phase will write about {estimate} bytes ({estimate / GB:.2f} GB: {tokens} tokens × {per_token} bytes/token) "
            f"and needs that × disk_margin {margin} = {estimate * margin / GB:.2f} GB"
        )
    return {"disk_free_bytes": free, "disk_estimate_bytes": estimate}


def _store_state(store: HiddenStateStore, wanted: StoreManifest, overwrite: bool) -> Literal["new", "same", "replace"]:
    """``same``: the folder holds a store of this identity (its complete shards are kept); ``new``:
    no store yet; ``replace``: another store, to be cleared (only with ``overwrite``, else refused)."""
    if store.manifest_path.is_file():
        problems = identity_mismatch(store.manifest(), wanted)
    elif store.root.is_dir() and any(store.root.glob("shard-*")):
        problems = ["it holds shards but no manifest.json"]
    else:
        return "new"
    if problems and not overwrite:
        raise ExtractionError(
            f"{store.root}: the hidden-state store was made under other settings ({'; '.join(problems)}); "
            "set hidden_states.overwrite: true to replace it"
        )
    return "replace" if problems else "same"


def _shard_reusable(store: HiddenStateStore, shard: PlannedShard) -> bool:
    import pyarrow.parquet as pq

    if not store.shard_complete(shard.name):
        return False
    ids = pq.read_table(store.root / f"{shard.name}.index.parquet", columns=["sample_id"]).column("sample_id").to_pylist()
    return tuple(ids) == shard.sample_ids


def _remove_leftovers(store: HiddenStateStore, planned: Sequence[PlannedShard]) -> None:
    """Delete torn temporaries, shards outside the plan and the index of an earlier plan."""
    names = {s.name for s in planned}
    for path in store.root.glob(".shard-*.tmp"):
        path.unlink()
    for path in store.root.glob("shard-*"):
        if path.name.split(".")[0] not in names:
            path.unlink()
    store.index_path.unlink(missing_ok=True)


class _Rows:
    """Reads planned rows in plan order, keeping one training_data shard's reader open."""

    def __init__(self, data: TrainingData) -> None:
        self.data = data
        self.source: str | None = None
        self.position = 0
        self.rows: Any = iter(())

    def take(self, shard: PlannedShard) -> list[dict[str, Any]]:
        if shard.source != self.source or shard.start != self.position:
            self.rows = iter_rows(self.data.folder / shard.source, ROW_COLUMNS, shard.start)
            self.source, self.position = shard.source, shard.start
        taken = [next(self.rows) for _ in shard.sample_ids]
        self.position += len(taken)
        found = tuple(r["id"] for r in taken)
        if found != shard.sample_ids:
            raise ExtractionError(f"{self.data.folder / shard.source}: rows changed while extracting {shard.name}; rerun")
        return taken


def batches(lengths: Sequence[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Indices grouped longest first, each group's padded size (count × longest) ≤ batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for index in order:
        if groups and len(groups[-1]) < max_batch_size and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def extract_shard(store: HiddenStateStore, target: Target, spec: ExtractSpec, aux_ids: Sequence[int], shard: PlannedShard, rows: list[dict[str, Any]]) -> int:
    """Extract one planned shard and write it; returns its tensor file's size."""
    import torch

    states: dict[int, tuple[Any, Any]] = {}
    for group in batches([len(r["input_ids"]) for r in rows], spec.batch_tokens, spec.max_batch_size):
        for index, (aux, hidden) in zip(group, batch_states(target, aux_ids, [rows[i]["input_ids"] for i in group]), strict=True):
            states[index] = (aux.to("cpu", torch.bfloat16), hidden.to("cpu", torch.bfloat16))
    writer = ShardWriter(store.root, int(shard.name.split("-")[1]))
    for index, row in enumerate(rows):
        aux, hidden = states.pop(index)
        ids = torch.tensor(row["input_ids"], dtype=torch.int32)
        mask = torch.tensor(row["loss_mask"], dtype=torch.uint8)
        try:
            writer.add(row["id"], row["dataset"], shard.split, ids, mask, aux, hidden)
        except StoreError as exc:
            raise ExtractionError(
                f"{shard.name} ({shard.split}, {shard.source} row {shard.start + index}): {exc}; the shard is not written"
            ) from None
    return writer.close()


def _relative_error(found: Any, expected: Any) -> float:
    diff = (found.float() - expected.float()).norm()
    scale = expected.float().norm()
    return float(diff / scale) if float(scale) > 0 else float(diff)


def spot_check_ids(index_ids: Sequence[str], count: int) -> list[str]:
    """A fixed sample of the store's ids: the ``count`` with the smallest SHA-256."""
    return sorted(index_ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:count]


def spot_check(store: HiddenStateStore, target: Target, aux_ids: Sequence[int], count: int, tolerance: float) -> dict[str, Any]:
    """Re-compute ``count`` stored samples alone through :func:`reference_states`; compare in bf16."""
    import torch
    from safetensors import safe_open

    rows = store.index().to_pylist()
    chosen = set(spot_check_ids([r["sample_id"] for r in rows], count))
    worst, worst_id, checked = 0.0, "", 0
    for row in rows:
        if row["sample_id"] not in chosen:
            continue
        start, stop = row["offset"], row["offset"] + row["length"]
        with safe_open(str(store.root / f"{row['shard']}.safetensors"), framework="pt") as handle:
            ids = handle.get_slice(IDS_KEY)[start:stop].long()
            stored_aux = handle.get_slice(AUX_KEY)[start:stop]
            stored_hidden = handle.get_slice(HIDDEN_KEY)[start:stop]
        aux, hidden = reference_states(target, aux_ids, ids.tolist())
        for stored, fresh in ((stored_aux, aux), (stored_hidden, hidden)):
            error = _relative_error(stored, fresh.to("cpu", torch.bfloat16))
            if error > worst:
                worst, worst_id = error, row["sample_id"]
        checked += 1
    return {
        "spot_check_samples": checked,
        "spot_check_max_rel_error": worst,
        "spot_check_worst_sample": worst_id,
        "spot_check_tolerance": tolerance,
        "spot_check_passed": worst <= tolerance,
    }


def run(spec: dict[str, Any], report: Reporter) -> dict[str, Any]:
    """The phase (C5): extract every sample of ``spec['training_data']`` into ``spec['output']``."""
    settings = parse_spec(spec)
    data = TrainingData.open(Path(settings.training_data))
    store = HiddenStateStore(Path(settings.output))
    planned = plan_shards(data, settings.shard_tokens)
    if not planned:
        raise ExtractionError(f"{data.folder}: training_data has no sample")
    target = load_target(settings.model, settings.target_name, settings.device, settings.dtype, settings.trust_remote_code)
    identity = target.identity
    aux_ids = settings.aux_layer_ids or default_aux_layer_ids(identity.num_layers)
    check_layer_ids(aux_ids, identity.num_layers)
    wanted = StoreManifest(target=identity, aux_layer_ids=list(aux_ids), training_data_version=data.version())
    state = _store_state(store, wanted, settings.overwrite)
    reused = [s for s in planned if state == "same" and _shard_reusable(store, s)]
    todo = [s for s in planned if s not in reused]
    per_token = bytes_per_token(identity.hidden_size, len(aux_ids))
    disk = check_disk(store.root, sum(s.tokens for s in todo), per_token, settings.disk_margin)
    store.write_manifest(wanted)
    _remove_leftovers(store, planned if state == "same" else [])
    write_plan(store.root, settings.shard_tokens, planned)
    report.log(
        f"extract: {len(planned)} shards planned, {len(reused)} complete, {len(todo)} to do "
        f"({sum(s.tokens for s in todo)} tokens, ~{disk['disk_estimate_bytes'] / GB:.2f} GB); "
        f"target {identity.name} ({identity.num_layers} layers, H={identity.hidden_size}) on {target.device}/{target.dtype}, "
        f"aux layers {aux_ids} (output-of-layer ids)"
    )
    if reused:
        report.log(f"extract: reusing {', '.join(s.name for s in reused)}")
    rows = _Rows(data)
    started, tokens_now = time.monotonic(), 0
    for number, shard in enumerate(todo, start=1):
        size = extract_shard(store, target, settings, aux_ids, shard, rows.take(shard))
        tokens_now += shard.tokens
        elapsed = time.monotonic() - started
        report.log(f"extract: wrote {shard.name} ({shard.split}, {len(shard.sample_ids)} samples, {shard.tokens} tokens, {size} bytes)")
        report.progress(
            {
                "shards_done": len(reused) + number,
                "shards_planned": len(planned),
                "tokens_done": tokens_now,
                "tokens_per_s": round(tokens_now / elapsed, 1) if elapsed else 0.0,
                "bytes_per_token": round(size / shard.tokens, 1),
            }
        )
    extract_seconds = time.monotonic() - started
    names = [s.name for s in planned]
    index = store.write_index(names)
    total_bytes = sum((store.root / f"{n}.safetensors").stat().st_size for n in names)
    tokens = int(sum(index.column("length").to_pylist()))
    wanted.shards, wanted.samples, wanted.tokens, wanted.bytes = names, index.num_rows, tokens, total_bytes
    store.write_manifest(wanted)
    checked = spot_check(store, target, aux_ids, settings.spot_check_samples, settings.spot_check_tolerance)
    report.log(
        f"extract: spot check of {checked['spot_check_samples']} samples: max relative error "
        f"{checked['spot_check_max_rel_error']:.2e} (tolerance {settings.spot_check_tolerance})"
    )
    splits = index.column("split").to_pylist()
    return {
        "store": str(store.root),
        "samples": index.num_rows,
        "train_samples": splits.count("train"),
        "eval_samples": splits.count("eval"),
        "tokens": tokens,
        "bytes": total_bytes,
        "bytes_per_token": round(wanted.bytes_per_token, 2),
        "bytes_per_token_formula": per_token,
        "bytes_per_token_ratio": round(wanted.bytes_per_token / per_token, 4),
        "shards": len(planned),
        "shards_written": len(todo),
        "shards_reused": len(reused),
        "tokens_extracted_now": tokens_now,
        "extract_seconds": round(extract_seconds, 2),
        "tokens_per_s": round(tokens_now / extract_seconds, 1) if tokens_now and extract_seconds else 0.0,
        "aux_layer_ids": list(aux_ids),
        "layer_convention": wanted.layer_convention,
        "teacher": wanted.teacher,
        "target": identity.name,
        "target_config_sha256": identity.config_sha256,
        "target_layers": identity.num_layers,
        "target_hidden_size": identity.hidden_size,
        "training_data_version": wanted.training_data_version,
        "device": target.device,
        "dtype": target.dtype,
        "plan": str(store.root / PLAN_FILE),
        **disk,
        **checked,
    }
