"""Disk for the hidden states of the whole ``training_data``, per backend and storage dtype.

What each way of computing the states holds on the disk where extraction runs, at its peak:

- ``transformers``, ``sglang``: the store only (the shards are written as batches finish).
- ``vllm``: the store, plus the connector's files of the requests in flight: one file per request,
  ``hidden_states`` [T, 4, H] in the model's dtype (bf16) and ``token_ids`` int64 [T]
  (``hidden_states/vllm_capture.py``), read and deleted batch by batch, so at most one batch
  (``hidden_states.batch_tokens`` tokens) at a time.
- ``command`` (SpecForge's ``prepare_hidden_states.py``, then ``import-specforge``): SpecForge's whole
  output, one ``torch.save`` per sample with ``aux_hidden_state`` [1, T, 3H] and ``hidden_state``
  [1, T, H] in bf16 and ``input_ids`` / ``loss_mask`` int64 (what ``hidden_states/importer.py``
  reads), stays until the import has written our store next to it: both at once. Without
  ``--compress``; gzip saves little on bf16 states.

Tokens are all ``training_data`` tokens (train and eval rows: every row's states are stored).
Plain arithmetic on the store formula (:func:`.store.bytes_per_token`); no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import HiddenStatesConfig, InferenceConfig, PipelineConfig, TargetConfig
from eagle3_pipeline.hidden_states.store import BF16_BYTES, STORAGE_DTYPES, bytes_per_token
from eagle3_pipeline.layout import ArtifactLayout

BACKENDS = ("transformers", "sglang", "vllm", "command")
VLLM_TOKEN_ID_BYTES = 8
SPECFORGE_ID_AND_MASK_BYTES = 8 + 8
GB = 1e9
AUTO_BATCH_TOKENS = 8192  # batch_tokens auto outside SGLang's capture (config/eagle3.py)


def vllm_file_bytes_per_token(hidden_size: int, aux_layers: int = 3) -> int:
    """One token in the connector's file: the aux layers and the last layer in bf16, its int64 id."""
    return (aux_layers + 1) * hidden_size * BF16_BYTES + VLLM_TOKEN_ID_BYTES


def specforge_bytes_per_token(hidden_size: int, aux_layers: int = 3) -> int:
    """One token in SpecForge's offline output: aux and final states in bf16, int64 id and mask."""
    return (aux_layers + 1) * hidden_size * BF16_BYTES + SPECFORGE_ID_AND_MASK_BYTES


@dataclass(frozen=True)
class DiskRow:
    backend: str
    dtype: str
    store_bytes: int
    transient_bytes: int
    note: str

    @property
    def peak_bytes(self) -> int:
        return self.store_bytes + self.transient_bytes


@dataclass(frozen=True)
class DiskPlan:
    """Bytes per backend and storage dtype for ``tokens`` tokens; ``free_bytes`` None when unknown."""

    hidden_size: int
    aux_layers: int
    tokens: int
    tokens_basis: str
    rows: list[DiskRow]
    configured: tuple[str, str]
    free_bytes: int | None
    free_where: str

    def fits(self, row: DiskRow) -> bool | None:
        return None if self.free_bytes is None else row.peak_bytes <= self.free_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "aux_layers": self.aux_layers,
            "tokens": self.tokens,
            "tokens_basis": self.tokens_basis,
            "bytes_per_token": {
                dtype: bytes_per_token(self.hidden_size, self.aux_layers, dtype) for dtype in STORAGE_DTYPES
            },
            "free_bytes": self.free_bytes if self.free_bytes is not None else "unknown",
            "free_where": self.free_where,
            "configured": {"backend": self.configured[0], "storage_dtype": self.configured[1]},
            "rows": [
                {
                    "backend": r.backend,
                    "storage_dtype": r.dtype,
                    "store_bytes": r.store_bytes,
                    "transient_bytes": r.transient_bytes,
                    "peak_bytes": r.peak_bytes,
                    "fits": self.fits(r),
                    "configured": (r.backend, r.dtype) == self.configured,
                    "note": r.note,
                }
                for r in self.rows
            ],  # fmt: skip
        }

    def text(self) -> str:
        per_token = ", ".join(
            f"{dtype} {bytes_per_token(self.hidden_size, self.aux_layers, dtype):,} B" for dtype in STORAGE_DTYPES
        )
        free = (
            f"{self.free_bytes / GB:,.1f} GB free ({self.free_where})"
            if self.free_bytes is not None
            else f"free disk unknown ({self.free_where})"
        )
        head = [
            f"hidden-state disk for {self.tokens:,} training tokens ({self.tokens_basis}); hidden {self.hidden_size}, "
            f"{self.aux_layers} aux layers + teacher: {per_token} per token; {free}"
        ]
        table = [["backend", "storage dtype", "store GB", "transient GB", "peak GB", "fits", ""]]
        for r in self.rows:
            fits = self.fits(r)
            fits_text = "unknown" if fits is None else ("yes" if fits else "NO")
            marker = "<- configured" if (r.backend, r.dtype) == self.configured else ""
            sizes = [f"{r.store_bytes / GB:,.1f}", f"{r.transient_bytes / GB:,.1f}", f"{r.peak_bytes / GB:,.1f}"]
            table.append([r.backend, r.dtype, *sizes, fits_text, marker])
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
        notes = sorted({f"{r.backend}: {r.note}" for r in self.rows})
        return "\n".join(head + lines + notes)


