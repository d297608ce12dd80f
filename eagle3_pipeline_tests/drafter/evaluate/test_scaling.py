"""τ against the training tokens seen (drafter/evaluate/scaling.py): the fit, its refusals, the cost table
from the planner's numbers, and the curve the trainer records at its checkpoints.

The fit tests use synthetic points from a known curve; the table test a pipeline file with two
priced backends whose throughput the planner measures from response checkpoints written here; the
curve test trains a tiny drafter (random states, two datasets) for real and recomputes the tokens
seen at each checkpoint from each epoch's batches independently of the trainer's bookkeeping.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eagle3_pipeline.drafter.evaluate.scaling import (
    NoFit,
    PowerFit,
    data_scaling,
    fit_curve,
    fit_tau,
    read_curve,
    t_quantile,
)
from eagle3_pipeline.drafter.spec import drafter_paths
from eagle3_pipeline.generation.checkpoint import ResponseCheckpoint
from eagle3_pipeline.generation.planning import checkpoint_records, configured_backends, throughput_evidence
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline_tests.pipeline_files import load_pipeline

REPO = Path(__file__).resolve().parents[3]
TRUE = {"tau_inf": 3.2, "a": 1.4, "b": 0.6}
GENTLE = {"tau_inf": 3.2, "a": 0.8, "b": 0.6}  # the recorded curves' B1: τ from 1.36 at a quarter of the tokens to 2.4


def power(tokens: np.ndarray, n_last: float, tau_inf: float, a: float, b: float) -> np.ndarray:
    return tau_inf - a * (tokens / n_last) ** (-b)


def synthetic(n: int = 8, noise: float = 0.004, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.geomspace(2e4, 1e6, n)
    taus = power(tokens, tokens[-1], **TRUE) + np.random.default_rng(seed).normal(0, noise, n)
    return tokens, taus


def test_t_quantiles_match_the_tables() -> None:
    assert t_quantile(0.975, 1) == pytest.approx(12.706, abs=2e-3)
    assert t_quantile(0.975, 2) == pytest.approx(4.303, abs=2e-3)
    assert t_quantile(0.975, 10) == pytest.approx(2.228, abs=2e-3)
    assert t_quantile(0.975, 200) == pytest.approx(1.972, abs=2e-3)


def test_the_fit_recovers_known_parameters_and_its_interval_covers_the_truth() -> None:
    tokens, taus = synthetic()
    fit = fit_tau("B1", tokens, taus, k=3, eval_steps=5000)
    assert isinstance(fit, PowerFit), fit
    print(
        f"\n-- fitted τ∞ {fit.tau_inf:.3f} a {fit.a:.3f} b {fit.b:.3f} (true {TRUE}), residual sd {fit.residual_sd:.4f}"
    )
    assert fit.tau_inf == pytest.approx(TRUE["tau_inf"], abs=0.08)
    assert fit.a == pytest.approx(TRUE["a"], abs=0.08)
    assert fit.b == pytest.approx(TRUE["b"], abs=0.08)
    for m in (2, 5, 10):
        truth = float(power(np.array(m * tokens[-1]), tokens[-1], **TRUE))
        predicted = fit.predict(m * tokens[-1])
        print(f"-- ×{m}: {predicted.text()} (true {truth:.3f})")
        assert predicted.low <= truth <= predicted.high
        assert predicted.low < predicted.tau < predicted.high <= 4.0
    # The fit's part of the interval (an eval set too large to count) grows with the extrapolation;
    # fewer eval verify steps widen the interval (the eval set's own sampling error).
    exact_eval = fit_tau("B1", tokens, taus, k=3, eval_steps=10**12)
    assert isinstance(exact_eval, PowerFit)
    near, far = exact_eval.predict(2 * tokens[-1]), exact_eval.predict(10 * tokens[-1])
    assert far.high - far.low > near.high - near.low > 0
    few = fit_tau("B1", tokens, taus, k=3, eval_steps=50).predict(2 * tokens[-1])  # type: ignore[union-attr]
    some = fit.predict(2 * tokens[-1])
    assert few.high - few.low > some.high - some.low > near.high - near.low


def test_too_few_points_a_flat_curve_and_no_saturation_get_no_figure() -> None:
    tokens, taus = synthetic()
    few = fit_tau("B1", tokens[:4], taus[:4], k=3, eval_steps=1000)
    assert isinstance(few, NoFit) and few.reason == "too few points (n = 4 < 5 checkpoints)"
    flat = fit_tau("B1", tokens, 1.3 + np.random.default_rng(1).normal(0, 0.01, len(tokens)), k=3, eval_steps=1000)
    assert isinstance(flat, NoFit) and flat.reason.startswith("no improvement yet"), flat
    falling = fit_tau("B1", tokens, 2.0 - 0.1 * np.log(tokens / tokens[0]), k=3, eval_steps=1000)
    assert isinstance(falling, NoFit) and falling.reason.startswith("no improvement yet"), falling
    line = fit_tau("B1", tokens, 1.2 + 0.5 * np.log(tokens / tokens[0]), k=3, eval_steps=1000)  # still a line in log N
    assert isinstance(line, NoFit) and line.reason.startswith("no saturation visible"), line
    gentle_line = fit_tau(
        "B1", tokens, 1.2 + 0.05 * np.log(tokens / tokens[0]), k=3, eval_steps=1000
    )  # its ceiling stays under K+1
    assert isinstance(gentle_line, NoFit) and gentle_line.reason.startswith(
        "no saturation visible (exponent b at its bound"
    ), gentle_line
    step = np.where(tokens > tokens[0], 1.5, 1.0) + np.random.default_rng(2).normal(0, 0.005, len(tokens))
    stepped = fit_tau("B1", tokens, step, k=3, eval_steps=1000)
    assert isinstance(stepped, NoFit) and stepped.reason.startswith("no improvement yet after the first checkpoint"), (
        stepped
    )
    # Only the first checkpoint below a noisy plateau (the embedded default's B2_tools): no trend after it.
    jump = np.where(tokens > tokens[0], 1.14, 1.02) + np.random.default_rng(0).normal(0, 0.03, len(tokens))
    jumped = fit_tau("B2", tokens, jump, k=3, eval_steps=100)
    assert isinstance(jumped, NoFit) and "from the second checkpoint to the last" in jumped.reason, jumped


def curve(data_tokens: dict[str, int], epochs: int = 4, points: int = 8) -> dict[str, Any]:
    """A recorded curve whose B1 follows GENTLE, B2 0.3 below it; the last point is after every epoch."""
    fractions = np.geomspace(1 / 4, 1.0, points)
    k = 3
    entries = []
    for f in fractions:
        seen = {d: round(f * epochs * n) for d, n in data_tokens.items()}
        taus = {"B1": float(power(np.array(seen["B1"]), epochs * data_tokens["B1"], **GENTLE))}
        taus["B2"] = taus["B1"] - 0.3
        taus["all"] = (taus["B1"] + taus["B2"]) / 2
        entries.append({"step": len(entries) + 1, "tokens": sum(seen.values()), "tokens_by_dataset": seen, "tau": taus,
                        "verify_steps": {"B1": 4000, "B2": 4000, "all": 8000}})  # fmt: skip
    return {"k": k, "epochs": epochs, "data_tokens": data_tokens, "points": entries}


def two_backends(folder: Path) -> dict[str, Any]:
    """Pipeline sections for two priced endpoints nobody answers on and datasets B1 and B2 of one prompt."""
    (folder / "p.jsonl").write_text('{"conversations": [{"from": "human", "value": "hello"}]}\n')
    return {
        "name": "scaling",
        "target": {"model": "vendor/model", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [
            {"name": "box", "base_url": "http://127.0.0.1:9/v1",
             "price": {"prompt_per_mtok": 0.1, "completion_per_mtok": 0.2}},
            {"name": "api", "base_url": "http://127.0.0.2:9/v1",
             "price": {"prompt_per_mtok": 1.0, "completion_per_mtok": 2.0}},
        ]},
        "datasets": [{"id": "B1", "source": "p.jsonl"}, {"id": "B2", "source": "p.jsonl"}],
    }  # fmt: skip


def write_answers(config: Any, dataset: str, endpoint: str, times: list[float], completion: int, prompt: int) -> None:
    with ResponseCheckpoint(ArtifactLayout(config.artifacts_root).checkpoint(dataset)).writer() as writer:
        for i, at in enumerate(times):
            writer.append({"id": f"{dataset}-{i}", "dataset": dataset, "endpoint": endpoint, "finished_at": at,
                           "completion_tokens": completion, "prompt_tokens": prompt})  # fmt: skip


def test_the_cost_and_time_table_uses_the_planners_backends_throughput_and_prices(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, two_backends(tmp_path), runtime_checks=True)
    none = data_scaling(config.artifacts_root, config.inference, config.target.model, config.dataset_ids)
    assert isinstance(none, str) and none.startswith("τ against training data: no curve under")
    # box: 3 answers of 50 tokens over 2 s -> 50 tok/s; api: 3 of 100 over 1 s -> 200 tok/s
    # (planning.observed_throughput).
    write_answers(config, "B1", "http://127.0.0.1:9/v1", [1000.0, 1001.0, 1002.0], completion=50, prompt=20)
    write_answers(config, "B2", "http://127.0.0.2:9/v1", [1000.0, 1000.5, 1001.0], completion=100, prompt=10)
    measured = throughput_evidence(
        config.inference,
        config.target.model,
        checkpoint_records(ArtifactLayout(config.artifacts_root), config.dataset_ids),
    )
    assert {name: t.tokens_per_s for name, t in measured.items() if t} == {"box": 50.0, "api": 200.0}
    data = {"B1": 100, "B2": 300}  # training tokens: B1 cost 150 completion tokens for 100, B2 300 for 300
    run_dir = drafter_paths(config.artifacts_root)["run_dir"]
    run_dir.mkdir(parents=True)
    (run_dir / "tau_curve.json").write_text(json.dumps(curve(data)))

    table = data_scaling(config.artifacts_root, config.inference, config.target.model, config.dataset_ids)
    assert not isinstance(table, str)
    print("\n" + table.text())
    fits = fit_curve(read_curve(run_dir))  # type: ignore[arg-type]
    assert (
        [b.name for b in configured_backends(config.inference, config.target.model)] == table.backends == ["box", "api"]
    )
    rows = {(p.dataset, p.multiple): p for p in table.purchases}
    assert sorted(rows) == [(d, m) for d in ("B1", "B2", "all") for m in (2, 5, 10)]
    b1 = rows[("B1", 5)]
    assert (
        b1.extra_tokens == 400 and b1.completion_tokens == 600 and b1.prompt_tokens == 240
    )  # 1.5 completion, 0.4 prompt per
    box, api = b1.costs
    assert (box.backend, api.backend) == ("box", "api")
    assert box.eta_s == pytest.approx(600 / 50) and api.eta_s == pytest.approx(600 / 200)
    assert box.cost == pytest.approx((240 * 0.1 + 600 * 0.2) / 1e6) and api.cost == pytest.approx(
        (240 * 1.0 + 600 * 2.0) / 1e6
    )
    fit = fits["B1"]
    assert isinstance(fit, PowerFit) and b1.tau == fit.predict(5 * 4 * 100)
    truth = float(power(np.array(5 * 4 * 100.0), 4 * 100, **GENTLE))
    assert b1.tau.low <= truth <= b1.tau.high
    everything = rows[("all", 2)]
    assert everything.extra_tokens == 400 and everything.completion_tokens == 450 and everything.prompt_tokens == 90

    done = subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.cli", "plan", "--config", str(tmp_path / "pipeline.yaml"), "--json"],
        check=False, capture_output=True, text=True, timeout=120, env={**os.environ}, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)["data_scaling"]
    assert [(p["dataset"], p["multiple"], p["completion_tokens"]) for p in printed["purchases"]][:3] == [
        ("B1", 2, 150),
        ("B1", 5, 600),
        ("B1", 10, 1350),
    ]
    assert printed["purchases"][1]["backends"][1] == {
        "backend": "api",
        "eta_s": pytest.approx(3.0),
        "cost_usd": pytest.approx(api.cost),
    }


def test_a_dataset_without_generation_records_or_eval_rows_gets_unknown_or_no_figure(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, two_backends(tmp_path), runtime_checks=True)
    recorded = curve({"B1": 100, "B2": 300})
    recorded["data_tokens"]["B3"] = 50  # trained on, never evaluated
    run_dir = drafter_paths(config.artifacts_root)["run_dir"]
    run_dir.mkdir(parents=True)
    (run_dir / "tau_curve.json").write_text(json.dumps(recorded))
    table = data_scaling(config.artifacts_root, config.inference, config.target.model, config.dataset_ids)
    assert not isinstance(table, str)
    assert table.fits["B3"] == NoFit("B3", "no eval sample of this dataset: τ is not measured")
    assert all(
        p.completion_tokens is None and all(c.cost is None and c.eta_s is None for c in p.costs)
        for p in table.purchases
    )
    assert "B1: no generation record in the checkpoints, so its cost per training token is unknown" in table.text()
    assert "B3: no figure — no eval sample of this dataset" in table.text()


# --- the curve the trainer records ----------------------------------------------------------------

torch = pytest.importorskip("torch")

from eagle3_pipeline.drafter.train.checkpoint import checkpoint_dir
from eagle3_pipeline.drafter.train.data import epoch_batches, store_rows
from eagle3_pipeline.drafter.train.phase import run
from eagle3_pipeline.hidden_states.store import HiddenStateStore
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.stores import HIDDEN, VOCAB, noisy_sample, periodic_sample, write_store, write_vocab
from eagle3_pipeline.testing.tiny_store import random_target
from eagle3_pipeline.testing.train_settings import train_settings

MAX_SEQ_LEN = 16
SETTINGS = train_settings(ttt_steps=3, lr=3e-3, epochs=2, batch_tokens=48, max_seq_len=MAX_SEQ_LEN, checkpoint_every=2,
                          keep_checkpoints=3, log_every=1, eval_samples=3, seed=1)  # fmt: skip


def two_dataset_store(root: Path) -> tuple[HiddenStateStore, dict[str, tuple[str, int]]]:
    """A's responses are periodic (one longer than max_seq_len), B's random; 2 eval rows each, A's first
    in the index. Returns the store and, per sample id, (dataset, masked tokens within max_seq_len)."""
    samples = []
    for i in range(10):
        samples.append((f"a{i}", "A", "train", *periodic_sample(4 + i)))
        samples.append((f"b{i}", "B", "train", *noisy_sample(3 + i, seed=i)))
    samples.append(("a-long", "A", "train", *periodic_sample(30)))  # 33 tokens: 13 masked within the first 16
    samples += [("ea0", "A", "eval", *periodic_sample(9)), ("ea1", "A", "eval", *periodic_sample(10))]
    samples += [("eb0", "B", "eval", *noisy_sample(9, seed=50)), ("eb1", "B", "eval", *noisy_sample(10, seed=51))]
    masked = {sid: (dataset, int(mask[:MAX_SEQ_LEN].sum())) for sid, dataset, _, _, mask in samples}
    return write_store(root, samples), masked


def expected_tokens(store: HiddenStateStore, masked: dict[str, tuple[str, int]], steps: int) -> dict[str, int]:
    """Masked tokens per dataset of the first ``steps`` batches in the epochs' order, from the samples as written."""
    by_row = {(r["shard"], r["offset"]): r["sample_id"] for r in store.index().to_pylist()}
    batches = [
        b
        for e in range(SETTINGS["epochs"])
        for b in epoch_batches(store_rows(store, "train"), SETTINGS["seed"], e, SETTINGS["batch_tokens"], MAX_SEQ_LEN)
    ]
    seen: dict[str, int] = {}
    for batch in batches[:steps]:
        for row in batch:
            dataset, tokens = masked[by_row[(row.shard, row.offset)]]
            seen[dataset] = seen.get(dataset, 0) + tokens
    return seen


