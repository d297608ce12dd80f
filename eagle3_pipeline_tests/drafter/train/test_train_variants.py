"""The train phase with a drafter variant, an LK loss and ``select: best``: what is trained is what is
exported (switches in config.json, weights, the loss and the chosen checkpoint in its metadata), and the
exported checkpoint is the one with the best τ at the served depth. The target and store are the small
made-up ones of ``tiny_store`` (random states), so a run takes seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pydantic import ValidationError  # noqa: E402

from eagle3_pipeline.config import DrafterModelConfig  # noqa: E402
from eagle3_pipeline.drafter.export.specforge import load_export  # noqa: E402
from eagle3_pipeline.drafter.model.draft_config import DrafterConfigError  # noqa: E402
from eagle3_pipeline.drafter.spec import TrainError, TrainSettings  # noqa: E402
from eagle3_pipeline.drafter.train.loop import BEST_FILE, best_eval, save_best  # noqa: E402
from eagle3_pipeline.drafter.train.phase import run, select_checkpoint  # noqa: E402
from eagle3_pipeline.testing.drafter_reference import tiny_drafter, tiny_drafter_config  # noqa: E402
from eagle3_pipeline.testing.reporter import Recorder  # noqa: E402
from eagle3_pipeline.testing.train_settings import random_store_train_spec, train_settings  # noqa: E402

pytestmark = pytest.mark.slow


def test_an_eagle31_lk_run_exports_its_best_checkpoint_as_trained(tmp_path: Path) -> None:
    spec = random_store_train_spec(
        tmp_path, loss="lk_lambda", select="best", model={"fc_norm": True, "norm_output": True}
    )
    result = run(spec, Recorder())
    evals = result["evals"]
    assert len(evals) >= 3 and all({"tau@3", "accept_0"} <= set(e) for e in evals)
    best = max(reversed(evals), key=lambda e: e["tau@3"])
    raw = json.loads((tmp_path / "export" / "config.json").read_text())
    assert raw["fc_norm"] is True and raw["norm_output"] is True and "norm_before_fc" not in raw
    training = raw["eagle3_pipeline"]["training"]
    assert training == result["selected"] == {
        "loss": "lk_lambda", "lk_eta": 3.0, "select": "best", "select_steps": 3, "step": best["step"],
        "tau@3": round(best["tau@3"], 4),
    }  # fmt: skip
    exported = load_export(tmp_path / "export", tmp_path / "target")
    kept = torch.load(tmp_path / "run" / BEST_FILE, weights_only=True)
    assert int(kept["step"]) == best["step"]
    for name, tensor in kept["model"].items():
        ours = exported.state_dict()[name]
        torch.testing.assert_close(ours, tensor.to(ours.dtype), rtol=1e-2, atol=1e-2)  # the export is bf16
    assert exported.config.fc_norm and exported.config.norm_output and exported.fc_norm[2].weight.shape == (32,)


def test_a_plain_run_exports_the_last_checkpoint_and_says_so(tmp_path: Path) -> None:
    result = run(random_store_train_spec(tmp_path, epochs=1), Recorder())
    raw = json.loads((tmp_path / "export" / "config.json").read_text())
    assert not {"fc_norm", "norm_output", "norm_before_fc"} & set(raw)
    assert raw["eagle3_pipeline"]["training"]["step"] == result["steps"] == result["evals"][-1]["step"]
    assert raw["eagle3_pipeline"]["training"]["loss"] == "kl" and not (tmp_path / "run" / BEST_FILE).exists()


def test_select_best_loads_the_kept_weights_and_refuses_weights_of_another_step(tmp_path: Path) -> None:
    model = tiny_drafter(tiny_drafter_config())
    best = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    evals = [
        {"step": 4, "tau@3": 1.2},
        {"step": 8, "tau@3": 1.5},
        {"step": 12, "tau@3": 1.5},
        {"step": 16, "tau@3": 1.3},
    ]
    assert best_eval(evals, 3) == evals[2]  # a tie goes to the later checkpoint
    settings = TrainSettings(**train_settings(select="best"))
    save_best(tmp_path, 12, best)
    chosen = select_checkpoint(model, evals, settings, tmp_path)
    assert chosen["step"] == 12 and chosen["tau@3"] == 1.5 and "lk_eta" not in chosen
    assert torch.equal(model.fc.weight, torch.full_like(model.fc.weight, 0.5))
    save_best(tmp_path, 8, best)
    with pytest.raises(TrainError, match=rf"{BEST_FILE}: select: best needs the weights of step 12"):
        select_checkpoint(model, evals, settings, tmp_path)


def test_fc_norm_with_norm_before_fc_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="fc_norm and norm_before_fc"):
        DrafterModelConfig.model_validate({"fc_norm": True, "norm_before_fc": True})
    with pytest.raises(DrafterConfigError, match="fc_norm and norm_before_fc"):
        tiny_drafter_config(fc_norm=True, norm_before_fc=True)


def test_a_plain_drafters_spec_and_identity_are_those_before_the_variants() -> None:
    """Switches left off and the default loss stay out of the spec's model and the checkpoint identity,
    so a run checkpointed before they existed resumes; a variant or another loss is a new identity."""
    settings = TrainSettings(**train_settings())
    assert settings.model_overrides() == {}
    assert "loss" not in settings.identity() and "lk_eta" not in settings.identity()
    assert tiny_drafter_config().to_dict().keys().isdisjoint({"fc_norm", "norm_output", "norm_before_fc"})
    lk = TrainSettings(**train_settings(loss="lk_lambda", model={"norm_output": True}))
    assert lk.identity()["loss"] == "lk_lambda" and lk.identity()["lk_eta"] == 3.0
    assert lk.model_overrides() == {"norm_output": True}
