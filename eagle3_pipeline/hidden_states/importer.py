"""The ``import-specforge`` phase: SpecForge's offline hidden states → our store (C3).

Reads the per-sample files SpecForge's ``prepare_hidden_states.py`` writes and writes them with the
extractor's own :class:`ShardWriter` (byte-identical tensors for the same samples), naming each sample
by our ``training_data`` row where it is given and checking its ids; a finished shard is skipped on a
rerun. The spec and SpecForge's format: hidden_states/DESIGN.md "Importing SpecForge's states".
"""

from __future__ import annotations

import gzip
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.hidden_states.store import (
    BF16,
    STORAGE_DTYPES,
    HiddenStateStore,
    ShardWriter,
    StoreError,
    StoreManifest,
    TargetIdentity,
    bytes_per_token,
    default_aux_layer_ids,
    identity_mismatch,
    shard_name,
)
from eagle3_pipeline.training_data.reader import SPLITS, TrainingData

DEFAULT_SAMPLES_PER_SHARD = 256
_FILE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
_KEYS = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")


class SpecForgeImportError(StoreError):
    """SpecForge files or a spec that cannot be imported; the message names the file or key."""


@dataclass(frozen=True)
class _Row:
    sample_id: str
    dataset: str
    split: str
    input_ids: list[int] | None
    loss_mask: list[int] | None


def find_samples(input_dir: Path) -> list[tuple[int, Path]]:
    """``(idx, file)`` of every SpecForge sample under ``input_dir``, by idx."""
    if not input_dir.is_dir():
        raise SpecForgeImportError(f"{input_dir}: no SpecForge output folder (expected rows_*/data_*.ckpt files)")
    found: dict[int, Path] = {}
    for path in sorted(input_dir.glob("rows_*/data_*.ckpt*")):
        match = _FILE.match(path.name)
        if match is None:
            continue
        idx = int(match.group(1))
        if idx in found:
            raise SpecForgeImportError(f"sample {idx} appears twice: {found[idx]} and {path}")
        found[idx] = path
    if not found:
        raise SpecForgeImportError(f"{input_dir}: no rows_*/data_*.ckpt or .ckpt.gz file")
    return sorted(found.items())


def load_sample(path: Path) -> dict[str, Any]:
    """One SpecForge sample as ``{input_ids [T], loss_mask [T], aux [T, 3H], hidden [T, H]}``."""
    import torch

    try:
        data = path.read_bytes()  # one read: streams from network filesystems and pipes alike
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
        raw = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported with its name
        raise SpecForgeImportError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc})") from None
    if not isinstance(raw, Mapping) or any(key not in raw for key in _KEYS):
        have = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
        raise SpecForgeImportError(f"{path}: expected a dict with keys {', '.join(_KEYS)}, got {have}")
    ids, mask = raw["input_ids"].reshape(-1), raw["loss_mask"].reshape(-1)
    aux, hidden = raw["aux_hidden_state"], raw["hidden_state"]
    if aux.dim() == 3 and aux.shape[0] == 1:
        aux = aux[0]
    if hidden.dim() == 3 and hidden.shape[0] == 1:
        hidden = hidden[0]
    if aux.dim() != 2 or hidden.dim() != 2:
        raise SpecForgeImportError(
            f"{path}: expected aux_hidden_state [1, T, 3H] and hidden_state [1, T, H], got "
            f"{list(raw['aux_hidden_state'].shape)} and {list(raw['hidden_state'].shape)}"
        )
    lengths = {ids.shape[0], mask.shape[0], aux.shape[0], hidden.shape[0]}
    if len(lengths) != 1:
        raise SpecForgeImportError(
            f"{path}: token counts differ (input_ids {ids.shape[0]}, loss_mask {mask.shape[0]}, aux "
            f"{aux.shape[0]}, hidden {hidden.shape[0]})"
        )
    return {"input_ids": ids, "loss_mask": mask, "aux": aux, "hidden": hidden}


class _TrainingRows:
    """Row ``idx`` of the training_data shards (train then eval, in the given order), one shard's
    columns in memory at a time."""

    def __init__(self, files: Sequence[str]) -> None:
        self._files = [Path(f) for f in files]
        self._starts: list[int] = []
        total = 0
        for path in self._files:
            if not path.is_file():
                raise SpecForgeImportError(f"spec.training_data: {path} does not exist")
            self._starts.append(total)
            total += pq.ParquetFile(path).metadata.num_rows
        self.total = total
        self._loaded: tuple[int, dict[str, list[Any]]] | None = None

    def row(self, idx: int) -> _Row:
        if not 0 <= idx < self.total:
            raise SpecForgeImportError(f"SpecForge sample {idx} has no row in spec.training_data ({self.total} rows)")
        number = max(i for i, start in enumerate(self._starts) if start <= idx)
        if self._loaded is None or self._loaded[0] != number:
            path = self._files[number]
            columns = pq.read_table(path, columns=["id", "dataset", "input_ids", "loss_mask"]).to_pydict()
            self._loaded = (number, columns)
        columns = self._loaded[1]
        at = idx - self._starts[number]
        split = "eval" if self._files[number].name.startswith("eval-") else "train"
        return _Row(
            columns["id"][at], columns["dataset"][at], split, columns["input_ids"][at], columns["loss_mask"][at]
        )


