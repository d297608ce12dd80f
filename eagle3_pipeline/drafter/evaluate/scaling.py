"""τ against the training tokens the drafter has seen, a saturating fit of it per eval dataset, and
what more data of a dataset would buy: the τ to expect, and the time and money its generation takes
on each backend the planner knows.

The trainer records the curve (``tau_curve``) at every checkpoint (:func:`new_curve`, :func:`curve_point`,
:func:`write_curve`); :func:`data_scaling` fits it and prices the data. The curve's format, the fit,
the prediction and when there is no figure: drafter/DESIGN.md, "The τ curve and what more data buys".
numpy only; the planner (and the generation package under it) is imported by the functions that read
the pipeline's artifacts, so the trainer imports this module for the curve alone.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from eagle3_pipeline.drafter.evaluate.acceptance import ALL, AcceptanceStats

if TYPE_CHECKING:
    from eagle3_pipeline.config import InferenceConfig
    from eagle3_pipeline.generation.planning import Backend, Throughput

TAU_CURVE_FILE = "tau_curve.json"
MIN_POINTS = 5
MULTIPLES = (2, 5, 10)  # the data grown to ×m (another (m−1)·D_X training tokens)
B_RANGE = (0.02, 4.0)  # the exponent's search range
GRID = 160
CONFIDENCE = 0.95


# --- the curve the trainer records ---------------------------------------------------------------


def new_curve(k: int, epochs: int, data_tokens: Mapping[str, int]) -> dict[str, Any]:
    return {"k": k, "epochs": epochs, "data_tokens": dict(sorted(data_tokens.items())), "points": []}


_RowKey = TypeVar("_RowKey", bound=Hashable)


def tokens_seen(
    batches: Sequence[Sequence[Sequence[_RowKey]]],
    epoch: int,
    batch_index: int,
    tokens_of: Mapping[_RowKey, tuple[str, int]],
) -> dict[str, int]:
    """Training tokens per dataset consumed up to the data position ``(epoch, batch_index)`` (the
    next batch to train): every batch of the earlier epochs and the first ``batch_index`` of this
    one. ``tokens_of`` maps a row to (dataset, loss-masked tokens)."""
    seen: dict[str, int] = {}
    for batch in [*(b for earlier in batches[:epoch] for b in earlier), *batches[epoch][:batch_index]]:
        for row in batch:
            dataset, tokens = tokens_of[row]
            seen[dataset] = seen.get(dataset, 0) + tokens
    return dict(sorted(seen.items()))


def curve_point(
    step: int, seen: Mapping[str, int], acceptance: Mapping[str, AcceptanceStats], k: int
) -> dict[str, Any]:
    """One checkpoint's entry: ``acceptance`` holds the per-dataset stats and ``all``."""
    return {
        "step": step,
        "tokens": sum(seen.values()),
        "tokens_by_dataset": dict(seen),
        "tau": {dataset: round(stats.tau(k), 4) for dataset, stats in acceptance.items()},
        "verify_steps": {dataset: stats.walk_steps[k] for dataset, stats in acceptance.items()},
    }


def write_curve(run_dir: Path, curve: Mapping[str, Any]) -> Path:
    path = Path(run_dir) / TAU_CURVE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(curve, indent=1))
    os.replace(tmp, path)
    return path


