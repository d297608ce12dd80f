"""The benchmark's sweep: which speculative configurations it measures, the speedup of each with its
uncertainty, and the best one per concurrency.

Configurations: ``steps`` as a chain first, then ``sweep_steps`` × ``sweep_topk`` × ``sweep_draft_tokens``
(a chain verifies K + 1 tokens whatever the list says, a tree at most K × top-k + 1: SGLang's own bounds),
without repeats, cut to ``max_server_starts`` − 1 (the baseline's start is the first); the ones cut are
listed as not run.

Speedup at a concurrency: speculative output tokens/s over the baseline's, each over its wall time. Its
uncertainty: a paired bootstrap over the requests (the same prompt is request ``i`` in both arms, so each
resample draws pairs), of Σ tokens / Σ latency in each arm — the prompt mix is what moves the figure
between runs (acceptance differs per prompt), and resampling it costs no server time, where repeats
would cost a server start each. The interval is the wall-time ratio scaled by the resampled ratios'
2.5th and 97.5th percentiles over their full-sample value. It does not see a load that drifts between
the arms' server starts (a shared host): that shows as a shift of a whole arm, not as spread.

The best at a concurrency: the most tokens/s among the configurations whose interval lies above 1; none
such, the target alone.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from eagle3_pipeline.config import DrafterBenchmarkConfig
from eagle3_pipeline.drafter.serve.client import Measured
from eagle3_pipeline.managed.launch import EagleDrafter

BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculative configuration: K draft steps, top-k per step, draft tokens verified."""

    steps: int
    topk: int = 1
    draft_tokens: int | None = None  # None: K + 1 (a chain)

    @property
    def verified(self) -> int:
        return EagleDrafter("", self.steps, self.topk, self.draft_tokens).verified

    @property
    def label(self) -> str:
        return f"K{self.steps}·top{self.topk}·{self.verified}"

    def drafter(self, path: str) -> EagleDrafter:
        return EagleDrafter(path, self.steps, self.topk, self.draft_tokens if self.topk > 1 else None)

    def as_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "topk": self.topk, "draft_tokens": self.verified}


def configurations(settings: DrafterBenchmarkConfig) -> tuple[list[SpeculativeConfig], list[SpeculativeConfig]]:
    """(measured, not run for the budget): module doc."""
    wanted = [SpeculativeConfig(settings.steps)]
    for steps, topk in itertools.product(settings.sweep_steps, settings.sweep_topk):
        if topk == 1:
            wanted.append(SpeculativeConfig(steps))
            continue
        wanted += [SpeculativeConfig(steps, topk, n) for n in settings.sweep_draft_tokens if n <= steps * topk + 1]
    unique = list(dict.fromkeys(wanted))
    room = settings.max_server_starts - 1
    return unique[:room], unique[room:]


@dataclass(frozen=True)
class Speedup:
    """Speculative over baseline output tokens/s at one concurrency, with its 95 % bootstrap interval."""

    value: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def shown(self) -> str:
        return f"{self.value:.2f}× [{self.low:.2f}, {self.high:.2f}]"


def _rate(records: Sequence[tuple[int, float]]) -> float:
    latency = sum(lat for _, lat in records)
    return sum(tokens for tokens, _ in records) / latency if latency > 0 else 0.0


def speedup(baseline: Measured, speculative: Measured, resamples: int = BOOTSTRAP_RESAMPLES) -> Speedup:
    """The speedup and its paired-bootstrap interval (module doc)."""
    value = speculative.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s > 0 else 0.0
    base = {r.prompt: (r.completion_tokens, r.latency_s) for r in baseline.records}
    spec = {r.prompt: (r.completion_tokens, r.latency_s) for r in speculative.records}
    pairs = [(base[i], spec[i]) for i in sorted(base.keys() & spec.keys())]
    full = _rate([s for _, s in pairs]) / (_rate([b for b, _ in pairs]) or 1.0)
    if len(pairs) < 2 or full <= 0:
        return Speedup(value, value, value)
    draw = random.Random(BOOTSTRAP_SEED)
    ratios = []
    for _ in range(resamples):
        sample = [pairs[draw.randrange(len(pairs))] for _ in pairs]
        rate = _rate([b for b, _ in sample])
        ratios.append(_rate([s for _, s in sample]) / rate if rate > 0 else 0.0)
    ratios.sort()
    low, high = ratios[int(0.025 * (resamples - 1))], ratios[int(0.975 * (resamples - 1))]
    return Speedup(value, value * low / full, value * high / full)


@dataclass(frozen=True)
class Choice:
    """The best at one concurrency: the configuration with the most output tokens/s, None when none beats the
    baseline, and why, with the figures."""

    concurrency: int
    config: SpeculativeConfig | None
    reason: str


def best_at(
    concurrency: int, baseline_tps: float, measured: Sequence[tuple[SpeculativeConfig, float, Speedup]]
) -> Choice:
    """The configuration of the most tokens/s at ``concurrency`` among those that beat the baseline there: whose
    speedup's interval lies above 1, so that the prompt mix alone would not undo the gain (``measured``: each
    configuration's tokens/s and speedup there)."""
    if not measured:
        return Choice(concurrency, None, f"no speculative configuration was measured at concurrency {concurrency}")
    winners = [m for m in measured if m[2].low > 1.0]
    config, tps, gain = max(winners or measured, key=lambda m: m[1])
    figures = f"{tps:.1f} tok/s against the baseline's {baseline_tps:.1f} ({gain.shown()})"
    if winners:
        return Choice(concurrency, config, f"{config.label} is fastest at concurrency {concurrency}: {figures}")
    return Choice(
        concurrency,
        None,
        f"no configuration beats the target alone at concurrency {concurrency} (speedup interval above 1): the "
        f"fastest, {config.label}, makes {figures}",
    )
