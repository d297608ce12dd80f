"""The benchmark's result: every arm at every concurrency, the speedups with their intervals, the best
configuration per concurrency and the one to serve, as figures, a table and a bar chart a person reads at
a glance (Dagster plots numeric metadata across materializations only, so the chart inside one
materialization is Markdown: a bar of block characters per arm, scaled to the fastest at its concurrency).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3_pipeline.drafter.serve.client import Acceptance, Measured
from eagle3_pipeline.drafter.serve.set_tau import prompt_set_metadata
from eagle3_pipeline.drafter.serve.sweep import Choice, SpeculativeConfig, Speedup, best_at, speedup

BAR_WIDTH = 32


def conditional_rates(per_position: Sequence[float]) -> list[float | None]:
    """P(depth j accepted | the depths before it accepted), j = 1 … K, from the per-position rates
    P(accepted >= p + 1): drafter_eval's ``accept_d<j>`` (None where no step reached depth j)."""
    reached = [1.0, *per_position][: len(per_position)]
    return [rate / reach if reach else None for rate, reach in zip(per_position, reached, strict=True)]


@dataclass(frozen=True)
class ArmResult:
    """One server start: the baseline (``config`` None) or a speculative configuration, at every concurrency."""

    arm: str
    config: SpeculativeConfig | None
    levels: list[Measured]
    acceptance: Acceptance | None  # over all its concurrencies; None for the baseline
    server_process: str = ""  # what the health gate's server_process check matched
    prompt_sets: dict[str, Any] | None = None  # τ per prompt set and category (online.measure_prompt_sets)

    def at(self, concurrency: int) -> Measured:
        return next(m for m in self.levels if m.concurrency == concurrency)

    @property
    def tau(self) -> float | None:
        return self.acceptance.tau if self.acceptance is not None else None

    def summary(self) -> dict[str, Any]:
        acceptance = self.acceptance
        return {
            "arm": self.arm,
            "config": self.config.as_dict() if self.config is not None else None,
            "tau": round(acceptance.tau, 4) if acceptance is not None else None,
            "acceptance_per_position": acceptance.per_position if acceptance is not None else None,
            "verify_steps": acceptance.verify_steps if acceptance is not None else None,
            "accepted_tokens": acceptance.accepted_tokens if acceptance is not None else None,
            "no_verify_requests": acceptance.no_verify_requests if acceptance is not None else 0,
            "server_process": self.server_process,
            "levels": [m.summary() for m in self.levels],
        }


