"""What the fit of a pipeline's GPU phases reports (:mod:`eagle3_pipeline.fit.report` computes it): per phase,
each resource needed against what the machine has, the time, and the ``auto`` settings chosen; and the
workload it is computed for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.config.phases import GpuPhase
from eagle3_pipeline.fit.gpus import GIB
from eagle3_pipeline.fit.machine import Machine

Verdict = Literal["fits", "does not fit", "UNKNOWN"]


@dataclass(frozen=True)
class Choice:
    setting: str
    value: Any
    why: str


@dataclass
class Need:
    """One resource of one phase: needed against available, in bytes (None: unknown)."""

    resource: Literal["gpu", "host", "disk"]
    need: float | None
    have: float | None
    detail: str
    setting: str = ""  # what to change when it does not fit

    @property
    def verdict(self) -> Verdict:
        if self.need is None or self.have is None:
            return "UNKNOWN"
        return "fits" if self.need <= self.have else "does not fit"

    def line(self) -> str:
        need = "?" if self.need is None else f"{self.need / GIB:,.1f} GiB"
        have = "?" if self.have is None else f"{self.have / GIB:,.1f} GiB"
        per = " per GPU" if self.resource == "gpu" else ""
        text = f"{self.resource}: {need} needed{per} of {have} — {self.verdict}; {self.detail}"
        return text + (f" (change {self.setting})" if self.verdict == "does not fit" and self.setting else "")


@dataclass
class PhaseFit:
    phase: GpuPhase
    needs: list[Need] = field(default_factory=list)
    time_s: float | None = None
    time_basis: str = "UNKNOWN"
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        verdicts = {n.verdict for n in self.needs}
        if "does not fit" in verdicts:
            return "does not fit"
        if not verdicts or "UNKNOWN" in verdicts:
            return "UNKNOWN"
        return "fits"

    def refusal(self) -> str:
        return f"{self.phase}: " + "; ".join(n.line() for n in self.needs if n.verdict == "does not fit")


@dataclass
class FitReport:
    machine: Machine
    phases: list[PhaseFit]
    choices: list[Choice]
    weights_basis: str
    notes: list[str] = field(default_factory=list)

    def phase(self, name: str) -> PhaseFit | None:
        return next((p for p in self.phases if p.phase == name), None)

    def unfit(self) -> list[PhaseFit]:
        return [p for p in self.phases if p.verdict == "does not fit"]

    def text(self) -> str:
        lines = [f"fit on {self.machine.describe()}; target weights from {self.weights_basis}"]
        for phase in self.phases:
            lines.append(f"  {phase.phase}: {phase.verdict.upper() if phase.verdict != 'fits' else 'fits'}")
            lines += [f"    {need.line()}" for need in phase.needs]
            lines += [f"    note: {note}" for note in phase.notes]
        if self.choices:
            lines.append("chosen (auto):")
            lines += [f"  {c.setting} = {c.value}: {c.why}" for c in self.choices]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine.as_dict(),
            "weights_basis": self.weights_basis,
            "phases": [
                {
                    "phase": p.phase,
                    "verdict": p.verdict,
                    "needs": [
                        {
                            "resource": n.resource,
                            "need_gib": None if n.need is None else round(n.need / GIB, 3),
                            "have_gib": None if n.have is None else round(n.have / GIB, 3),
                            "verdict": n.verdict,
                            "detail": n.detail,
                            "setting": n.setting,
                        }
                        for n in p.needs
                    ],
                    "time_s": p.time_s,
                    "time_basis": p.time_basis,
                    "notes": p.notes,
                }
                for p in self.phases
            ],
            "choices": [{"setting": c.setting, "value": c.value, "why": c.why} for c in self.choices],
            "notes": self.notes,
        }


@dataclass(frozen=True)
class Workload:
    """The tokens the phases will handle: all of training_data's (train + eval), and those still to generate."""

    tokens: int | None
    completion_left: int | None
    basis: str


def workload_from_budgets(config: PipelineConfig) -> Workload:
    budgets = [d.token_budget for d in config.datasets]
    if any(b is None for b in budgets):
        return Workload(None, None, "a dataset has no token_budget and its prompts are not materialized")
    total = sum(b for b in budgets if b is not None)
    unit = config.generation.budget_counts
    return Workload(total, total, f"the datasets' token budgets ({total:,} tokens of {unit.replace('_', ' ')})")