def _required(spec: Mapping[str, Any], key: str) -> Any:
    if key not in spec:
        raise SpecForgeImportError(
            f"spec: missing key {key!r} (the import-specforge phase needs input_dir, output_dir, target, "
            "aux_layer_ids, training_data_version)"
        )
    return spec[key]


def _manifest(spec: Mapping[str, Any]) -> StoreManifest:
    target = _required(spec, "target")
    try:
        identity = TargetIdentity(**target)
    except TypeError as exc:
        raise SpecForgeImportError(
            f"spec.target: expected name, config_sha256, num_layers, hidden_size, vocab_size ({exc})"
        ) from None
    layers = _required(spec, "aux_layer_ids")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise SpecForgeImportError(f"spec.aux_layer_ids: expected a list of layer ids, got {layers!r}")
    dtype = spec.get("storage_dtype", BF16)
    if dtype not in STORAGE_DTYPES:
        raise SpecForgeImportError(f"spec.storage_dtype: expected one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
    return StoreManifest(
        target=identity,
        aux_layer_ids=layers,
        training_data_version=str(_required(spec, "training_data_version")),
        dtype=dtype,
    )


def spec_from_extract(extract: Mapping[str, Any], input_dir: str) -> dict[str, Any]:
    """The import spec for SpecForge's output (``input_dir``) of the work ``extract`` (an
    `extract` spec) describes: output folder, target identity from the target's ``config.json``
    (:func:`~eagle3_pipeline.hidden_states.capture.target_identity`, the function the extractor's
    identity comes from), aux ids (``aux_layer_ids`` or the EAGLE-3 default for the target's
    depth), the ``training_data`` version and its shard files, train then eval, in manifest order
    (the order SpecForge must be given their rows)."""
    from eagle3_pipeline.hidden_states.capture import check_layer_ids, target_identity
    from eagle3_pipeline.hidden_states.extract_spec import parse_spec

    settings = parse_spec(dict(extract))
    identity = target_identity(settings.model, settings.target_name)
    aux_ids = settings.aux_layer_ids or default_aux_layer_ids(identity.num_layers)
    check_layer_ids(aux_ids, identity.num_layers)
    data = TrainingData.open(Path(settings.training_data))
    return {
        "input_dir": input_dir,
        "output_dir": settings.output,
        "target": asdict(identity),
        "aux_layer_ids": list(aux_ids),
        "training_data_version": data.version(),
        "training_data": [str(path) for split in SPLITS for path in data.shard_files(split)],
        "storage_dtype": settings.storage_dtype,
    }


def run(spec: dict[str, Any], report: Reporter) -> dict[str, Any]:
    """Import a SpecForge offline folder into a hidden-state store; returns the metadata."""
    if "extract" in spec:
        extra = {key: value for key, value in spec.items() if key not in ("extract", "input_dir")}
        spec = {**spec_from_extract(spec["extract"], str(_required(spec, "input_dir"))), **extra}
    input_dir, output_dir = Path(_required(spec, "input_dir")), Path(_required(spec, "output_dir"))
    per_shard = int(spec.get("samples_per_shard", DEFAULT_SAMPLES_PER_SHARD))
    if per_shard <= 0:
        raise SpecForgeImportError(f"spec.samples_per_shard: expected > 0, got {per_shard}")
    wanted = _manifest(spec)
    store = _open_store(output_dir, wanted)
    samples = find_samples(input_dir)
    rows = _TrainingRows(spec["training_data"]) if spec.get("training_data") else None
    groups = [samples[i : i + per_shard] for i in range(0, len(samples), per_shard)]
    report.log(
        f"importing {len(samples)} SpecForge samples from {input_dir} into {len(groups)} shard(s) under {output_dir}"
    )
    names, skipped, disagreements, tokens, total_bytes = [], 0, 0, 0, 0
    for number, group in enumerate(groups):
        name = shard_name(number)
        names.append(name)
        if store.shard_complete(name):
            skipped += 1
        else:
            disagreements += _write_shard(output_dir, number, group, wanted, rows)
        tokens += sum(
            pq.read_table(output_dir / f"{name}.index.parquet", columns=["length"]).column("length").to_pylist()
        )
        total_bytes += (output_dir / f"{name}.safetensors").stat().st_size
        report.progress(
            {
                "shards_done": number + 1,
                "shards_total": len(groups),
                "samples": sum(len(g) for g in groups[: number + 1]),
                "tokens": tokens,
            }
        )
    index = store.write_index(names)
    final = StoreManifest(
        target=wanted.target,
        aux_layer_ids=wanted.aux_layer_ids,
        training_data_version=wanted.training_data_version,
        dtype=wanted.dtype,
        shards=names,
        samples=index.num_rows,
        tokens=tokens,
        bytes=total_bytes,
    )
    store.write_manifest(final)
    expected = rows.total if rows is not None else samples[-1][0] + 1
    missing = expected - len(samples)
    report.log(
        f"imported {index.num_rows} samples, {tokens} tokens, {total_bytes} bytes in {len(names)} shard(s) ({skipped} "
        f"already done); {missing} sample(s) without states"
    )
    return {
        "store": str(output_dir),
        "source": str(input_dir),
        "shards": len(names),
        "shards_skipped": skipped,
        "samples_without_states": missing,
        "loss_mask_disagreements": disagreements,
        **_store_metadata(final),
    }


def _open_store(output_dir: Path, wanted: StoreManifest) -> HiddenStateStore:
    """The store at ``output_dir``, refused when it was made under other settings, with ``wanted``'s manifest."""
    store = HiddenStateStore(output_dir)
    if store.manifest_path.is_file():
        differences = identity_mismatch(store.manifest(), wanted)
        if differences:
            raise StoreError(
                f"{store.manifest_path}: the store was made under other settings: " + "; ".join(differences)
            )
    store.write_manifest(wanted)
    return store


def _write_shard(
    output_dir: Path, number: int, group: Sequence[tuple[int, Path]], wanted: StoreManifest, rows: _TrainingRows | None
) -> int:
    """One shard from SpecForge's samples; returns how many loss masks differ from training_data's."""
    writer = ShardWriter(output_dir, number, wanted.dtype)
    disagreements = 0
    for idx, path in group:
        sample = load_sample(path)
        _check_widths(path, sample, wanted)
        row, mask, differs = _row_and_mask(path, idx, sample, rows)
        disagreements += differs
        try:
            writer.add(
                row.sample_id,
                row.dataset,
                split=row.split,
                input_ids=sample["input_ids"],
                loss_mask=mask,
                aux=sample["aux"],
                hidden=sample["hidden"],
            )
        except StoreError as exc:
            raise SpecForgeImportError(f"{path}: {exc}") from None
    writer.close()
    return disagreements


def _check_widths(path: Path, sample: Mapping[str, Any], wanted: StoreManifest) -> None:
    hidden = wanted.target.hidden_size
    aux_width = len(wanted.aux_layer_ids) * hidden
    if sample["aux"].shape[1] != aux_width or sample["hidden"].shape[1] != hidden:
        raise SpecForgeImportError(
            f"{path}: expected aux width {aux_width} and hidden {hidden} "
            f"(target.hidden_size × {len(wanted.aux_layer_ids)} layers), got "
            f"{sample['aux'].shape[1]} and {sample['hidden'].shape[1]}"
        )


def _row_and_mask(path: Path, idx: int, sample: Mapping[str, Any], rows: _TrainingRows | None) -> tuple[_Row, Any, int]:
    """The sample's row (training_data's where given, whose ids must be the sample's) and the loss mask to store:
    training_data's over SpecForge's; 1 where the two masks differ."""
    import torch

    mask = sample["loss_mask"]
    if rows is None:
        return _Row(f"specforge-{idx}", "specforge", "train", None, None), mask, 0
    row = rows.row(idx)
    if row.input_ids != sample["input_ids"].tolist():
        raise SpecForgeImportError(
            f"{path}: input_ids differ from training_data row {idx} (sample {row.sample_id}); "
            "SpecForge was given other data or another tokenizer"
        )
    ours = torch.tensor(row.loss_mask, dtype=torch.uint8)
    return row, ours, int(not torch.equal(ours, mask.to(torch.uint8)))


def _store_metadata(final: StoreManifest) -> dict[str, Any]:
    """What the completed store holds, with its bytes per token against the formula's."""
    formula = bytes_per_token(final.target.hidden_size, len(final.aux_layer_ids), final.dtype)
    return {
        "samples": final.samples,
        "tokens": final.tokens,
        "bytes": final.bytes,
        "bytes_per_token": round(final.bytes_per_token, 2),
        "bytes_per_token_formula": formula,
        "bytes_per_token_ratio": round(final.bytes_per_token / formula, 4),
        "storage_dtype": final.dtype,
        "layer_convention": final.layer_convention,
        "teacher": final.teacher,
        "aux_layer_ids": list(final.aux_layer_ids),
        "target": final.target.name,
        "target_config_sha256": final.target.config_sha256,
        "target_layers": final.target.num_layers,
        "target_hidden_size": final.target.hidden_size,
        "training_data_version": final.training_data_version,
    }
