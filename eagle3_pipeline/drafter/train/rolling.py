"""Rolling hidden-state windows: train a drafter on a store larger than the disk.

With ``hidden_states.rolling_window_shards`` the store keeps only its eval shards; :func:`run_rolling`
goes, epoch by epoch and window by window, through ``extract(shards)``, ``train(epoch, window)`` and
``delete(shards)``, recording before each stage where it is in ``rolling.json``, so a kill anywhere
resumes there; :func:`tradeoff` says what it costs in disk and extraction. The stages, the resume and
the trade-off: drafter/DESIGN.md, "Rolling windows". No torch here: the code location imports this module.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.compute import Reporter

STATE_FILE = "rolling.json"
GB = 1e9

Extract = Callable[[list[str]], Mapping[str, Any]]
Train = Callable[[int, int], Mapping[str, Any]]
Delete = Callable[[list[str]], Mapping[str, Any]]


class RollingError(RuntimeError):
    """The rolling state cannot be continued; the message says why and what to do."""


def layout_digest(windows: list[list[str]], epochs: int) -> str:
    """What a ``rolling.json`` belongs to: the windows' shards and the epochs."""
    return hashlib.sha256(json.dumps({"windows": windows, "epochs": epochs}).encode()).hexdigest()


def read_state(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not {"layout", "segment", "stage"} <= set(state):
            raise ValueError("expected an object with layout, segment and stage")
        return state
    except ValueError as exc:
        raise RollingError(
            f"{path}: not a rolling state ({exc}); remove it with the drafter's run folder to train anew"
        ) from None


def write_state(path: Path, state: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(json.dumps(state, indent=1))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _note_disk(state: dict[str, Any], found: Mapping[str, Any]) -> None:
    if "shard_files_on_disk" in found:
        state["peak_shard_files"] = max(state.get("peak_shard_files", 0), int(found["shard_files_on_disk"]))
        state["peak_shard_bytes"] = max(state.get("peak_shard_bytes", 0), int(found["shard_bytes_on_disk"]))


def run_rolling(
    state_path: Path,
    windows: list[list[str]],
    *,
    epochs: int,
    extract: Extract,
    train: Train,
    delete: Delete,
    report: Reporter,
) -> dict[str, Any]:
    """Every (epoch, window) in order, from where ``state_path`` says; returns the trainer's last
    result with the rolling figures (``rolling_*``). A state of another layout is refused."""
    if not windows:
        raise RollingError("rolling: the store's layout has no train shard")
    digest = layout_digest(windows, epochs)
    state = read_state(state_path) or {
        "layout": digest,
        "segment": 0,
        "stage": "extract",
        "step": 0,
        "windows_trained": 0,
    }
    if state["layout"] != digest:
        raise RollingError(
            f"{state_path}: made for another rolling layout (windows or drafter.epochs changed); remove it with the "
            "drafter's run folder to train anew"
        )
    segments = [(e, w) for e in range(epochs) for w in range(len(windows))]
    result: Mapping[str, Any] | None = None
    while state["segment"] < len(segments):
        epoch, window = segments[state["segment"]]
        shards = windows[window]
        state.update(epoch=epoch, window=window)
        if state["stage"] == "extract":
            write_state(state_path, state)
            report.log(f"rolling: epoch {epoch}, window {window + 1}/{len(windows)}: extracting {len(shards)} shard(s)")
            _note_disk(state, extract(shards))
            state["stage"] = "train"
            write_state(state_path, state)
        if state["stage"] == "train":
            result = train(epoch, window)
            state.update(stage="delete", step=int(result["steps"]), finished=bool(result["finished"]))
            state["windows_trained"] += 1
            write_state(state_path, state)
        delete(shards)
        state.update(stage="extract", segment=len(segments) if state.get("finished") else state["segment"] + 1)
        write_state(state_path, state)
        report.log(f"rolling: epoch {epoch}, window {window + 1}/{len(windows)} done at drafter step {state['step']}")
    if result is None:
        # Everything was done before this run: the trainer, at its end, trains nothing and exports again.
        result = train(*segments[-1])
    return {
        **result,
        "rolling_windows": len(windows),
        "rolling_segments": len(segments),
        "rolling_windows_trained": state["windows_trained"],
        "rolling_peak_shard_files": state.get("peak_shard_files", 0),
        "rolling_peak_shard_bytes": state.get("peak_shard_bytes", 0),
        "rolling_state": str(state_path),
    }


@dataclass(frozen=True)
class Tradeoff:
    """Disk and extraction of a rolling run against a whole store (sizes in bytes, times in s)."""

    store_bytes: float
    rolling_peak_bytes: float
    extract_once_s: float
    rolling_extract_s: float
    windows: int

    @property
    def extract_ratio(self) -> float:
        return self.rolling_extract_s / self.extract_once_s


def tradeoff(
    train_tokens: float,
    eval_tokens: float,
    *,
    bytes_per_token: float,
    shard_tokens: int,
    window_shards: int,
    epochs: int,
    extract_tokens_per_s: float,
    target_load_s: float = 0.0,
) -> Tradeoff:
    """The store extracted once (all of it on disk) against rolling windows (eval shards + one window
    + the shard being written on disk; the train tokens extracted ``epochs`` times, and the target
    loaded once per window, ``target_load_s`` each, as each window's extraction is a phase of its own)."""
    windows = -(-int(train_tokens) // (window_shards * shard_tokens))
    return Tradeoff(
        store_bytes=(train_tokens + eval_tokens) * bytes_per_token,
        rolling_peak_bytes=(eval_tokens + (window_shards + 1) * shard_tokens) * bytes_per_token,
        extract_once_s=(train_tokens + eval_tokens) / extract_tokens_per_s + target_load_s,
        rolling_extract_s=(epochs * train_tokens + eval_tokens) / extract_tokens_per_s
        + (epochs * windows + 1) * target_load_s,
        windows=windows,
    )
