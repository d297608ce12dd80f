"""The aux layer ids a drafter config carries, per target family, so that SGLang and vLLM capture the
layers trained on (output-of-layer ids k: the residual stream entering layer k + 1).

The servers' readers, as read in their sources (sglang 0.5.14/0.5.23 ``set_eagle3_layers_to_capture``
in ``models/llama.py`` and ``models/deepseek_v2.py``; vLLM 0.34 ``get_eagle3_aux_layers_from_config``),
are restated here so each pinned value is also checked for what it makes the server capture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.layer_ids import DEEPSEEK, LLAMA, LayerIdError, output_layer_ids, server_layer_ids, target_family


def sglang_captures(family: str, written: list[int]) -> list[int]:
    """Layer indices whose input SGLang captures for ``eagle_config.eagle_aux_hidden_state_layer_ids``."""
    if family == DEEPSEEK and written[0] != 1:
        return list(written)
    return [i + 1 for i in written]


def vllm_captures(written: list[int]) -> list[int]:
    """Layer indices whose input vLLM captures for the top-level ``eagle_aux_hidden_state_layer_ids``."""
    return list(written)


@pytest.mark.parametrize(
    ("family", "trained", "sglang", "vllm"),
    [
        (LLAMA, [1, 15, 28], [1, 15, 28], [2, 16, 29]),
        (LLAMA, [0, 15, 28], [0, 15, 28], [1, 16, 29]),
        (DEEPSEEK, [1, 29, 57], [1, 29, 57], [2, 30, 58]),  # Kimi-K2.5's default (61 layers)
        (DEEPSEEK, [3, 29, 57], [4, 30, 58], [4, 30, 58]),  # first id not 1: SGLang takes them as written
        (DEEPSEEK, [2, 30, 58], [3, 31, 59], [3, 31, 59]),
    ],
)
def test_the_written_ids_make_both_servers_capture_the_trained_layers(
    family: str, trained: list[int], sglang: list[int], vllm: list[int]
) -> None:
    ids = server_layer_ids(family, trained)
    assert (ids.sglang, ids.vllm) == (sglang, vllm)
    entering = [k + 1 for k in trained]
    assert sglang_captures(family, ids.sglang) == entering and vllm_captures(ids.vllm) == entering
    assert output_layer_ids(ids.vllm) == trained


def test_the_output_of_layer_0_cannot_be_served_from_a_deepseek_family_target() -> None:
    with pytest.raises(
        LayerIdError, match=r"\[0, 29, 57\]: SGLang's DeepSeek/Kimi target .* cannot capture the output of layer 0"
    ):
        server_layer_ids(DEEPSEEK, [0, 29, 57])
    for written in ([0, 29, 57], [1, 30, 58]):  # neither value captures the inputs of layers 1, 30, 58
        assert sglang_captures(DEEPSEEK, written) != [1, 30, 58]
    with pytest.raises(LayerIdError, match="expected output-of-layer ids >= 0"):
        server_layer_ids(LLAMA, [-1, 3, 4])
    with pytest.raises(LayerIdError, match="target family 'qwen'"):
        server_layer_ids("qwen", [1, 2, 3])
    with pytest.raises(LayerIdError, match="expected input-of-layer ids >= 1"):
        output_layer_ids([0, 3, 4])


def test_the_family_comes_from_the_language_models_or_the_checkpoints_model_type() -> None:
    assert target_family({"model_type": "deepseek_v3"}) == DEEPSEEK  # Kimi-K2.5's text_config, as the loader gives it
    assert target_family({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}}) == DEEPSEEK
    assert target_family({"model_type": "kimi_k2"}) == target_family({"model_type": "deepseek_v2"}) == DEEPSEEK
    assert (
        target_family({"model_type": "llama"}) == target_family({"model_type": "qwen3"}) == target_family({}) == LLAMA
    )


def test_a_kimi_export_writes_the_deepseek_rule_and_reads_back_the_trained_ids(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from eagle3_pipeline.drafter.draft_config import drafter_config
    from eagle3_pipeline.drafter.export import export_for_servers, load_export
    from eagle3_pipeline.drafter.model import Eagle3Drafter
    from eagle3_pipeline_tests.drafter.test_yarn import tiny_kimi_text_config

    target = tiny_kimi_text_config()
    for trained, sglang in (([1, 3, 4], [1, 3, 4]), ([2, 3, 4], [3, 4, 5])):
        model = Eagle3Drafter(drafter_config(target, 32, trained, {}))
        folder = export_for_servers(model, tmp_path / f"export-{trained[0]}", target, dtype="float32")
        raw = json.loads((folder / "config.json").read_text())
        assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == sglang
        assert raw["eagle_aux_hidden_state_layer_ids"] == [k + 1 for k in trained]
        target_dir = tmp_path / f"target-{trained[0]}"
        target_dir.mkdir()
        save_file(
            {"model.embed_tokens.weight": model.embed_tokens.weight.detach().clone()},
            str(target_dir / "model.safetensors"),
        )
        (target_dir / "config.json").write_text(json.dumps(target))
        reloaded = load_export(folder, target_dir)
        assert reloaded.config.aux_layer_ids == trained and torch.equal(reloaded.fc.weight, model.fc.weight)
    with pytest.raises(LayerIdError, match="cannot capture the output of layer 0"):
        export_for_servers(
            Eagle3Drafter(drafter_config(target, 32, [0, 3, 4], {})), tmp_path / "export-0", target, dtype="float32"
        )