def read_curve(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / TAU_CURVE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


# --- the fit ---------------------------------------------------------------------------------------


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``dof`` degrees of freedom: the density
    integrated by Simpson's rule, the quantile by bisection (no scipy here)."""
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def cdf(t: float) -> float:
        x = np.linspace(0.0, t, 2001)
        y = np.exp(log_norm - (dof + 1) / 2 * np.log1p(x * x / dof))
        h = t / 2000
        return 0.5 + h / 3 * float(y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum())

    low, high = 0.0, 1000.0
    for _ in range(80):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class NoFit:
    """Why there is no figure for a dataset."""

    dataset: str
    reason: str


@dataclass(frozen=True)
class Prediction:
    tau: float
    low: float
    high: float

    def text(self) -> str:
        return f"{self.tau:.2f} [{self.low:.2f}, {self.high:.2f}]"


@dataclass(frozen=True)
class PowerFit:
    """τ(N) = tau_inf − a·(N/n_last)^(−b), fitted on ``points`` checkpoints."""

    dataset: str
    k: int
    tau_inf: float
    a: float
    b: float
    n_last: float
    points: int
    residual_sd: float
    covariance: tuple[tuple[float, ...], ...]
    eval_steps: int

    def value(self, tokens: float) -> float:
        return self.tau_inf - self.a * (tokens / self.n_last) ** (-self.b)

    def predict(self, tokens: float) -> Prediction:
        """τ at ``tokens`` training tokens of the dataset, with its 95 % interval (module doc)."""
        x = tokens / self.n_last
        grad = np.array([1.0, -(x ** (-self.b)), self.a * x ** (-self.b) * math.log(x)])
        fit_var = float(grad @ np.array(self.covariance) @ grad)
        tau = min(max(self.value(tokens), 1.0), self.k + 1.0)
        eval_var = (tau - 1.0) * (self.k + 1.0 - tau) / max(self.eval_steps, 1)
        half = t_quantile(0.5 + CONFIDENCE / 2, self.points - 3) * math.sqrt(max(fit_var, 0.0) + eval_var)
        return Prediction(tau, max(1.0, tau - half), min(self.k + 1.0, tau + half))


def _linear(x: np.ndarray, y: np.ndarray, b: float) -> tuple[float, float, float]:
    """(tau_inf, a, RSS) of the least-squares fit at exponent ``b``."""
    design = np.stack([np.ones_like(x), -(x ** (-b))], axis=1)
    (c, a), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ np.array([c, a])
    return float(c), float(a), float(residual @ residual)


def fit_tau(dataset: str, tokens: Iterable[float], taus: Iterable[float], k: int, eval_steps: int) -> PowerFit | NoFit:
    """The power-law fit of τ@k against the training tokens of ``dataset`` (module doc), or why not."""
    pairs = sorted((float(n), float(t)) for n, t in zip(tokens, taus, strict=True) if n > 0)
    if len(pairs) < MIN_POINTS:
        return NoFit(dataset, f"too few points (n = {len(pairs)} < {MIN_POINTS} checkpoints)")
    n_last = pairs[-1][0]
    x = np.array([n for n, _ in pairs]) / n_last
    y = np.array([t for _, t in pairs])
    grid = np.geomspace(*B_RANGE, GRID)
    rss = [_linear(x, y, b)[2] for b in grid]
    best = int(np.argmin(rss))
    low, high = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, GRID - 1)])
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        if _linear(x, y, math.exp(left))[2] <= _linear(x, y, math.exp(right))[2]:
            high = right
        else:
            low = left
    b = math.exp((low + high) / 2)
    tau_inf, a, residual = _linear(x, y, b)
    sd = math.sqrt(residual / (len(pairs) - 3))
    rise = a * (x[1] ** (-b) - 1.0)  # from the second checkpoint on: a first point alone below the rest is no trend
    if a <= 0 or rise <= 2 * sd:
        return NoFit(
            dataset,
            f"no improvement yet (fitted rise {rise:+.3f} from the second checkpoint to the last, "
            f"residual sd {sd:.3f}): "
            "a flat curve cannot tell what new data would add",
        )
    if b >= B_RANGE[1] * 0.99:
        return NoFit(
            dataset,
            "no improvement yet after the first checkpoint "
            f"(the curve is a step: exponent b at its bound {B_RANGE[1]:g})",
        )
    if b <= B_RANGE[0] * 1.01:
        return NoFit(
            dataset,
            f"no saturation visible (exponent b at its bound {B_RANGE[0]:g}: "
            "a line in log N, its ceiling undetermined)",
        )
    if tau_inf > k + 1:
        return NoFit(
            dataset,
            f"no saturation visible (fitted ceiling {tau_inf:.2f} > K+1 = {k + 1}): "
            "the data do not say where it levels off",
        )
    jacobian = np.stack([np.ones_like(x), -(x ** (-b)), a * x ** (-b) * np.log(x)], axis=1)
    try:
        covariance = sd**2 * np.linalg.inv(jacobian.T @ jacobian)
    except np.linalg.LinAlgError:
        return NoFit(dataset, "degenerate fit (the points do not determine the three parameters)")
    return PowerFit(
        dataset, k, tau_inf, a, b, n_last, len(pairs), sd, tuple(map(tuple, covariance.tolist())), eval_steps
    )


def fit_curve(curve: Mapping[str, Any]) -> dict[str, PowerFit | NoFit]:
    """A fit per eval dataset of the curve, and ``all`` against the tokens of every dataset."""
    k = int(curve["k"])
    points = curve["points"]
    datasets = sorted({d for p in points for d in p["tau"]} - {ALL}) + (
        [ALL] if any(ALL in p["tau"] for p in points) else []
    )
    fits: dict[str, PowerFit | NoFit] = {}
    for dataset in datasets:
        if dataset != ALL and not curve["data_tokens"].get(dataset):
            fits[dataset] = NoFit(dataset, "no training tokens of this dataset: more of it is not on the curve")
            continue
        used = [p for p in points if dataset in p["tau"]]
        tokens = [p["tokens"] if dataset == ALL else p["tokens_by_dataset"].get(dataset, 0) for p in used]
        steps = used[-1]["verify_steps"].get(dataset, 0) if used else 0
        fits[dataset] = fit_tau(dataset, tokens, [p["tau"][dataset] for p in used], k, steps)
    for dataset in sorted(set(curve["data_tokens"]) - set(fits)):
        fits[dataset] = NoFit(dataset, "no eval sample of this dataset: τ is not measured")
    return fits


