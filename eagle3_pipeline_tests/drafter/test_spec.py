"""The ``train`` and ``evaluate`` specs are the sections they read: built from a pipeline file as the
Dagster layer builds them, sent as JSON, validated once by the sections' own models where the phase
runs, and refused by field with what was expected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.components.eagle3.drafter_eval import evaluate_spec
from eagle3_pipeline.config import DrafterConfig, load_config, local_profile_path
from eagle3_pipeline.drafter.evaluate import phase as evaluate
from eagle3_pipeline.drafter.spec import NOT_SETTINGS, TrainError, TrainSettings, parse_spec, train_spec
from eagle3_pipeline.fit.runtime import resolved
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.testing.train_settings import train_settings

PROFILES = Path(local_profile_path()).parent


@pytest.mark.parametrize("profile", ["local.yaml", "kimi-k25.yaml"])
def test_each_shipped_profiles_specs_carry_its_files_values(profile: str, tmp_path: Path) -> None:
    """Through JSON, as the heavy subprocess gets them: the train spec holds every drafter setting but
    where the target is and the process count, reads back as the file says, and writes itself again
    unchanged; the evaluate spec holds drafter_eval's settings and the held-out ids."""
    loaded = load_config(PROFILES / profile, runtime_checks=False).model_copy(update={"artifacts_root": tmp_path})
    config = resolved(loaded, "no fit: each auto setting takes its fallback")  # as the Dagster layer's
    sent = json.loads(json.dumps(train_spec(config)))
    assert set(sent["settings"]) == set(DrafterConfig.model_fields) - NOT_SETTINGS
    paths, settings = parse_spec(sent)
    assert paths["store"] == tmp_path / "hidden_states" and paths["target_weights"] == Path(sent["target_weights"])
    drafter = config.drafter
    assert (settings.epochs, settings.lr, settings.ttt_steps, settings.loss) == (
        drafter.epochs,
        drafter.lr,
        drafter.ttt_steps,
        drafter.loss,
    )
    assert settings.seed == (config.seed if drafter.seed is None else drafter.seed)
    assert settings.max_seq_len == (drafter.max_seq_len or config.target.max_seq_len)
    assert settings.as_spec() == sent["settings"]

    manifest = ArtifactLayout(tmp_path).training_data / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"held_out": {"chat": ["b", "a"]}, "version": "v7"}))
    spec = evaluate.parse_spec(json.loads(json.dumps(evaluate_spec(config))))
    assert spec.steps == sorted(set(config.drafter_eval.steps))
    assert (spec.device, spec.draft_cost_ratio, spec.min_data_agreement, spec.max_samples_per_dataset) == (
        config.drafter_eval.device,
        config.drafter_eval.draft_cost_ratio,
        config.drafter_eval.min_data_agreement,
        config.drafter_eval.max_samples_per_dataset,
    )
    assert (spec.embedding_key, spec.lm_head_key) == (drafter.embedding_key, drafter.lm_head_key)
    assert (spec.held_out, spec.held_out_version, spec.drafter) == ({"chat": ["b", "a"]}, "v7", paths["export_dir"])


def test_a_file_without_a_drafter_section_trains_with_the_files_defaults() -> None:
    """Seed and sequence length come from the pipeline where the section leaves them out."""
    settings = TrainSettings.from_config(DrafterConfig(), pipeline_seed=3, target_max_seq_len=512)
    assert (settings.epochs, settings.lr, settings.seed, settings.max_seq_len) == (
        DrafterConfig().epochs,
        DrafterConfig().lr,
        3,
        512,
    )
    own = TrainSettings.from_config(DrafterConfig(seed=5, max_seq_len=64), pipeline_seed=3, target_max_seq_len=512)
    assert (own.seed, own.max_seq_len) == (5, 64)


def _spec(**settings: Any) -> dict[str, Any]:
    paths = {k: f"/p/{k}" for k in ("store", "draft_vocab", "target_weights", "run_dir", "export_dir")}
    return {**paths, "settings": {**train_settings(), **settings}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"settings": None}, r"train spec: settings: Input should be a valid dictionary"),
        ({"run_dir": None}, r"train spec: run_dir: .*\(got None\)"),
        ({"settings": {"lr": -1}}, r"train spec: settings\.lr: Input should be greater than 0 \(got -1\)"),
        ({"settings": {"learning_rate": 1.0}}, r"train spec: settings\.learning_rate: unknown key"),
        ({"settings": {"ttt_steps": 17}}, r"settings\.ttt_steps: Input should be less than or equal to 16 \(got 17\)"),
        ({"settings": {"seed": None}}, r"settings\.seed: Input should be a valid integer \(got None\)"),
        ({"settings": {"activation_checkpointing": "auto"}}, r"settings\.activation_checkpointing: .*boolean"),
        ({"settings": {"loss": "ce"}}, r"settings\.loss: Input should be 'kl', 'lk_alpha', 'lk_lambda' or 'tv'"),
        ({"settings": {"nproc_per_node": 2}}, r"settings\.nproc_per_node: Input should be None \(got 2\)"),
        ({"settings": {"init_l2sp": 0.1}}, r"settings: Value error, init_l2sp: .* needs init_from"),
        ({"settings": {"model": {"hidden": 8}}}, r"settings\.model\.hidden: unknown key"),
        ({"settings": {"model": {"fc_norm": True, "norm_before_fc": True}}}, r"settings\.model: .*choose one"),
    ],
)
def test_a_bad_train_spec_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    spec = _spec()
    for key, value in change.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    with pytest.raises(TrainError, match=message):
        parse_spec(spec)


def test_a_train_spec_lacking_a_key_is_refused_by_name() -> None:
    spec = _spec()
    del spec["export_dir"], spec["settings"]["max_seq_len"]
    with pytest.raises(TrainError, match=r"export_dir: required field is missing; settings\.max_seq_len: required"):
        parse_spec(spec)
