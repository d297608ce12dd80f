"""Warm start (``drafter.init_from``): the start read from our export, a SpecForge-named folder and a
speculators one (real files written here), each refusal naming the file and field, the lm_head rows
matched by token, the L2-SP term, and in a training run: the start's τ measured before the first step
and recorded in the export, resume, and a changed start refused as other settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

from eagle3_pipeline.drafter.export.specforge import export_for_servers, load_export
from eagle3_pipeline.drafter.export.speculators import to_speculators
from eagle3_pipeline.drafter.model.draft_config import DrafterConfig
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.drafter.spec import TrainError, TrainSettings
from eagle3_pipeline.drafter.train.phase import run
from eagle3_pipeline.drafter.train.warm_start import WarmStartError, l2sp_penalty, read_start
from eagle3_pipeline.testing.drafter_reference import tiny_drafter, tiny_drafter_config
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.train_settings import random_store_train_spec, train_settings

TARGET = {"architectures": ["LlamaForCausalLM"], "vocab_size": 80, "hidden_size": 48, "intermediate_size": 96,
          "max_position_embeddings": 128, "num_attention_heads": 6, "num_hidden_layers": 8}  # fmt: skip


def _run_model(config: DrafterConfig, embedding: torch.Tensor, used: torch.Tensor) -> Eagle3Drafter:
    """A freshly built run drafter: seeded init, the target's embedding frozen, draft vocabulary ``used``."""
    torch.manual_seed(5)
    model = Eagle3Drafter(config)
    model.set_target_embedding(embedding)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab(used - torch.arange(config.draft_vocab_size), t2d)
    return model


def _export(tmp_path: Path, **overrides: Any) -> tuple[Eagle3Drafter, Path]:
    start = tiny_drafter(tiny_drafter_config(**overrides))
    return start, export_for_servers(start, tmp_path / "start", TARGET, dtype="float32")


def _same_vocab(start: Eagle3Drafter) -> torch.Tensor:
    return start.t2d.nonzero().flatten()


def test_our_export_round_trips_into_the_run_model(tmp_path: Path) -> None:
    start, folder = _export(tmp_path)
    model = _run_model(start.config, start.embed_tokens.weight.detach(), _same_vocab(start))
    warm = read_start(folder, model)
    warm.apply(model)
    assert warm.format == "pipeline/specforge" and warm.lm_head_rows == 24
    mine, theirs = model.state_dict(), start.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert l2sp_penalty(model, warm.anchor(model)).item() == 0.0
    with torch.no_grad():
        model.fc.weight.add_(0.1)
    assert l2sp_penalty(model, warm.anchor(model)).item() == pytest.approx(0.01 * model.fc.weight.numel(), rel=1e-4)
    assert "embed_tokens.weight" not in warm.anchor(model)  # frozen: the target's, not pulled


def test_a_specforge_named_bin_with_another_vocabulary_gives_its_rows_by_token(tmp_path: Path) -> None:
    """SpecForge's names (``midlayer.*``, its own ``embed_tokens``) in a ``pytorch_model.bin``; the run's
    draft vocabulary shares 12 of its 24 tokens: those rows come from the start, the others stay fresh."""
    start = tiny_drafter(tiny_drafter_config())
    folder = tmp_path / "specforge"
    folder.mkdir()
    ours = export_for_servers(start, tmp_path / "ours", TARGET, dtype="float32")
    raw = json.loads((ours / "config.json").read_text())
    raw.pop("eagle3_pipeline")
    (folder / "config.json").write_text(json.dumps(raw))
    torch.save(start.state_dict(), folder / "pytorch_model.bin")
    assert any(k.startswith("midlayer.") for k in start.state_dict())
    theirs = _same_vocab(start)
    others = torch.tensor(sorted(set(range(80)) - set(theirs.tolist())))[:12]
    run_vocab = torch.sort(torch.cat([theirs[:12], others])).values
    model = _run_model(start.config, torch.randn(80, 48), run_vocab)
    fresh = model.lm_head.weight.detach().clone()
    warm = read_start(folder, model)
    warm.apply(model)
    assert warm.lm_head_rows == 12
    for row, token in enumerate(run_vocab.tolist()):
        expected = start.lm_head.weight[theirs.tolist().index(token)] if token in theirs else fresh[row]
        assert torch.equal(model.lm_head.weight[row], expected)
    name = "midlayer.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[name], start.state_dict()[name])
    assert not torch.equal(model.embed_tokens.weight, start.embed_tokens.weight)  # the run's (target's) embedding


@pytest.mark.parametrize("prefix", ["layers.0.", "transformer."])
def test_a_speculators_folder_is_read_with_its_layer_names(tmp_path: Path, prefix: str) -> None:
    from safetensors.torch import load_file, save_file

    start = tiny_drafter(tiny_drafter_config(aux_layer_ids=[1, 3, 4]))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET))
    embedding = start.embed_tokens.weight.detach().clone()
    save_file({"model.embed_tokens.weight": embedding}, str(target / "model.safetensors"))
    ours = export_for_servers(start, tmp_path / "ours", TARGET, dtype="float32")
    folder = to_speculators(ours, tmp_path / "speculators", target)
    if prefix != "layers.0.":  # speculators' first releases named the decoder layer transformer.*
        tensors = load_file(str(folder / "model.safetensors"))
        renamed = {(prefix + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
        save_file(renamed, str(folder / "model.safetensors"))
    model = _run_model(start.config, start.embed_tokens.weight.detach(), _same_vocab(start))
    warm = read_start(folder, model)
    warm.apply(model)
    assert warm.format == "speculators"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in start.state_dict().items())


def test_a_full_vocabulary_start_fits_a_pruned_run(tmp_path: Path) -> None:
    start, folder = _export(tmp_path, draft_vocab_size=80)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, str(folder / "model.safetensors"))
    run_vocab = torch.arange(3, 75, 3)  # 24 tokens
    model = _run_model(tiny_drafter_config(), torch.randn(80, 48), run_vocab)
    warm = read_start(folder, model)
    warm.apply(model)
    assert warm.lm_head_rows == 24 and torch.equal(model.lm_head.weight, start.lm_head.weight[run_vocab])