def disk_plan(
    hidden_size: int,
    aux_layers: int,
    *,
    tokens: int,
    tokens_basis: str,
    batch_tokens: int,
    configured: tuple[str, str],
    free_bytes: int | None = None,
    free_where: str = "not measured",
    backends: Sequence[str] = BACKENDS,
) -> DiskPlan:
    """Every backend × storage dtype for ``tokens`` tokens (see the module doc for what each holds)."""
    rows = []
    vllm_batch = batch_tokens * vllm_file_bytes_per_token(hidden_size, aux_layers)
    specforge = tokens * specforge_bytes_per_token(hidden_size, aux_layers)
    for backend in backends:
        for dtype in STORAGE_DTYPES:
            store = tokens * bytes_per_token(hidden_size, aux_layers, dtype)
            if backend == "vllm":
                rows.append(
                    DiskRow(
                        backend,
                        dtype,
                        store,
                        vllm_batch,
                        f"+ one batch ({batch_tokens:,} tokens) of connector files in flight",
                    )
                )
            elif backend == "command":
                rows.append(
                    DiskRow(
                        backend,
                        dtype,
                        store,
                        specforge,
                        "+ SpecForge's whole output (bf16, int64 ids and mask) until the import finishes",
                    )
                )
            else:
                rows.append(DiskRow(backend, dtype, store, 0, "the store only"))
    return DiskPlan(hidden_size, aux_layers, tokens, tokens_basis, rows, configured, free_bytes, free_where)


def local_target_folder(
    hidden_states: HiddenStatesConfig, target: TargetConfig, inference: InferenceConfig
) -> tuple[dict[str, Any], str] | str:
    """The target's config.json from a folder on this machine (``hidden_states.model``,
    ``target.tokenizer``, the embedded model), or why there is none; nothing is downloaded."""
    from eagle3_pipeline.target.folder import TargetError, read_config
    from eagle3_pipeline.target.local_model import local_model_dir

    candidates = [
        hidden_states.model,
        target.tokenizer,
        str(local_model_dir()) if inference.kind == "embedded" else None,
    ]
    tried = list(dict.fromkeys(c for c in candidates if c))
    for model in tried:
        if (Path(model) / "config.json").is_file():
            try:
                return read_config(model), model
            except TargetError as exc:
                return f"unknown: {exc}"
    looked = ", ".join(tried) or "nothing: set hidden_states.model or target.tokenizer"
    return f"unknown: no target config.json on this machine (looked in {looked})"


def training_tokens(
    training_data: Path,
    records: Mapping[str, Mapping[str, Mapping[str, Any]]],
    left: Mapping[str, tuple[int | None, int | None]],
) -> tuple[int, str] | str:
    """All tokens of the ``training_data`` folder: its manifest's count when it exists, else the
    answers' prompt and completion tokens so far plus the planner's prompt and completion tokens
    left per dataset (``left``: dataset → (prompt, completion) tokens left, None when unknown)."""
    manifest = training_data / "manifest.json"
    if manifest.is_file():
        tokens = json.loads(manifest.read_text()).get("tokens")
        if isinstance(tokens, int):
            return tokens, f"{manifest}"
    unknown = [dataset for dataset, (prompt, completion) in left.items() if prompt is None or completion is None]
    if unknown:
        return f"unknown: the tokens left of {', '.join(unknown)} are unknown (prompts not materialized)"
    done = sum(
        int(r.get("prompt_tokens") or 0) + int(r.get("completion_tokens") or 0)
        for answers in records.values()
        for r in answers.values()
    )
    ahead = sum((prompt or 0) + (completion or 0) for prompt, completion in left.values())
    return (
        done + ahead,
        "estimate: prompt + completion tokens of the answers so far and of those left (no training_data yet)",
    )


def config_disk_plan(
    config: PipelineConfig,
    records: Mapping[str, Mapping[str, Mapping[str, Any]]],
    left: Mapping[str, tuple[int | None, int | None]],
) -> DiskPlan | str:
    """:func:`disk_plan` for the configured target and training tokens, or the sentence saying what is unknown."""
    from eagle3_pipeline.hidden_states.resume import free_bytes
    from eagle3_pipeline.target.folder import dimensions

    found = local_target_folder(config.hidden_states, config.target, config.inference)
    if isinstance(found, str):
        return f"hidden-state disk: {found}"
    raw, where = found
    tokens = training_tokens(ArtifactLayout(config.artifacts_root).training_data, records, left)
    if isinstance(tokens, str):
        return f"hidden-state disk: {tokens}"
    aux_layers = len(config.hidden_states.aux_layer_ids or (0, 0, 0))
    hidden_size = dimensions(raw, str(Path(where, "config.json"))).hidden_size
    backend = "command" if config.compute.kind == "command" else config.hidden_states.backend
    if config.compute.kind == "local":
        free, free_where = free_bytes(config.artifacts_root), f"under {config.artifacts_root} on this machine"
    else:
        free, free_where = (
            None,
            f"the store is on the GPU host (compute.kind {config.compute.kind}): "
            "the phase's preflight measures it there",
        )
    return disk_plan(
        hidden_size,
        aux_layers,
        tokens=tokens[0],
        tokens_basis=tokens[1],
        batch_tokens=config.hidden_states.batch_tokens
        if isinstance(config.hidden_states.batch_tokens, int)
        else AUTO_BATCH_TOKENS,
        configured=(backend, config.hidden_states.storage_dtype),
        free_bytes=free,
        free_where=free_where,
    )
