"""The benchmark's sweep within its budget, the speedup's bootstrap interval, the best configuration per
concurrency (the baseline kept when none beats it), and the table and chart of the result (plain data: the
requests' records are built here, no server)."""

from __future__ import annotations

import pytest

from eagle3_pipeline.config import DrafterBenchmarkConfig
from eagle3_pipeline.drafter.serve.client import Acceptance, Measured, RequestRecord
from eagle3_pipeline.drafter.serve.report import ArmResult, BenchmarkResult
from eagle3_pipeline.drafter.serve.sweep import SpeculativeConfig, Speedup, best_at, configurations, speedup


def level(concurrency: int, latencies: list[float], wall_s: float, tokens: int = 100) -> Measured:
    records = [
        RequestRecord(i, tokens, [7] * tokens, "x" * tokens, lat, lat / 10, lat) for i, lat in enumerate(latencies)
    ]
    return Measured(concurrency, records, wall_s, None)


def test_the_sweep_measures_steps_first_then_the_grid_within_the_server_starts() -> None:
    settings = DrafterBenchmarkConfig(
        steps=3, sweep_steps=[1, 3, 5], sweep_topk=[1, 4], sweep_draft_tokens=[8, 32], max_server_starts=5
    )
    measured, not_run = configurations(settings)
    # K3 chain once; a tree never verifies more than K × top-k + 1 tokens (K1·top4 takes 8 > 5 out)
    assert [c.label for c in measured] == ["K3·top1·4", "K1·top1·2", "K3·top4·8", "K5·top1·6"]
    assert [c.label for c in not_run] == ["K5·top4·8"]
    assert configurations(settings.model_copy(update={"max_server_starts": 20}))[1] == []
    assert SpeculativeConfig(3, 1, 99).verified == 4, "a chain verifies K + 1 whatever is asked"


def test_a_tree_is_refused_for_vllm_and_needs_its_draft_tokens() -> None:
    with pytest.raises(ValueError, match="vLLM's EAGLE-3 drafts a chain"):
        DrafterBenchmarkConfig(server="vllm", sweep_topk=[1, 4], sweep_draft_tokens=[8])
    with pytest.raises(ValueError, match="sweep_draft_tokens: required"):
        DrafterBenchmarkConfig(sweep_topk=[4])
    with pytest.raises(ValueError, match="serve_concurrency 8 is not one of concurrencies"):
        DrafterBenchmarkConfig(concurrencies=[1, 4], serve_concurrency=8)
    assert DrafterBenchmarkConfig(concurrencies=[1, 4]).chosen_concurrency == 4


def test_the_speedup_interval_comes_from_the_requests_and_narrows_with_them() -> None:
    base = level(1, [2.0] * 8, 16.0)
    same = speedup(base, level(1, [1.0] * 8, 8.0))
    assert (same.value, same.low, same.high) == (2.0, 2.0, 2.0), "no spread between prompts: no uncertainty"
    mixed = [0.5, 1.5] * 4
    wide = speedup(base, level(1, mixed, sum(mixed)))
    assert wide.low < wide.value == 2.0 < wide.high
    many = speedup(level(1, [2.0] * 64, 128.0), level(1, mixed * 8, sum(mixed) * 8))
    assert many.half_width < wide.half_width
    assert speedup(base, level(1, mixed, sum(mixed))) == wide, "seeded: the same interval every time"


def test_the_best_configuration_per_concurrency_or_the_baseline() -> None:
    chain, tree = SpeculativeConfig(3), SpeculativeConfig(5, 4, 16)
    base1, base16 = level(1, [2.0] * 4, 8.0), level(16, [4.0] * 4, 2.0)
    arms = [
        ArmResult("a", chain, [level(1, [1.0] * 4, 4.0), level(16, [5.0] * 4, 2.5)], Acceptance(2.5, None)),
        ArmResult("b", tree, [level(1, [0.8] * 4, 3.2), level(16, [8.0] * 4, 4.0)], Acceptance(3.1, None)),
    ]
    result = BenchmarkResult("sglang", ArmResult("baseline", None, [base1, base16], None), arms, [tree], 16)
    assert result.best(1).config == tree and "K5·top4·16 is fastest at concurrency 1" in result.best(1).reason
    # at 16 the verify steps cost more than they save: the target alone stays
    assert result.choice.config is None
    assert result.choice.reason.startswith("no configuration beats the target alone at concurrency 16 (speedup")
    assert "the fastest, K3·top1·4, makes 160.0 tok/s against the baseline's 200.0" in result.choice.reason
    metadata = result.as_metadata()
    assert metadata["chosen"] == "baseline" and metadata["choice"] == {"config": None, "reason": result.choice.reason}
    assert metadata["tokens_per_s_baseline@c16"] == 200.0 and metadata["speedup_best@c1"] == 2.5
    assert metadata["tau_server"] == 2.5 and metadata["speedup"] == 0.8  # the fastest at 16, K3
    table = metadata["table"]
    assert "| 1 | K5·top4·16 **best** | 125.0 |" in table and "| 16 | baseline | 200.0 |" in table
    assert "Served at concurrency 16: no configuration beats" in table and "Not run (max_server_starts)" in table
    chart = metadata["chart"].splitlines()
    assert chart[0] == chart[-1] == "```" and "concurrency 16 (output tokens/s)" in chart
    first = chart[1 : chart.index("concurrency 16 (output tokens/s)")]
    bars = {line.split()[0]: line.count("█") for line in first if "█" in line}
    assert bars == {"baseline": 13, "K3·top1·4": 26, "K5·top4·16": 32}, bars
    assert best_at(4, 10.0, []).config is None
    # faster, but within what the prompt mix moves: not a win
    unsure = best_at(4, 10.0, [(chain, 11.0, Speedup(1.1, 0.95, 1.3)), (tree, 10.5, Speedup(1.05, 1.01, 1.1))])
    assert unsure.config == tree and unsure.reason.startswith("K5·top4·16 is fastest at concurrency 4: 10.5 tok/s")
    assert best_at(4, 10.0, [(chain, 11.0, Speedup(1.1, 0.95, 1.3))]).config is None