def _edit_config(folder: Path, **changes: Any) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": 64, "target_hidden_size": 64}, "target_hidden_size is 64"),
        ({"vocab_size": 90}, "vocab_size is 90"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 5, 6]}, "aux_layer_ids is [1, 4, 5]"),
        ({"head_dim": 4}, "head_dim is 4, this run's is 8 (drafter.model.head_dim)"),
        ({"num_key_value_heads": 3}, "num_key_value_heads is 3"),
        ({"intermediate_size": 64}, "intermediate_size is 64"),
        ({"draft_vocab_size": 30}, "draft_vocab_size is 30, this run's is 24 (draft_vocab.size)"),
        ({"fc_norm": True}, "fc_norm is True, this run's is False (drafter.model.fc_norm)"),
        ({"norm_output": True}, "norm_output is True"),
        ({"eagle_config": {"norm_before_fc": True}}, "norm_before_fc is True"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures is"),
        ({"rope_theta": 500000.0}, "rope_theta is 500000.0, this run's is 10000.0 (the target's RoPE"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type is linear, this run's is"),
        ({"rms_norm_eps": None, "max_position_embeddings": None}, None),
    ],
)
def test_a_start_that_is_not_the_runs_drafter_is_refused_by_file_and_field(
    tmp_path: Path, changes: dict[str, Any], field: str | None
) -> None:
    start, folder = _export(tmp_path)
    if field is None:  # a missing key is named
        raw = json.loads((folder / "config.json").read_text())
        del raw["max_position_embeddings"]
        (folder / "config.json").write_text(json.dumps(raw))
        field = "missing 'max_position_embeddings'"
    else:
        _edit_config(folder, **changes)
    model = _run_model(tiny_drafter_config(), torch.randn(80, 48), _same_vocab(start))
    with pytest.raises(WarmStartError) as refused:
        read_start(folder, model)
    assert str(folder / "config.json") in str(refused.value) and field in str(refused.value)


def test_missing_files_and_foreign_tensors_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    start, folder = _export(tmp_path)
    model = _run_model(tiny_drafter_config(), torch.randn(80, 48), _same_vocab(start))
    with pytest.raises(WarmStartError, match=r"no config\.json"):
        read_start(tmp_path / "nowhere", model)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "fc.bias": torch.zeros(48)}, str(folder / "model.safetensors"))
    foreign = r"model\.safetensors: the weights are not this drafter's: unknown \['fc.bias'\]"
    with pytest.raises(WarmStartError, match=foreign):
        read_start(folder, model)
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(folder / "model.safetensors"))
    with pytest.raises(WarmStartError, match="no d2t"):
        read_start(folder, model)
    (folder / "model.safetensors").unlink()
    with pytest.raises(WarmStartError, match=r"no model\.safetensors or pytorch_model\.bin"):
        read_start(folder, model)


def test_the_start_path_is_no_setting_but_l2sp_is_and_l2sp_needs_a_start() -> None:
    plain = TrainSettings(**train_settings())
    warm = TrainSettings(**train_settings(init_from="/a/start"))
    assert plain.identity() == warm.identity()  # the run's identity holds the start's digest instead
    pulled = TrainSettings(**train_settings(init_from="/a/start", init_l2sp=0.1))
    assert pulled.identity()["init_l2sp"] == 0.1
    with pytest.raises(ValueError, match="init_l2sp: .* needs init_from"):
        train_settings(init_l2sp=0.1)


@pytest.mark.slow
def test_a_warm_run_measures_its_start_resumes_and_refuses_a_changed_start(tmp_path: Path) -> None:
    first = random_store_train_spec(tmp_path / "a", epochs=1)
    trained = run(first, Recorder())
    export = Path(first["export_dir"])
    start_tau = trained["evals"][-1]["tau@3"]

    spec = random_store_train_spec(tmp_path / "a", epochs=1, init_from=str(export), init_l2sp=0.5)
    spec = {**spec, "run_dir": str(tmp_path / "warm" / "run"), "export_dir": str(tmp_path / "warm" / "export")}
    report = Recorder()
    result = run(spec, report)
    start = result["start"]
    # The start is the first run's export (bfloat16): its τ on the same eval split is that run's last one.
    assert start["tau@3"] == pytest.approx(start_tau, abs=0.05) and start["lm_head_rows"] == 40
    assert "accept_0" in start and start["from"] == str(export)
    assert any(m.startswith(f"warm start from {export}") for m in report.lines)
    training = json.loads((tmp_path / "warm" / "export" / "config.json").read_text())["eagle3_pipeline"]["training"]
    assert training["init_from"] == start and training["tau@3"] == round(result["evals"][-1]["tau@3"], 4)
    assert load_export(tmp_path / "warm" / "export", Path(spec["target_weights"])) is not None

    again = run(spec, Recorder())
    assert again["resumed_from_step"] == result["steps"] and again["start"] == start

    moved = tmp_path / "moved"
    shutil.copytree(export, moved)
    assert run({**spec, "settings": {**spec["settings"], "init_from": str(moved)}}, Recorder())["resumed_from_step"]
    _edit_config(moved, rms_norm_eps=1e-6)
    with pytest.raises(TrainError, match="made under other init_from_sha256"):
        run({**spec, "settings": {**spec["settings"], "init_from": str(moved)}}, Recorder())
