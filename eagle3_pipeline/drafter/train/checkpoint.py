"""Training checkpoints: full state, written atomically, found again after a kill.

``<run_dir>/checkpoints/step-NNNNNNNN/`` holds ``state.pt`` (model, optimizer, scheduler, data
position, RNG states, the metric curve, the run identity), ``vocab.safetensors`` (the d2t/t2d the
model was trained with) and, last, ``COMPLETE`` (JSON: step, sizes). The folder is built under a
temporary name and renamed into place only after every file is written and synced, so a kill at
any moment leaves either a complete checkpoint or a temporary folder that is ignored and removed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"
STATE_FILE = "state.pt"
VOCAB_FILE = "vocab.safetensors"
PREFIX = "step-"


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], d2t: torch.Tensor, t2d: torch.Tensor, keep: int
) -> Path:
    from safetensors.torch import save_file

    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / STATE_FILE)
    save_file({"d2t": d2t.cpu().contiguous(), "t2d": t2d.cpu().contiguous()}, str(tmp / VOCAB_FILE))
    for name in (STATE_FILE, VOCAB_FILE):
        _fsync(tmp / name)
    sizes = {name: (tmp / name).stat().st_size for name in (STATE_FILE, VOCAB_FILE)}
    (tmp / MARKER).write_text(json.dumps({"step": step, "sizes": sizes}))
    _fsync(tmp / MARKER)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, keep)
    return final


def is_complete(folder: Path) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        sizes = json.loads(marker.read_text())["sizes"]
        return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in sizes.items())
    except (ValueError, KeyError, TypeError):
        return False


def _complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def _prune(root: Path, keep: int) -> None:
    for stale in root.glob(f".tmp-{PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in _complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = _complete_checkpoints(checkpoint_dir(run_dir))
    return found[-1] if found else None


def load_checkpoint(folder: Path) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, Any] = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    vocab = load_file(str(folder / VOCAB_FILE))
    return state, vocab["d2t"], vocab["t2d"]
