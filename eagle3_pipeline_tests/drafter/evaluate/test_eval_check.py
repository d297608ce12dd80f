"""The evaluate phase on a real (small) hidden-state store, the closing table, and the blocking
check against materializations recorded on a real Dagster instance."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import pytest

from eagle3_pipeline.components.eagle3.drafter_eval import DRAFTER_EVAL, build_drafter_eval, materialization_metadata
from eagle3_pipeline.config import load_config
from eagle3_pipeline.drafter.evaluate.acceptance import target_reference
from eagle3_pipeline.drafter.evaluate.phase import EvaluateError, run, target_next_argmax
from eagle3_pipeline.drafter.evaluate.results import (
    WARNING,
    Tally,
    results_metadata,
    speedup_estimate,
    summary_table,
    tau_regressions,
    totals,
)
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.stores import noisy_sample, periodic_sample, write_store, write_vocab
from eagle3_pipeline.testing.tiny_store import random_target
from eagle3_pipeline_tests.dagster_runs import pipeline_resources


@pytest.fixture
def store_and_vocab(tmp_path: Path) -> tuple[Path, Path]:
    samples = [(f"train-{i}", "B1", "train", *periodic_sample(12)) for i in range(4)]
    samples += [("eval-0", "B1", "eval", *periodic_sample(9)), ("eval-1", "B1", "eval", *periodic_sample(9))]
    samples += [("eval-2", "B2", "eval", *noisy_sample(20, seed=3))]
    write_store(tmp_path / "hidden_states", samples)
    return tmp_path / "hidden_states", write_vocab(tmp_path / "draft_vocab", [5, 6, 7, 8, *range(10, 20)])


def test_bigram_baseline_on_a_store_has_the_worked_out_tau(store_and_vocab: tuple[Path, Path]) -> None:
    store, vocab = store_and_vocab
    recorder = Recorder()
    result = run({"store": str(store), "draft_vocab": str(vocab), "drafter": None}, recorder)
    # B1: 9 periodic response tokens drafted perfectly. K=3: steps of 4 and 4 tokens -> 4.0;
    # K=5: 6 then the last 2 -> 4.0; K=7: one step of all 8 -> 8.0
    assert result["bigram_tau@3/B1"] == 4.0
    assert result["bigram_tau@5/B1"] == 4.0
    assert result["bigram_tau@7/B1"] == 8.0
    assert result["bigram_accept_d1/B1"] == 1.0
    assert 1.0 <= result["bigram_tau@3/B2"] < 1.5  # random tokens
    assert result["eval_samples/B1"] == 2 and result["eval_samples/all"] == 3
    assert not any(key.startswith("tau@") for key in result)
    assert "| B1 | 2 | — | — | — | — | — | 4.00/4.00/8.00 | — |" in result["table"]
    # no target_weights: agreement and τ against the target's argmax are absent and said to be, not 0
    assert not any(key.startswith(("data_agreement", "tau_vs_target", "bigram_tau_vs_target")) for key in result)
    assert "τ vs target and agreement: not computed: the evaluate spec names no target_weights" in result["table"]
    assert recorder.points[-1] == {"eval_samples_done": 3, "eval_samples": 3}
    capped = run({"store": str(store), "draft_vocab": str(vocab), "max_samples_per_dataset": 1}, Recorder())
    assert capped["eval_samples/B1"] == 1


def test_held_out_ids_are_evaluated_apart_and_besides_the_cap(store_and_vocab: tuple[Path, Path]) -> None:
    store, vocab = store_and_vocab
    spec = {"store": str(store), "draft_vocab": str(vocab), "max_samples_per_dataset": 1}
    spec["held_out_version"] = "test"
    result = run({**spec, "held_out": {"B1": ["eval-1"], "B2": []}}, Recorder())
    assert result["eval_samples/B1"] == 2  # eval-0 under the cap, eval-1 held out
    assert result["held_out_samples/B1"] == 1 and "held_out_samples/B2" not in result
    assert result["held_out_bigram_tau@3/B1"] == 4.0 and result["held_out_samples/all"] == 1
    assert "| B1 held-out | 1 | — | — | — | — | — | 4.00/4.00/8.00 | — |" in result["table"]
    assert (
        "held-out rows: the ids training_data holds out per dataset (training_data.held_out_per_dataset; B1 1, B2 0)"
        in result["table"]
    )
    stale = run({**spec, "held_out": {"B1": ["eval-1"]}, "held_out_version": "other"}, Recorder())
    assert "held_out_samples/B1" not in stale
    assert stale["held_out"].startswith("not computed: the held-out ids are training_data version other's")
    none = run({**spec, "held_out": {"B1": []}}, Recorder())
    assert none["held_out"] == "none (training_data.held_out_per_dataset is 0)"
    with pytest.raises(EvaluateError, match="held-out id\\(s\\) train-2 are in the train split"):
        run({**spec, "held_out": {"B1": ["train-2"]}}, Recorder())


def test_the_targets_argmax_is_computed_where_a_draft_is_compared() -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    hidden, lm_head = torch.randn(2500, 8, generator=generator), torch.randn(32, 8, generator=generator)
    needed = torch.rand(2500, generator=generator) > 0.5
    full = (hidden @ lm_head.T).argmax(-1)
    assert torch.equal(target_next_argmax(hidden, lm_head), full)  # three chunks
    part = target_next_argmax(hidden, lm_head, needed)
    assert torch.equal(part[needed], full[needed]) and bool((part[~needed] == -1).all())


def test_a_target_of_another_size_than_the_store_is_refused_by_name(
    store_and_vocab: tuple[Path, Path], tmp_path: Path
) -> None:
    store, vocab = store_and_vocab
    target = random_target(tmp_path / "target", hidden=16, vocab=32)
    with pytest.raises(
        EvaluateError, match="the target has hidden 16, vocab 32; .* made from one with hidden 8, vocab 32"
    ):
        run(
            {"store": str(store), "draft_vocab": str(vocab), "target_weights": str(target)},
            Recorder(),
        )


def test_bad_specs_and_missing_inputs_name_what_is_wrong(store_and_vocab: tuple[Path, Path], tmp_path: Path) -> None:
    store, vocab = store_and_vocab
    with pytest.raises(EvaluateError, match="evaluate spec: draft_vocab: required field is missing"):
        run({"store": str(store)}, Recorder())
    with pytest.raises(EvaluateError, match=r"evaluate spec: steps\[0\]: .*greater than or equal to 1 \(got 0\)"):
        run({"store": str(store), "draft_vocab": str(vocab), "steps": [0]}, Recorder())
    with pytest.raises(EvaluateError, match=r"draft_cost_ratio: .*less than 1 \(got 1.5\); stepz: unknown key"):
        run({"store": str(store), "draft_vocab": str(vocab), "draft_cost_ratio": 1.5, "stepz": [3]}, Recorder())
    with pytest.raises(EvaluateError, match=r"held_out\.B1\[0\]: Input should be a valid string \(got 7\)"):
        run({"store": str(store), "draft_vocab": str(vocab), "held_out": {"B1": [7]}}, Recorder())
    with pytest.raises(ValueError, match="no draft vocabulary; materialize draft_vocab first"):
        run({"store": str(store), "draft_vocab": str(tmp_path / "nowhere")}, Recorder())
    other = write_vocab(tmp_path / "too_small", [5, 6])
    # a vocabulary for another target (t2d of another size) is refused by name
    import torch
    from safetensors.torch import save_file

    save_file(
        {"d2t": torch.zeros(2, dtype=torch.int64), "t2d": torch.tensor([True, True, False])},
        str(other / "vocab.safetensors"),
    )
    with pytest.raises(EvaluateError, match="t2d covers 3 target tokens"):
        run({"store": str(store), "draft_vocab": str(other)}, Recorder())


def hand_results() -> dict[str, Any]:
    """Drafter and bigram stats from hand-made prediction tensors (the walker's own test data). The
    drafter drafts the stored tokens; B1_chat's data are the target's greedy output, while at B3_code
    the target's argmax for x_8 is another token (its data disagree with the target there)."""
    tokens = np.array([100, 101, 102, 103, 10, 11, 12, 13, 14, 15, 16, 17])
    mask = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    padded = np.concatenate([tokens, np.full(9, -1)])
    perfect = np.stack([padded[np.arange(12) + 2 + j] for j in range(7)])
    wrong = np.full_like(perfect, -1)
    greedy = np.concatenate([tokens[1:], [0]])  # next_argmax[p] = x_{p+1}
    other = greedy.copy()
    other[7] = 99  # the target would have said 99 after x_7
    groups, held = {}, {}
    for dataset, bigram, argmax in (("B1_chat", wrong, greedy), ("B3_code", perfect, other)):
        groups[dataset] = Tally.empty((3, 5, 7), drafter=True, target=True)
        groups[dataset].add(tokens, mask, bigram, perfect, target_reference(tokens, argmax))
    held["B1_chat"] = Tally.empty((3, 5, 7), drafter=True, target=True)
    held["B1_chat"].add(tokens, mask, wrong, perfect, target_reference(tokens, greedy))
    return results_metadata(totals(groups), totals(held), draft_cost_ratio=0.02, min_data_agreement=0.9)


def test_summary_table_has_tau_both_ways_agreement_bigram_and_speedup_estimate() -> None:
    metadata = hand_results()
    # perfect drafts on an 8-token response: K=3 -> 7 tokens / 2 steps; K=5 -> 7/2; K=7 -> 7/1
    assert metadata["tau@3/B1_chat"] == 3.5 and metadata["tau@7/B1_chat"] == 7.0
    assert metadata["tau_vs_target@7/B1_chat"] == 7.0 and metadata["data_agreement/B1_chat"] == 1.0
    # B3_code against the target: 6 of the 7 compared tokens x_5..x_11 agree; K=7 drafts x_5..x_11 from t=3 and
    # x_8 is rejected: 3 accepted + the target's token (4), then t=7 drafts x_9..x_11, the end (3) -> 7/2.
    # K=3 never compares x_8 (it is step 1's bonus token): 3.5 both ways.
    assert metadata["data_agreement/B3_code"] == round(6 / 7, 4)
    assert (metadata["tau@7/B3_code"], metadata["tau_vs_target@7/B3_code"]) == (7.0, 3.5)
    assert (metadata["tau@3/B3_code"], metadata["tau_vs_target@3/B3_code"]) == (3.5, 3.5)
    assert metadata["bigram_tau_vs_target@7/B3_code"] == 3.5 and metadata["data_agreement/all"] == round(13 / 14, 4)
    assert metadata["speedup_est@7/B1_chat"] == pytest.approx(round(7.0 / (1 + 7 * 0.02), 4))
    assert metadata["held_out_tau@7/B1_chat"] == 7.0 and metadata["held_out_data_agreement/B1_chat"] == 1.0
    assert list(metadata)[:2] == ["table", WARNING]
    assert metadata[WARNING].startswith(
        "B3_code: the stored next token is the target's argmax at only 85.7% of 7 eval positions"
    )
    assert "(τ@7: 7.00 against the stored tokens, 3.50 against the target's argmax)" in metadata[WARNING]
    assert [line.split(":")[0] for line in metadata[WARNING].splitlines()] == ["B3_code"]  # not B1_chat, not all
    table = summary_table(metadata)
    assert table == metadata["table"]
    lines = table.splitlines()
    assert (
        lines[0]
        == "| dataset | samples | τ@3 | τ@5 | τ@7 | τ vs target@3/5/7 | agreement | bigram τ@3/5/7 | est. speedup |"
    )
    assert "| B1_chat | 1 | 3.50 | 3.50 | 7.00 | 3.50/3.50/7.00 | 100.0% | 1.00/1.00/1.00 | 6.14× (K=7) |" in lines
    assert "| B1_chat held-out | 1 | 3.50 | 3.50 | 7.00 | 3.50/3.50/7.00 | 100.0% | 1.00/1.00/1.00 | — |" in lines
    assert "| B3_code | 1 | 3.50 | 3.50 | 7.00 | 3.50/3.50/3.50 | 85.7% | 3.50/3.50/7.00 | 6.14× (K=7) |" in lines
    assert any(line.startswith("| all | 2 |") for line in lines) and any(
        line.startswith("| all held-out | 1 |") for line in lines
    )
    assert "warning: B3_code: the stored next token is the target's argmax at only 85.7%" in table
    assert speedup_estimate(2.0, 3, 0.0) == 2.0


def test_the_materialization_puts_the_table_first_then_the_warning() -> None:
    ordered = materialization_metadata({"eval_samples/all": 3, WARNING: "B2: low", "table": "| t |"})
    assert list(ordered) == ["table", WARNING, "eval_samples/all"]
    assert isinstance(ordered["table"], dg.MarkdownMetadataValue) and ordered["eval_samples/all"] == 3


def test_regression_rules() -> None:
    previous = {"tau@3/B1": 2.5, "tau@3/all": 2.4, "bigram_tau@3/B1": 1.4}
    assert tau_regressions({"tau@3/B1": 2.45, "tau@3/all": 2.4}, previous, 1.0, 0.1) == []
    problems = tau_regressions({"tau@3/B1": 2.2, "tau@3/all": 1.9, "bigram_tau@3/B1": 1.0}, previous, 2.0, 0.1)
    assert problems == [
        "tau@3/B1 fell from 2.500 to 2.200 (more than 0.1)",
        "tau@3/all = 1.900 is below the floor 2",
        "tau@3/all fell from 2.400 to 1.900 (more than 0.1)",
    ]
    assert tau_regressions({"tau@5/B1": 3.0}, None, 1.0, 0.1) == []


def _check_run(instance: dg.DagsterInstance, config_path: Path, metadata: Mapping[str, Any]) -> dg.AssetCheckEvaluation:
    """Record one drafter_eval materialization on the instance, then run only the blocking check."""
    instance.report_runless_asset_event(
        dg.AssetMaterialization(DRAFTER_EVAL, metadata=materialization_metadata(metadata))
    )
    recorded = instance.fetch_materializations(DRAFTER_EVAL, limit=1).records[0].asset_materialization
    assert recorded is not None and next(iter(recorded.metadata)) == "table"  # the τ table first, as the UI lists it
    asset, check = build_drafter_eval(load_config(config_path))
    result = dg.materialize(
        [asset, check],
        instance=instance,
        selection=dg.AssetSelection.checks(check),
        resources=pipeline_resources(config_path),
        raise_on_error=False,
    )
    evaluations = result.get_asset_check_evaluations()
    assert len(evaluations) == 1
    return evaluations[0]


@pytest.mark.slow
def test_blocking_check_fails_on_a_regression_against_the_previous_materialization(
    tmp_path: Path, dagster_home: Path
) -> None:
    from eagle3_pipeline.config import local_profile_path

    config_path = tmp_path / "pipeline.yaml"
    text = (
        local_profile_path()
        .read_text()
        .replace("../samples/", str(local_profile_path().parent.parent / "samples") + "/")
    )
    config_path.write_text(text + "drafter_eval:\n  min_tau: 1.5\n  max_tau_drop: 0.2\n")
    good = hand_results()
    with dg.DagsterInstance.get() as instance:
        first = _check_run(instance, config_path, good)
        assert first.passed, first.description
        assert "no previous run" in (first.description or "")
        worse = {**good, "tau@7/B3_code": good["tau@7/B3_code"] - 0.5}
        second = _check_run(instance, config_path, worse)
        assert not second.passed
        assert second.description == "tau@7/B3_code fell from 7.000 to 6.500 (more than 0.2)"
        assert second.severity == dg.AssetCheckSeverity.ERROR
        bigram_only = {
            key: value
            for key, value in good.items()
            if not key.startswith(("tau@", "tau_position@", "accept_d", "speedup"))
        }
        third = _check_run(instance, config_path, bigram_only)
        assert not third.passed
        assert "no drafter τ" in (third.description or "")
