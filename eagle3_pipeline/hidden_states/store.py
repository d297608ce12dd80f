"""The hidden-state store: what `hidden_states` writes and the drafter reads (contract C3).

Shards of safetensors (the aux states, the teacher, ids and loss masks; bf16, or fp8 with per-token
scales, read back as bf16 through :class:`ShardFile`), each with its index rows, the whole index, and
a manifest recording the target, the captured layers (output-of-layer ids, :data:`LAYER_CONVENTION`),
the training_data version and how the states were captured. A shard counts only when complete, so a
torn one is redone. The layout and why: hidden_states/DESIGN.md "The store". torch and safetensors are
imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

FORMAT = "eagle3-hidden-states/1"
LAYER_CONVENTION = "output_of_layer"
TEACHER = "final_hidden_post_norm"
AUX_KEY = "aux_hidden_states"
HIDDEN_KEY = "hidden_states"
IDS_KEY = "input_ids"
MASK_KEY = "loss_mask"
AUX_SCALE_KEY = "aux_scales"
HIDDEN_SCALE_KEY = "hidden_scales"
SCALE_KEYS = {AUX_KEY: AUX_SCALE_KEY, HIDDEN_KEY: HIDDEN_SCALE_KEY}
BF16 = "bfloat16"
FP8 = "float8_e4m3"
STORAGE_DTYPES = (BF16, FP8)
BF16_BYTES = 2
FP8_BYTES = 1
SCALE_BYTES = 4
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
ID_AND_MASK_BYTES = 4 + 1
INDEX_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("split", pa.string()),
        ("shard", pa.string()),
        ("offset", pa.int64()),
        ("length", pa.int32()),
        ("num_masked", pa.int32()),
    ]
)


class StoreError(ValueError):
    """A store that is missing, torn or made under other settings than the ones asked for."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 default in the output-of-layer convention: outputs of layers 1, N/2-1, N-4
    (SGLang/vLLM capture the inputs of layers 2, N/2, N-3: the same tensors)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def bytes_per_token(hidden_size: int, aux_layers: int = 3, dtype: str = BF16) -> int:
    """What one token costs on disk: the aux layers and the teacher in the storage dtype (fp8: plus
    one float32 scale per layer and token), plus id and mask."""
    if dtype == BF16:
        return (aux_layers + 1) * hidden_size * BF16_BYTES + ID_AND_MASK_BYTES
    if dtype == FP8:
        return (aux_layers + 1) * (hidden_size * FP8_BYTES + SCALE_BYTES) + ID_AND_MASK_BYTES
    raise StoreError(f"storage dtype {dtype!r}: expected one of {', '.join(STORAGE_DTYPES)}")


def bytes_per_token_check(
    measured: float, hidden_size: int, aux_layers: int, dtype: str, tolerance: float
) -> tuple[bool, str]:
    """Whether a store's measured bytes per token are within ``tolerance`` (relative) of
    :func:`bytes_per_token` for the configured storage ``dtype``, and the sentence that says so
    (a bf16 store where fp8 was asked is twice the formula, an fp8 one where bf16 was asked half)."""
    formula = bytes_per_token(hidden_size, aux_layers, dtype)
    ratio = measured / formula
    passed = abs(ratio - 1) <= tolerance
    text = (
        f"{measured} bytes/token, formula for {dtype} {formula} "
        f"({aux_layers} aux + teacher, hidden {hidden_size}; ratio {ratio:.4f})"
    )
    return passed, text if passed else f"{text}: more than {tolerance:.0%} off; is the store of another storage dtype?"


