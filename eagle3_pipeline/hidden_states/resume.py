"""What a hidden-state store already holds for the `extract` phase, and what is left: the store's
identity against the spec's, the complete shards kept, the disk checked for the rest, leftovers
removed; a finished store's recorded result (so that a rerun opens no state source); a trained
rolling window's shards deleted."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.hidden_states.capture import target_identity
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError, ExtractSpec, aux_layer_ids
from eagle3_pipeline.hidden_states.sharding import (
    ROLLING_LAYOUT_FILE,
    ShardAssignment,
    rolling_layout,
    write_assignment,
    write_rolling_layout,
)
from eagle3_pipeline.hidden_states.store import (
    HiddenStateStore,
    StoreError,
    StoreManifest,
    identity_mismatch,
)
from eagle3_pipeline.target.folder import TargetError
from eagle3_pipeline.training_data.reader import TrainingData

# The metadata of the run that completed the store, with the settings its checks ran under
# (:func:`finished_result`); removed before a run changes the store.
RESULT_FILE = "result.json"
GB = 1e9


def recorded_rate(store: Path) -> float | None:
    """The tokens/s the last extraction into ``store`` recorded in its result file (None: none recorded)."""
    try:
        rate = float(json.loads((Path(store) / RESULT_FILE).read_text())["metadata"]["tokens_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rate if rate > 0 else None


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
            f"the phase will write about {estimate} bytes "
            f"({estimate / GB:.2f} GB: {tokens} tokens × {per_token} bytes/token) "
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


def _shard_reusable(store: HiddenStateStore, shard: ShardAssignment) -> bool:
    import pyarrow.parquet as pq

    if not store.shard_complete(shard.name):
        return False
    ids = (
        pq.read_table(store.root / f"{shard.name}.index.parquet", columns=["sample_id"]).column("sample_id").to_pylist()
    )
    return tuple(ids) == shard.sample_ids


def _remove_torn(store: HiddenStateStore) -> None:
    for path in store.root.glob(".shard-*.tmp"):
        path.unlink()


def _remove_leftovers(store: HiddenStateStore, assigned: Sequence[ShardAssignment]) -> None:
    """Delete torn temporaries, shards outside the assignment and the index of an earlier one."""
    names = {s.name for s in assigned}
    _remove_torn(store)
    for path in store.root.glob("shard-*"):
        if path.name.split(".")[0] not in names:
            path.unlink()
    store.index_path.unlink(missing_ok=True)


def _checked_with(settings: ExtractSpec) -> dict[str, Any]:
    """The settings a recorded result holds only under: its checks' and the layout's (rolling mode)."""
    return settings.model_dump(
        include={"spot_check_samples", "spot_check_tolerance", "validation", "rolling_window_shards"}
    )


def finished_result(
    settings: ExtractSpec, data: TrainingData, assigned: list[ShardAssignment]
) -> dict[str, Any] | None:
    """The recorded metadata of the run that completed the store, when this run has nothing left to do:
    the store's identity is the one these settings and rows give (the target's from its config.json
    alone), it holds exactly the assigned shards, each complete with its assigned samples, and its
    result was recorded under the same check settings. None otherwise, and when it cannot be told here
    (the target's config or the shards not on this machine). No state source is opened for it."""
    store = HiddenStateStore(Path(settings.output))
    result = store.root / RESULT_FILE
    if settings.shards is not None or not (result.is_file() and store.manifest_path.is_file()):
        return None
    try:
        identity = target_identity(settings.model, settings.target_name)
        found = store.manifest()
        recorded = json.loads(result.read_text())
    except (TargetError, StoreError, OSError, ValueError):
        return None
    wanted = StoreManifest(identity, aux_layer_ids(settings, identity), data.version(), dtype=settings.storage_dtype)
    selected = selected_shards(settings, assigned)
    same = (
        not identity_mismatch(found, wanted)
        and found.shards == [s.name for s in selected]
        and recorded.get("checked_with") == _checked_with(settings)
        and store.index_path.is_file()
        and (settings.rolling_window_shards is None or (store.root / ROLLING_LAYOUT_FILE).is_file())
    )
    return recorded["metadata"] if same and all(_shard_reusable(store, s) for s in selected) else None


def record_result(store: HiddenStateStore, settings: ExtractSpec, meta: dict[str, Any]) -> None:
    completed = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tmp = store.root / f".{RESULT_FILE}.tmp"
    tmp.write_text(
        json.dumps({"checked_with": _checked_with(settings), "metadata": {**meta, "completed_at": completed}})
    )
    tmp.replace(store.root / RESULT_FILE)


def on_disk(store: HiddenStateStore) -> dict[str, int]:
    """The shard tensor files in the store now (rolling mode reports its disk peak from these)."""
    files = list(store.root.glob("shard-*.safetensors"))
    return {"shard_files_on_disk": len(files), "shard_bytes_on_disk": sum(p.stat().st_size for p in files)}


def delete_shards(store: HiddenStateStore, names: Sequence[str], report: Reporter) -> dict[str, Any]:
    """Remove a trained rolling window's shard files (index first: a kill midway leaves an incomplete
    shard, which is never reused). A shard the store's index holds (an eval shard) is refused."""
    kept = set(store.manifest().shards) if store.manifest_path.is_file() else set()
    refused = sorted(set(names) & kept)
    if refused:
        raise ExtractionError(
            f"{store.root}: refusing to delete {refused}: the store's index holds them "
            "(they are not a rolling window's)"
        )
    for name in names:
        for suffix in (".index.parquet", ".safetensors"):
            (store.root / f"{name}{suffix}").unlink(missing_ok=True)
    report.log(
        f"extract: deleted {len(names)} trained shard(s) {names[0] if names else ''}…{names[-1] if names else ''}"
    )
    return {"shards_deleted": len(names), **on_disk(store)}


def prepare_store(
    store: HiddenStateStore,
    wanted: StoreManifest,
    *,
    assigned: list[ShardAssignment],
    selected: list[ShardAssignment],
    data: TrainingData,
    settings: ExtractSpec,
    per_token: int,
) -> tuple[list[str], list[str], dict[str, int]]:
    """The writer's part before extracting ``selected``: identity, reusable shards, disk, manifest,
    leftovers, the shard assignment (rolling: the layout, and the disk for one window too; a window: disk only)."""
    state = _store_state(store, wanted, settings.overwrite)
    window = settings.shards is not None
    if not window:
        (store.root / RESULT_FILE).unlink(missing_ok=True)
    if window and state != "same":
        raise ExtractionError(
            f"{store.root}: no hidden-state store of these settings to extract a rolling window into; "
            "materialize hidden_states first"
        )
    reused = [s for s in selected if state == "same" and _shard_reusable(store, s)]
    todo = [s for s in selected if s not in reused]
    tokens = sum(s.tokens for s in todo)
    layout = None
    if settings.rolling_window_shards is not None and not window:
        layout = rolling_layout(data, assigned, settings.rolling_window_shards)
        by_name = {s.name: s.tokens for s in assigned}
        tokens += max((sum(by_name[n] for n in w) for w in layout.windows), default=0)
    disk = check_disk(store.root, tokens, per_token, settings.disk_margin)
    if window:
        _remove_torn(store)
    else:
        store.write_manifest(wanted)
        _remove_leftovers(store, assigned if state == "same" else [])
        write_assignment(store.root, settings.shard_tokens, assigned, None if layout is None else layout.eval_shards)
    if layout is not None:
        write_rolling_layout(store.root, layout)
    elif not window:
        (store.root / ROLLING_LAYOUT_FILE).unlink(missing_ok=True)  # a whole store: no layout of an earlier rolling one
    return [s.name for s in reused], [s.name for s in todo], disk


def selected_shards(settings: ExtractSpec, assigned: list[ShardAssignment]) -> list[ShardAssignment]:
    """The shards this run extracts: a window's, rolling mode's eval shards, or all."""
    if settings.shards is not None:
        return [s for s in assigned if s.name in settings.shards]
    if settings.rolling_window_shards is not None:
        return [s for s in assigned if s.split == "eval"]
    return assigned
