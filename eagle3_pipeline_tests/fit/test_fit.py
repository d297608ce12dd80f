"""The resource model on the shipped Kimi-K2.5 profile (its config.json in data/kimi-k2.5) and the refusal of
a pipeline file that cannot fit, before generation; the `fit` command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3_pipeline.cli import main
from eagle3_pipeline.config import MachineConfig, load_config
from eagle3_pipeline.fit.gpus import gpu_spec
from eagle3_pipeline.fit.machine import declared
from eagle3_pipeline.fit.runtime import declared_machine, refusal, report_for, resolved

KIMI = Path(__file__).parent / "data" / "kimi-k2.5"
PROFILE = Path(__file__).parents[2] / "eagle3_pipeline" / "profiles" / "kimi-k25.yaml"


def kimi_profile(tmp_path: Path, **replace: str) -> Path:
    text = re.sub(r"  tokenizer: /models/Kimi-K2.5.*\n", f"  tokenizer: {KIMI}\n", PROFILE.read_text())
    text = text.replace("artifacts_root: /data/eagle3/kimi_k25", f"artifacts_root: {tmp_path / 'artifacts'}")
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "kimi.yaml"
    path.write_text(text)
    return path


def test_the_kimi_profile_fits_its_declared_box(tmp_path: Path) -> None:
    config = load_config(kimi_profile(tmp_path), runtime_checks=False)
    report = report_for(config, declared_machine(config))
    assert not isinstance(report, str)
    assert [p.phase for p in report.unfit()] == []
    assert {p.verdict for p in report.phases} == {"fits"}
    chosen = {c.setting: c.value for c in report.choices}
    assert 0.75 < chosen["hidden_states.mem_fraction_static"] < 0.96
    assert chosen["drafter.activation_checkpointing"] is True
    assert isinstance(chosen["hidden_states.rolling_window_shards"], int), "the ~50 TiB store exceeds 30,000 GiB"
    fitted = resolved(config, report)
    assert fitted.hidden_states.mem_fraction_static == chosen["hidden_states.mem_fraction_static"]
    assert isinstance(fitted.hidden_states.batch_tokens, int)
    assert all(p.time_s is not None for p in report.phases if p.phase in ("responses", "hidden_states"))


def test_capture_at_the_old_default_is_refused_before_generation(tmp_path: Path) -> None:
    path = kimi_profile(tmp_path, **{"mem_fraction_static: auto": "mem_fraction_static: 0.75"})
    config = load_config(path, runtime_checks=False)
    report = report_for(config, declared_machine(config))
    reason = refusal(config, report, "responses")
    assert reason is not None
    assert reason.startswith("generation is not started: a later phase cannot fit")
    assert "hidden_states" in reason and "hidden_states.mem_fraction_static" in reason
    assert (
        refusal(
            config.model_copy(update={"machine": config.machine.model_copy(update={"check": "per_phase"})}),
            report,
            "responses",
        )
        is None
    )


def test_a_disk_too_small_for_the_store_is_refused(tmp_path: Path) -> None:
    path = kimi_profile(
        tmp_path,
        **{"rolling_window_shards: auto": "rolling_window_shards: null", "disk_free_gib: 30000": "disk_free_gib: 2000"},
    )
    config = load_config(path, runtime_checks=False)
    report = report_for(config, declared_machine(config))
    reason = refusal(config, report, "responses")
    assert reason is not None and "disk" in reason and "rolling_window_shards" in reason


def test_unknown_memory_is_reported_never_refused(tmp_path: Path) -> None:
    path = kimi_profile(tmp_path, **{"  gpu: RTX PRO 6000 Blackwell\n": ""})
    config = load_config(path, runtime_checks=False)
    report = report_for(config, declared_machine(config))
    assert not isinstance(report, str)
    assert report.phase("responses").verdict == "UNKNOWN"  # type: ignore[union-attr]
    assert refusal(config, report, "responses") is None


def test_cards() -> None:
    assert gpu_spec("NVIDIA RTX PRO 6000 Blackwell Server Edition").name == "RTX PRO 6000 Blackwell"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="machine.gpu 'T4'"):
        declared(MachineConfig(gpu="T4"))


@pytest.mark.parametrize(
    ("gpu", "fraction", "code"), [("RTX PRO 6000", "0.88", 0), ("H200", "0.88", 0), ("RTX 4090", "0.9", 1)]
)
def test_fit_command(gpu: str, fraction: str, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "fit",
        "--model",
        str(KIMI),
        "--tp",
        "8",
        "--gpu",
        gpu,
        "--mem-fraction",
        fraction,
        "--context-len",
        "32768",
    ]
    assert main(args) == code
    out = capsys.readouterr().out
    assert "weights per GPU      70.95 GiB" in out
    assert "KV per token per GPU 70,272 bytes" in out


def test_fit_command_names_a_missing_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--model", str(tmp_path), "--gpu", "H100"]) == 2
    assert f"{tmp_path}/config.json: missing" in capsys.readouterr().err


def test_an_auto_capture_share_on_unknown_gpus_is_refused_at_its_phase(tmp_path: Path) -> None:
    path = kimi_profile(tmp_path, **{"  gpu: RTX PRO 6000 Blackwell\n": ""})
    config = load_config(path, runtime_checks=False)
    report = report_for(config, declared_machine(config))
    reason = refusal(config, report, "hidden_states")
    assert reason is not None and "mem_fraction_static is auto but the GPUs' memory is unknown" in reason