def quantize_fp8(states: Any, layers: int) -> tuple[Any, Any]:
    """``states`` [N, layers·H] → ``(float8_e4m3fn [N, layers·H], float32 scales [N, layers])``.

    e4m3 is a float (3 mantissa bits, normals from 2⁻⁶ to 448): an element's relative rounding
    (≤ 2⁻⁴) does not depend on the scale as long as it stays above the normal floor, so the scale
    only has to put the largest value at 448. **Per token** (one scale per token and captured layer):
    every token gets the whole range to itself. Per channel, one scale would be set by the largest
    value of the channel over the shard, i.e. by the outlier tokens: on the embedded model the
    largest token's max |x| in the middle aux layer is 299× the median token's (its RMS 154×), so
    the small elements of ordinary tokens would sink into e4m3's subnormals (fewer bits) or to 0.
    Per-token scales also keep a sample's stored bytes independent of the other samples of its
    shard (as batching is: see the extract phase), which a per-shard statistic would not. Cost: 4
    bytes per layer and token (16 of Kimi-K2.5's 28,693)."""
    import torch

    n = states.shape[0]
    grouped = states.detach().to("cpu", torch.float32).reshape(n, layers, -1)
    scales = grouped.abs().amax(dim=-1) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = (grouped / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.reshape(n, -1), scales


def as_stored(states: Any, layers: int, dtype: str) -> Any:
    """``states`` [N, layers·H] as a store of ``dtype`` hands them back (bf16, through fp8 for fp8)."""
    import torch

    if dtype == FP8:
        return dequantize_fp8(*quantize_fp8(states.to(torch.bfloat16), layers))
    return states.detach().to("cpu", torch.bfloat16)


def dequantize_fp8(values: Any, scales: Any) -> Any:
    """The inverse of :func:`quantize_fp8`, in bf16 (what a bf16 store holds)."""
    import torch

    n, layers = scales.shape
    return (values.to(torch.float32).reshape(n, layers, -1) * scales[:, :, None]).reshape(n, -1).to(torch.bfloat16)


def shard_name(number: int) -> str:
    return f"shard-{number:05d}"


@dataclass(frozen=True)
class TargetIdentity:
    name: str
    config_sha256: str
    num_layers: int
    hidden_size: int
    vocab_size: int


@dataclass
class StoreManifest:
    target: TargetIdentity
    aux_layer_ids: list[int]
    training_data_version: str
    layer_convention: str = LAYER_CONVENTION
    teacher: str = TEACHER
    dtype: str = "bfloat16"
    format: str = FORMAT
    shards: list[str] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    # How the states were computed (the backend, and what it was told): a record, not part of the
    # identity, as the device and compute dtype are not (a store may be resumed by another backend).
    capture: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0

    def identity(self) -> dict[str, Any]:
        """What must match for a store to be reused: target, layers, convention, teacher, data."""
        return {
            "format": self.format,
            "target": asdict(self.target),
            "aux_layer_ids": list(self.aux_layer_ids),
            "layer_convention": self.layer_convention,
            "teacher": self.teacher,
            "dtype": self.dtype,
            "training_data_version": self.training_data_version,
        }

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "bytes_per_token": round(self.bytes_per_token, 2)}, indent=2)

    @classmethod
    def from_json(cls, text: str, where: str) -> StoreManifest:
        try:
            raw = json.loads(text)
            raw.pop("bytes_per_token", None)
            raw["target"] = TargetIdentity(**raw["target"])
            return cls(**raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{where}: not a hidden-state manifest ({type(exc).__name__}: {exc})") from None


def identity_mismatch(found: StoreManifest, wanted: StoreManifest) -> list[str]:
    """Each field of the identity that differs, with both values; empty when they match."""
    a, b = found.identity(), wanted.identity()
    return [f"{key}: store has {a[key]!r}, expected {b[key]!r}" for key in a if a[key] != b[key]]


@dataclass(frozen=True)
class HiddenSample:
    """One sample's tensors (torch): ids [T], mask [T], aux [T, 3H], hidden [T, H]."""

    sample_id: str
    dataset: str
    split: str
    input_ids: Any
    loss_mask: Any
    aux_hidden_states: Any
    hidden_states: Any


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


class ShardFile:
    """One shard's tensors read by token range; fp8 states come back dequantized to bf16 (a shard
    says its storage by holding scale tensors), so no reader depends on the storage dtype."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self._handle = safe_open(str(path), framework="pt")
        self._keys = set(self._handle.keys())
        self._slices: dict[str, Any] = {}

    def _slice(self, key: str) -> Any:
        if key not in self._slices:
            if key not in self._keys:
                raise StoreError(f"{self.path}: no tensor {key!r} (holds {', '.join(sorted(self._keys))})")
            self._slices[key] = self._handle.get_slice(key)
        return self._slices[key]

    @property
    def dtype(self) -> str:
        return FP8 if AUX_SCALE_KEY in self._keys else BF16

    def read(self, key: str, start: int, stop: int) -> Any:
        """Tokens ``[start, stop)`` of ``key``; states in bf16 whatever the storage dtype."""
        piece = self._slice(key)[start:stop]
        scale_key = SCALE_KEYS.get(key)
        if scale_key is not None and scale_key in self._keys:
            return dequantize_fp8(piece, self._slice(scale_key)[start:stop])
        return piece


class ShardWriter:
    """Collects samples for one shard and writes it atomically (tensors first, then its index)."""

    def __init__(self, root: Path, number: int, dtype: str = BF16) -> None:
        if dtype not in STORAGE_DTYPES:
            raise StoreError(f"storage dtype {dtype!r}: expected one of {', '.join(STORAGE_DTYPES)}")
        self.root = root
        self.dtype = dtype
        self.name = shard_name(number)
        self._ids: list[Any] = []
        self._masks: list[Any] = []
        self._aux: list[Any] = []
        self._hidden: list[Any] = []
        self._rows: list[dict[str, Any]] = []
        self.tokens = 0

    def add(
        self, sample_id: str, dataset: str, *, split: str, input_ids: Any, loss_mask: Any, aux: Any, hidden: Any
    ) -> None:
        """Tensors on any device/dtype; stored as int32 / uint8 / bf16 on the CPU (fp8 at :meth:`close`)."""
        import torch

        length = int(input_ids.shape[0])
        if not (loss_mask.shape[0] == aux.shape[0] == hidden.shape[0] == length):
            raise StoreError(
                f"sample {sample_id}: lengths differ (ids {length}, mask {loss_mask.shape[0]}, aux "
                f"{aux.shape[0]}, hidden {hidden.shape[0]})"
            )
        for key, tensor in ((AUX_KEY, aux), (HIDDEN_KEY, hidden)):
            if not torch.isfinite(tensor).all():
                raise StoreError(f"sample {sample_id}: {key} holds NaN or Inf")
        self._ids.append(input_ids.detach().to("cpu", torch.int32))
        mask = loss_mask.detach().to("cpu", torch.uint8)
        self._masks.append(mask)
        self._aux.append(aux.detach().to("cpu", torch.bfloat16))
        self._hidden.append(hidden.detach().to("cpu", torch.bfloat16))
        self._rows.append(
            {
                "sample_id": sample_id,
                "dataset": dataset,
                "split": split,
                "shard": self.name,
                "offset": self.tokens,
                "length": length,
                "num_masked": int(mask.sum()),
            }
        )
        self.tokens += length

    @property
    def samples(self) -> int:
        return len(self._rows)

    def close(self) -> int:
        """Write the shard; returns its size in bytes on disk."""
        import torch
        from safetensors.torch import save_file

        if not self._rows:
            raise StoreError(f"shard {self.name} has no sample")
        tensors = {
            AUX_KEY: torch.cat(self._aux).contiguous(),
            HIDDEN_KEY: torch.cat(self._hidden).contiguous(),
            IDS_KEY: torch.cat(self._ids).contiguous(),
            MASK_KEY: torch.cat(self._masks).contiguous(),
        }
        if not (torch.isfinite(tensors[AUX_KEY]).all() and torch.isfinite(tensors[HIDDEN_KEY]).all()):
            raise StoreError(f"shard {self.name}: NaN or Inf after conversion to bf16")
        if self.dtype == FP8:
            hidden_size = tensors[HIDDEN_KEY].shape[1]
            tensors[AUX_KEY], tensors[AUX_SCALE_KEY] = quantize_fp8(
                tensors[AUX_KEY], tensors[AUX_KEY].shape[1] // hidden_size
            )
            tensors[HIDDEN_KEY], tensors[HIDDEN_SCALE_KEY] = quantize_fp8(tensors[HIDDEN_KEY], 1)
        self.root.mkdir(parents=True, exist_ok=True)
        tensor_path = self.root / f"{self.name}.safetensors"
        meta = {"samples": str(len(self._rows)), "tokens": str(self.tokens), "format": FORMAT}
        _write_atomic(tensor_path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
        table = pa.Table.from_pylist(self._rows, schema=INDEX_SCHEMA)
        _write_atomic(self.root / f"{self.name}.index.parquet", lambda tmp: pq.write_table(table, tmp))
        return tensor_path.stat().st_size


class HiddenStateStore:
    """Read access to a store folder; loads one shard at a time (bounded memory)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def index_path(self) -> Path:
        return self.root / "index.parquet"

    def manifest(self) -> StoreManifest:
        if not self.manifest_path.is_file():
            raise StoreError(f"{self.manifest_path}: no hidden-state manifest; materialize hidden_states first")
        return StoreManifest.from_json(self.manifest_path.read_text(), str(self.manifest_path))

    def write_manifest(self, manifest: StoreManifest) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.manifest_path, lambda tmp: tmp.write_text(manifest.to_json()))

    def shard_complete(self, name: str) -> bool:
        """Both files of the shard exist and the tensor header agrees with the shard's index."""
        from safetensors import safe_open

        tensors, index = self.root / f"{name}.safetensors", self.root / f"{name}.index.parquet"
        if not (tensors.is_file() and index.is_file()):
            return False
        try:
            rows = pq.read_table(index, columns=["length"]).column("length").to_pylist()
            with safe_open(str(tensors), framework="pt") as handle:
                meta = handle.metadata() or {}
                shape = handle.get_slice(IDS_KEY).get_shape()
        except Exception:  # noqa: BLE001 - any unreadable part means the shard is torn
            return False
        return meta.get("samples") == str(len(rows)) and meta.get("tokens") == str(sum(rows)) == str(shape[0])

    def write_index(self, shard_names: Sequence[str]) -> pa.Table:
        """Concatenate the finished shards' indexes into ``index.parquet``."""
        tables = [pq.read_table(self.root / f"{name}.index.parquet") for name in shard_names]
        table = pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table()
        _write_atomic(self.index_path, lambda tmp: pq.write_table(table, tmp))
        return table

    def index(self) -> pa.Table:
        if not self.index_path.is_file():
            raise StoreError(f"{self.index_path}: no index; materialize hidden_states first")
        return pq.read_table(self.index_path)

    def iter_samples(self, split: str | None = None, datasets: Sequence[str] | None = None) -> Iterator[HiddenSample]:
        """Samples shard by shard, in index order; only one shard's tensors are open at a time."""
        rows = self.index().to_pylist()
        wanted = [
            r for r in rows if (split is None or r["split"] == split) and (datasets is None or r["dataset"] in datasets)
        ]
        by_shard: dict[str, list[dict[str, Any]]] = {}
        for row in wanted:
            by_shard.setdefault(row["shard"], []).append(row)
        for name, shard_rows in by_shard.items():
            shard = ShardFile(self.root / f"{name}.safetensors")
            for row in shard_rows:
                start, stop = row["offset"], row["offset"] + row["length"]
                yield HiddenSample(
                    sample_id=row["sample_id"],
                    dataset=row["dataset"],
                    split=row["split"],
                    input_ids=shard.read(IDS_KEY, start, stop).long(),
                    loss_mask=shard.read(MASK_KEY, start, stop).bool(),
                    aux_hidden_states=shard.read(AUX_KEY, start, stop),
                    hidden_states=shard.read(HIDDEN_KEY, start, stop),
                )


def save_draft_vocab(folder: Path, d2t: Any, t2d: Any, manifest: dict[str, Any]) -> None:
    """``vocab.safetensors`` (``d2t`` int64 [Vd], ``t2d`` bool [V]) and ``manifest.json``."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}
    _write_atomic(folder / "vocab.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    _write_atomic(folder / "manifest.json", lambda tmp: tmp.write_text(json.dumps(manifest, indent=2)))


def load_draft_vocab(folder: Path) -> tuple[Any, Any, dict[str, Any]]:
    """``(d2t, t2d, manifest)``; checks SpecForge's vocabulary-mapping invariants."""
    import torch
    from safetensors.torch import load_file

    path = Path(folder) / "vocab.safetensors"
    if not path.is_file():
        raise StoreError(f"{path}: no draft vocabulary; materialize draft_vocab first")
    tensors = load_file(str(path))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    used = d2t + torch.arange(d2t.shape[0])
    if int(t2d.sum()) != d2t.shape[0] or not torch.equal(used, t2d.nonzero().flatten()):
        raise StoreError(f"{path}: d2t and t2d disagree (t2d.sum()={int(t2d.sum())}, draft vocab {d2t.shape[0]})")
    return d2t, t2d, manifest