# --- what more data buys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BackendCost:
    backend: str
    eta_s: float | None
    cost: float | None


@dataclass(frozen=True)
class Purchase:
    """The data of ``dataset`` grown to ``multiple`` times: what to generate, what τ to expect."""

    dataset: str
    multiple: int
    extra_tokens: int  # training tokens to add
    completion_tokens: int | None
    prompt_tokens: int | None
    tau: Prediction
    costs: tuple[BackendCost, ...]


@dataclass(frozen=True)
class Generated:
    """What a dataset's generation so far produced: completion and prompt tokens (None: no record)."""

    completion: int | None
    prompt: int | None


@dataclass
class ScalingTable:
    k: int
    epochs: int
    backends: list[str]
    now: dict[str, tuple[int, float]]  # dataset -> (training tokens, τ@k at the last checkpoint)
    fits: dict[str, PowerFit | NoFit]
    purchases: list[Purchase] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[list[str]]:
        k = self.k
        header = [
            "dataset",
            "train tokens",
            f"τ@{k} now",
            "data",
            "+ train tokens",
            "completion tokens",
            f"τ@{k} expected [95 %]",
        ]
        header += [f"{b}: {what}" for b in self.backends for what in ("time", "$")]
        lines = [header]
        for p in self.purchases:
            cells = [
                p.dataset,
                f"{self.now[p.dataset][0]:,}",
                f"{self.now[p.dataset][1]:.2f}",
                f"×{p.multiple}",
                f"+{p.extra_tokens:,}",
                "unknown" if p.completion_tokens is None else f"{p.completion_tokens:,}",
                p.tau.text(),
            ]
            for c in p.costs:
                cells += [_duration(c.eta_s), _dollars(c.cost)]
            lines.append(cells)
        return lines

    def refusals(self) -> list[str]:
        return [f"{d}: no figure — {f.reason}" for d, f in self.fits.items() if isinstance(f, NoFit)]

    def fitted(self) -> list[str]:
        return [
            f"{d}: τ∞ {f.tau_inf:.2f}, a {f.a:.3f}, b {f.b:.2f} over {f.points} checkpoints "
            f"(residual sd {f.residual_sd:.3f}, "
            f"{f.eval_steps} eval verify steps)"
            for d, f in self.fits.items()
            if isinstance(f, PowerFit)
        ]

    def heading(self) -> str:
        return (
            f"τ@{self.k} against the training tokens seen, fitted per dataset as τ(N) = τ∞ − a·(N/N_last)^−b; "
            f"train tokens: the loss-masked tokens of a dataset's train rows; more of them assumes the same recipe "
            f"({self.epochs} epochs over the larger data)"
        )

    def text(self) -> str:
        lines = self.rows()
        out = [self.heading()]
        if len(lines) > 1:
            widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
            out += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in lines]
        return "\n".join(out + self.fitted() + self.refusals() + self.notes)

    def markdown(self) -> str:
        header, *body = self.rows()
        lines = [self.heading(), ""]
        if body:
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(row) + " |" for row in body]
            lines.append("")
        return "\n".join(lines + [f"- {line}" for line in self.fitted() + self.refusals() + self.notes])

    def as_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "purchases": [
                {
                    "dataset": p.dataset, "multiple": p.multiple, "extra_train_tokens": p.extra_tokens,
                    "completion_tokens": p.completion_tokens, "prompt_tokens": p.prompt_tokens,
                    "tau": p.tau.tau, "tau_low": p.tau.low, "tau_high": p.tau.high,
                    "backends": [{"backend": c.backend, "eta_s": c.eta_s, "cost_usd": c.cost} for c in p.costs],
                }
                for p in self.purchases
            ],
            "no_figure": {d: f.reason for d, f in self.fits.items() if isinstance(f, NoFit)},
            "notes": self.notes,
        }  # fmt: skip


def _dollars(cost: float | None) -> str:
    return "unknown" if cost is None else f"{cost:.2f}" if cost >= 1 else f"{cost:.2g}"


def _duration(seconds: float | None) -> str:
    from eagle3_pipeline.generation.progress import format_duration

    return "unknown" if seconds is None else format_duration(seconds)


