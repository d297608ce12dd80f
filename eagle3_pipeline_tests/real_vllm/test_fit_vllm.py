"""The resource model (``eagle3_pipeline.fit``) against what real vLLM (CPU build 0.32, eager, bf16, 2048 context)
reports when it starts the embedded model (SmolLM2-135M-Instruct) with ``VLLM_CPU_KVCACHE_SPACE`` = 1 and 2 GiB.

KV cache: the CPU worker logs ``Explicitly set (1.0/23.54) GiB for KV cache on node 0.`` and the engine
``CPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: 22.75x``. The fit predicts
``space × 2^30 / kv_per_token(config.json, tp=1, "auto")`` tokens; vLLM allocates whole blocks of
``block_size`` tokens (128 on the CPU backend for a non-MLA model), so the logged figure is the prediction rounded
down to a multiple of 128: checked to within one block (and ≤ the prediction), far inside 10 %.

Weights: the CPU build prints no ``Model loading took X GiB`` (only the GPU model runners do); the figure it logs
is ``Checkpoint size: 0.50 GiB`` (weight_utils, the files' bytes), which ``read_weights(folder).total_bytes`` (the
safetensors headers) must match within 5 %. What the server holds: this checkpoint is float32 and vLLM downcasts
it (``Downcasting torch.float32 to torch.bfloat16``), so 2 bytes per parameter — ``per_gpu_bytes(1)``, which
counts float32 modules as bfloat16, is half the files' bytes.

One server per KV setting (two starts in all), each started once for the module.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3_pipeline.fit.checkpoint import read_weights
from eagle3_pipeline.fit.engines import kv_per_token
from eagle3_pipeline.testing.real_vllm import vllm_server

pytestmark = pytest.mark.local_model

GIB = 1024**3
CPU_BLOCK_SIZE = 128  # vllm/platforms/cpu.py: the CPU backend's default block_size (non-MLA)
KV_LINE = re.compile(r"CPU KV cache size: ([\d,]+) tokens")
SPACE_LINE = re.compile(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache")
CHECKPOINT_LINE = re.compile(r"Checkpoint size: ([\d.]+) GiB")
DOWNCAST_LINE = re.compile(r"Downcasting torch\.(\w+) to torch\.(\w+)")


@dataclass(frozen=True)
class Started:
    space_gib: int
    log: str


@pytest.fixture(scope="module", params=[1, 2], ids=lambda gib: f"kv{gib}GiB")
def started(
    request: pytest.FixtureRequest, real_vllm_python: Path, local_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Started]:
    space = int(request.param)
    log = tmp_path_factory.mktemp(f"fit_vllm_kv{space}") / "vllm.log"
    with vllm_server(local_model, log, served_name="smol", env={"VLLM_CPU_KVCACHE_SPACE": str(space)}):
        text = log.read_text(errors="replace")
    yield Started(space, text)


def one(pattern: re.Pattern[str], log: str) -> re.Match[str]:
    found = pattern.search(log)
    assert found, f"no line matching {pattern.pattern!r} in vLLM's log"
    return found


def test_kv_tokens_and_weights_match_the_fit(started: Started, local_model: Path) -> None:
    raw = json.loads((local_model / "config.json").read_text())
    per_token = kv_per_token(raw, 1, "auto")
    kv_line = one(KV_LINE, started.log)
    measured_tokens = int(kv_line.group(1).replace(",", ""))
    space_logged = float(one(SPACE_LINE, started.log).group(1))
    predicted_tokens = started.space_gib * GIB / per_token
    rounded = math.floor(predicted_tokens / CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE

    weights = read_weights(local_model)
    files = weights.total_bytes
    held = weights.per_gpu_bytes(1)
    checkpoint_gib = float(one(CHECKPOINT_LINE, started.log).group(1))
    downcast = one(DOWNCAST_LINE, started.log)

    kv_error = (predicted_tokens - measured_tokens) / measured_tokens
    weight_error = (files / GIB - checkpoint_gib) / checkpoint_gib
    print(
        f"\nVLLM_CPU_KVCACHE_SPACE={started.space_gib}: logged {kv_line.group(0)!r}, space {space_logged} GiB; "
        f"predicted {started.space_gib} × 2^30 / {per_token:,.0f} B/token = {predicted_tokens:,.1f} tokens "
        f"({kv_error:+.3%}), in whole {CPU_BLOCK_SIZE}-token blocks {rounded:,}"
        f"\nweights: the files {files / GIB:.4f} GiB ({weights.basis}) vs logged 'Checkpoint size: "
        f"{checkpoint_gib:.2f} GiB' ({weight_error:+.2%}); served after {downcast.group(0)!r}: {held / GIB:.4f} GiB"
    )
    assert space_logged == pytest.approx(started.space_gib)
    assert measured_tokens == rounded, "the prediction rounded down to whole blocks is exactly what vLLM allocates"
    assert 0 <= predicted_tokens - measured_tokens < CPU_BLOCK_SIZE
    assert abs(kv_error) < 0.10
    assert abs(weight_error) < 0.05
    assert (downcast.group(1), downcast.group(2)) == ("float32", "bfloat16")
    assert held == pytest.approx(files / 2, rel=1e-6)