@dataclass
class BenchmarkResult:
    """The baseline and each configuration measured; the configurations the budget left out; the concurrency
    the served drafter is chosen at."""

    server: str
    baseline: ArmResult
    arms: list[ArmResult]
    not_run: list[SpeculativeConfig]
    serve_concurrency: int
    speedups: dict[tuple[str, int], Speedup] = field(init=False)

    def __post_init__(self) -> None:
        self.speedups = {
            (arm.arm, m.concurrency): speedup(self.baseline.at(m.concurrency), m)
            for arm in self.arms
            for m in arm.levels
        }

    @property
    def concurrencies(self) -> list[int]:
        return [m.concurrency for m in self.baseline.levels]

    def best(self, concurrency: int) -> Choice:
        measured = [
            (arm.config, arm.at(concurrency).tokens_per_s, self.speedups[(arm.arm, concurrency)])
            for arm in self.arms
            if arm.config is not None
        ]
        return best_at(concurrency, self.baseline.at(concurrency).tokens_per_s, measured)

    @property
    def choice(self) -> Choice:
        return self.best(self.serve_concurrency)

    def headline(self) -> ArmResult:
        """The chosen configuration's arm, else the fastest at the serving concurrency."""
        chosen = self.choice.config
        if chosen is not None:
            return next(a for a in self.arms if a.config == chosen)
        return max(self.arms, key=lambda a: a.at(self.serve_concurrency).tokens_per_s)

    def as_metadata(self) -> dict[str, Any]:
        """Flat figures at the serving concurrency for the headline arm (per position ``acceptance_pos<p>``,
        vLLM's rate, and ``accept_d<j>``, the conditional rate under drafter_eval's name), per concurrency the
        baseline's tokens/s and the best speedup, the choice, every arm in full, the table and the chart."""
        top = self.headline()
        c = self.serve_concurrency
        rates = (top.acceptance.per_position if top.acceptance else None) or []
        per_position: dict[str, float] = {f"acceptance_pos{p}": round(rate, 4) for p, rate in enumerate(rates)}
        for depth, rate in enumerate(conditional_rates(rates), start=1):
            if rate is not None:
                per_position[f"accept_d{depth}"] = round(rate, 4)
        gain = self.speedups[(top.arm, c)]
        per_concurrency: dict[str, float] = {}
        for level in self.concurrencies:
            per_concurrency[f"tokens_per_s_baseline@c{level}"] = round(self.baseline.at(level).tokens_per_s, 2)
            best = max(self.speedups[(a.arm, level)].value for a in self.arms)
            per_concurrency[f"speedup_best@c{level}"] = round(best, 4)
        choice = self.choice
        return {
            "server": self.server,
            "serve_concurrency": c,
            "chosen": choice.config.label if choice.config is not None else "baseline",
            "choice": {"config": choice.config.as_dict() if choice.config else None, "reason": choice.reason},
            "steps": top.config.steps if top.config is not None else 0,
            "tau_server": round(top.tau or 0.0, 4),
            **per_position,
            "tokens_per_s_baseline": round(self.baseline.at(c).tokens_per_s, 2),
            "tokens_per_s_speculative": round(top.at(c).tokens_per_s, 2),
            "speedup": round(gain.value, 4),
            "speedup_low": round(gain.low, 4),
            "speedup_high": round(gain.high, 4),
            **per_concurrency,
            "requests": top.at(c).requests,
            "no_verify_requests": top.acceptance.no_verify_requests if top.acceptance else 0,
            "not_run": [config.label for config in self.not_run],
            **prompt_set_metadata(next((a.prompt_sets for a in self.arms if a.prompt_sets), None)),
            "arms": [self.baseline.summary(), *(arm.summary() for arm in self.arms)],
            "table": self.table(),
            "chart": self.chart(),
        }

    def table(self) -> str:
        """Markdown: per concurrency, each arm's tokens/s overall and per request, TTFT, ITL, speedup, τ."""
        lines = [
            "| concurrency | arm | tok/s | tok/s per request | TTFT ms | ITL ms | speedup [95 %] | τ |",
            "|---:|---|---:|---:|---:|---:|---|---:|",
        ]
        for level in self.concurrencies:
            best = self.best(level).config
            for arm in (self.baseline, *self.arms):
                s = arm.at(level).summary()
                gain = self.speedups.get((arm.arm, level))
                name = arm.config.label if arm.config is not None else "baseline"
                mark = " **best**" if arm.config is not None and arm.config == best else ""
                lines.append(
                    f"| {level} | {name}{mark} | {s['tokens_per_s']:.1f} | {s['tokens_per_s_per_request']:.1f} | "
                    f"{_ms(s['ttft_s'])} | {_ms(s['itl_s'])} | {gain.shown() if gain else '1 (reference)'} | "
                    f"{f'{arm.tau:.3f}' if arm.tau is not None else '–'} |"
                )
        lines.append("")
        lines.append(f"Served at concurrency {self.serve_concurrency}: {self.choice.reason}.")
        if self.not_run:
            lines.append(f"Not run (max_server_starts): {', '.join(c.label for c in self.not_run)}.")
        return "\n".join(lines)

    def chart(self) -> str:
        """Markdown: output tokens/s per arm as bars, one group per concurrency."""
        names = ["baseline", *(a.config.label for a in self.arms if a.config is not None)]
        width = max(len(n) for n in names)
        lines = ["```"]
        for level in self.concurrencies:
            rates = [(self.baseline, self.baseline.at(level).tokens_per_s)]
            rates += [(arm, arm.at(level).tokens_per_s) for arm in self.arms]
            top = max(r for _, r in rates) or 1.0
            lines.append(f"concurrency {level} (output tokens/s)")
            for arm, rate in rates:
                name = arm.config.label if arm.config is not None else "baseline"
                gain = self.speedups.get((arm.arm, level))
                bar = "█" * max(1, round(BAR_WIDTH * rate / top))
                lines.append(
                    f"  {name:<{width}} {bar:<{BAR_WIDTH}} {rate:8.1f}{f'  {gain.value:.2f}×' if gain else ''}"
                )
        lines.append("```")
        return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.1f}" if seconds is not None else "–"