@pytest.mark.slow
def test_the_tau_curve_is_recorded_at_each_checkpoint_and_survives_a_resume(tmp_path: Path) -> None:
    store, masked = two_dataset_store(tmp_path / "store")
    target = random_target(tmp_path / "target", hidden=HIDDEN, vocab=VOCAB)
    write_vocab(tmp_path / "vocab", range(VOCAB))
    spec = {"store": str(tmp_path / "store"), "draft_vocab": str(tmp_path / "vocab"), "target_weights": str(target),
            "run_dir": str(tmp_path / "run"), "export_dir": str(tmp_path / "export"), "settings": SETTINGS}  # fmt: skip
    result = run(spec, Recorder())
    recorded = result["tau_curve"]
    print("\n-- tau_curve:", json.dumps(recorded)[:600])
    steps = [p["step"] for p in recorded["points"]]
    assert steps == [e["step"] for e in result["evals"]] and steps[-1] == result["steps"] and steps[:3] == [2, 4, 6]
    assert recorded["k"] == 3 and recorded["epochs"] == 2
    assert recorded["data_tokens"] == {
        d: sum(n for sid, (ds, n) in masked.items() if ds == d and not sid.startswith("e")) for d in ("A", "B")
    }
    for point in recorded["points"]:
        assert point["tokens_by_dataset"] == expected_tokens(store, masked, point["step"]), point["step"]
        assert point["tokens"] == sum(point["tokens_by_dataset"].values())
        # eval_samples 3 with A's eval rows first in the index: taken in turn, B still gets one.
        assert set(point["tau"]) == {"A", "B", "all"} and all(1.0 <= t <= 4.0 for t in point["tau"].values())
        assert point["verify_steps"]["all"] == point["verify_steps"]["A"] + point["verify_steps"]["B"] > 0
    assert recorded["points"][-1]["tokens_by_dataset"] == {d: 2 * n for d, n in recorded["data_tokens"].items()}
    assert read_curve(tmp_path / "run") == recorded

    # Back to the step-12 checkpoint (the last two removed, and the file): the resumed run carries the
    # points up to 12 from the checkpoint and measures the rest again, as the unbroken run did.
    kept = sorted(checkpoint_dir(tmp_path / "run").iterdir())
    assert [p.name for p in kept] == [f"step-{s:08d}" for s in steps[-3:]]
    for folder in kept[1:]:
        shutil.rmtree(folder)
    (tmp_path / "run" / "tau_curve.json").unlink()
    resumed = run(spec, Recorder())
    assert resumed["resumed_from_step"] == steps[-3]
    assert resumed["tau_curve"] == recorded
    assert read_curve(tmp_path / "run") == recorded