def scaling_table(
    curve: Mapping[str, Any],
    backends: Sequence[Backend],
    throughput: Mapping[str, Throughput | None],
    generated: Mapping[str, Generated],
    multiples: Sequence[int] = MULTIPLES,
) -> ScalingTable:
    """Expected τ and generation time/cost per backend for each dataset's data grown ×m (``all``:
    every dataset grown ×m together). ``generated``: per dataset, what its generation produced."""
    from eagle3_pipeline.generation.estimate import cost_of

    fits = fit_curve(curve)
    data = {**curve["data_tokens"], ALL: sum(curve["data_tokens"].values())}
    last = curve["points"][-1] if curve["points"] else {"tau": {}, "tokens_by_dataset": {}}
    table = ScalingTable(int(curve["k"]), int(curve["epochs"]), [b.name for b in backends], {}, fits)
    parts = [generated.get(d, Generated(None, None)) for d in curve["data_tokens"]]
    every = bool(parts) and all(g.completion for g in parts)  # `all` costs what every dataset's share costs
    total = (
        Generated(sum(g.completion or 0 for g in parts), sum(g.prompt or 0 for g in parts))
        if every
        else Generated(None, None)
    )
    generated = {**generated, ALL: total}
    for dataset, fit in fits.items():
        if isinstance(fit, NoFit):
            continue
        table.now[dataset] = (int(data[dataset]), float(last["tau"][dataset]))
        made = generated.get(dataset, Generated(None, None))
        per_token = made.completion / data[dataset] if made.completion else None
        prompt_share = (made.prompt or 0) / made.completion if made.completion else None
        if per_token is None:
            table.notes.append(
                f"{dataset}: no generation record in the checkpoints, so its cost per training token is unknown"
            )
        for m in multiples:
            extra = (m - 1) * int(data[dataset])
            completion = round(extra * per_token) if per_token is not None else None
            prompt = round(completion * prompt_share) if completion is not None and prompt_share is not None else None
            costs = []
            for backend in backends:
                rate = throughput.get(backend.name)
                eta = (
                    completion / rate.tokens_per_s
                    if completion is not None and rate and rate.tokens_per_s > 0
                    else None
                )
                costs.append(BackendCost(backend.name, eta, cost_of(backend.price, prompt, completion)))
            table.purchases.append(
                Purchase(dataset, m, extra, completion, prompt, fit.predict(m * fit.n_last), tuple(costs))
            )
    ratios = [
        f"{d} {generated[d].completion / data[d]:.2f}"
        for d in table.now
        if generated.get(d) and generated[d].completion
    ]
    if ratios:
        table.notes.append("completion tokens generated per training token: " + ", ".join(ratios))
    if table.purchases:
        table.notes.append(
            "interval: t(n−3) × √(SE_fit² + SE_eval²); SE_eval bounds the eval set's sampling error "
            "((τ−1)(K+1−τ) per verify step, steps taken as independent); it assumes the model: "
            "the curve counts repeated epochs as tokens seen, and a curve "
            "flattened by over-fitting understates what new data adds"
        )
    return table


def generated_tokens(records: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Generated]:
    """Completion and prompt tokens of each dataset's answers in the response checkpoints."""
    out = {}
    for dataset, answers in records.items():
        completion = sum(int(r.get("completion_tokens") or 0) for r in answers.values())
        out[dataset] = Generated(completion or None, sum(int(r.get("prompt_tokens") or 0) for r in answers.values()))
    return out


def data_scaling(
    artifacts_root: Path,
    inference: InferenceConfig,
    target_model: str,
    dataset_ids: Sequence[str],
    records: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
    throughput: Mapping[str, Throughput | None] | None = None,
) -> ScalingTable | str:
    """The table from the pipeline's artifacts: the latest drafter run's ``tau_curve.json``, the
    response checkpoints (``records``, read when not given) and the planner's backends and throughput
    (its evidence when not given); a sentence instead when no drafter run has recorded a curve."""
    from eagle3_pipeline.drafter.spec import drafter_paths
    from eagle3_pipeline.generation.planning import checkpoint_records, configured_backends, throughput_evidence
    from eagle3_pipeline.layout import ArtifactLayout

    run_dir = drafter_paths(artifacts_root)["run_dir"]
    curve = read_curve(run_dir)
    if curve is None or not curve["points"]:
        return f"τ against training data: no curve under {run_dir} (eagle3_drafter writes it at each checkpoint)"
    records = checkpoint_records(ArtifactLayout(artifacts_root), dataset_ids) if records is None else records
    if throughput is None:
        throughput = throughput_evidence(inference, target_model, records)
    backends = configured_backends(inference, target_model)
    return scaling_table(curve, backends, throughput, generated_tokens(records))


def data_scaling_markdown(
    artifacts_root: Path, inference: InferenceConfig, target_model: str, dataset_ids: Sequence[str]
) -> str:
    """What ``drafter_eval`` shows as its ``data_scaling`` metadata (markdown)."""
    table = data_scaling(artifacts_root, inference, target_model, dataset_ids)
    return table if isinstance(table, str) else table.markdown()
