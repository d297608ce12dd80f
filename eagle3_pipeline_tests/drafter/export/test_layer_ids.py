"""The aux layer ids a drafter config carries, per target family, so that SGLang and vLLM capture the
layers trained on (output-of-layer ids k: the residual stream entering layer k + 1).

The servers' readers, as read in their sources (SGLang ``set_eagle3_layers_to_capture`` in
``models/llama.py`` and ``models/deepseek_v2.py``, 0.5.10 to 0.5.23; vLLM 0.34
``get_eagle3_aux_layers_from_config``), are restated here so each pinned value is also checked for what
it makes each server release capture. ``test_sglang_layer_rules.py`` checks the restated SGLang rules
against the wheels' source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.target.layer_ids import (
    DEEPSEEK,
    LLAMA,
    SGLANG_RELEASES,
    LayerIdError,
    output_layer_ids,
    server_layer_ids,
    target_family,
)

# SGLang's DeepSeek rule changed in 0.5.13 (deepseek_v2.py); the Llama rule did not.
SGLANG_RANGES = ("0.5.10-0.5.12", "0.5.13-0.5.23")


def sglang_captures(family: str, written: list[int], releases: str = SGLANG_RANGES[-1]) -> list[int]:
    """Layer indices whose input SGLang ``releases`` capture for ``eagle_config.eagle_aux_hidden_state_layer_ids``."""
    if family == DEEPSEEK and releases != SGLANG_RANGES[0] and written[0] != 1:
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
        (LLAMA, [3, 15, 28], [3, 15, 28], [4, 16, 29]),
        (DEEPSEEK, [1, 29, 57], [1, 29, 57], [2, 30, 58]),  # Kimi-K2.5's default (61 layers)
    ],
)
def test_the_written_ids_make_every_server_release_capture_the_trained_layers(
    family: str, trained: list[int], sglang: list[int], vllm: list[int]
) -> None:
    ids = server_layer_ids(family, trained)
    assert (ids.sglang, ids.vllm) == (sglang, vllm)
    entering = [k + 1 for k in trained]
    for releases in SGLANG_RANGES:
        assert sglang_captures(family, ids.sglang, releases) == entering, releases
    assert vllm_captures(ids.vllm) == entering
    assert output_layer_ids(ids.vllm) == trained


def test_the_deepseek_rule_per_sglang_range_for_first_id_1_and_3() -> None:
    """docs/eagle3.md's table: a first id of 1 reads alike on both ranges; for 3 no value does."""
    rows = {
        ("1", tuple(SGLANG_RANGES)): [sglang_captures(DEEPSEEK, [1, 29, 57], r) for r in SGLANG_RANGES],
        ("3 as written", tuple(SGLANG_RANGES)): [sglang_captures(DEEPSEEK, [3, 29, 57], r) for r in SGLANG_RANGES],
        ("3 + 1", tuple(SGLANG_RANGES)): [sglang_captures(DEEPSEEK, [4, 30, 58], r) for r in SGLANG_RANGES],
    }
    print("\n-- SGLang DeepSeek family, captured layer inputs per range", SGLANG_RANGES)
    for (first, _), captured in rows.items():
        print(f"   first id {first}: {captured}")
    assert rows[("1", tuple(SGLANG_RANGES))] == [[2, 30, 58], [2, 30, 58]]  # trained: outputs of 1, 29, 57
    assert rows[("3 as written", tuple(SGLANG_RANGES))] == [[4, 30, 58], [3, 29, 57]]  # right, then one short
    assert rows[("3 + 1", tuple(SGLANG_RANGES))] == [[5, 31, 59], [4, 30, 58]]  # one deep, then right
    for trained in ([3, 29, 57], [2, 30, 58], [0, 29, 57]):
        with pytest.raises(LayerIdError, match=r"DeepSeek-family target .* 0\.5\.10-0\.5\.12 .* 0\.5\.13\+"):
            server_layer_ids(DEEPSEEK, trained)
    assert SGLANG_RELEASES == ">=0.5.10,<=0.5.23"


def test_bad_ids_and_families_are_refused() -> None:
    with pytest.raises(LayerIdError, match="expected output-of-layer ids >= 0"):
        server_layer_ids(LLAMA, [-1, 3, 4])
    with pytest.raises(LayerIdError, match="target family 'qwen'"):
        server_layer_ids("qwen", [1, 2, 3])
    with pytest.raises(LayerIdError, match="expected input-of-layer ids >= 1"):
        output_layer_ids([0, 3, 4])


def test_the_family_comes_from_the_architectures_or_the_model_type() -> None:
    assert target_family({"model_type": "deepseek_v3"}) == DEEPSEEK  # Kimi-K2.5's text_config, as the loader gives it
    assert target_family({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}}) == DEEPSEEK
    assert target_family({"model_type": "kimi_k2"}) == target_family({"model_type": "deepseek_v2"}) == DEEPSEEK
    for model_type in ("glm_moe_dsa", "glm4_moe_lite", "deepseek_v32"):
        assert target_family({"model_type": model_type}) == DEEPSEEK
    for architecture in ("GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM", "KimiK25ForConditionalGeneration"):
        assert target_family({"model_type": "custom", "architectures": [architecture]}) == DEEPSEEK
    assert (
        target_family({"model_type": "llama"}) == target_family({"model_type": "qwen3"}) == target_family({}) == LLAMA
    )
    # GLM-5-Next and LongCat-Flash are DSA/MoE models whose SGLang classes add 1 to every id.
    assert target_family({"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"]}) == LLAMA
    assert target_family({"architectures": ["LongcatFlashForCausalLM"]}) == LLAMA


def test_a_kimi_export_writes_the_deepseek_rule_and_reads_back_the_trained_ids(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from eagle3_pipeline.drafter.export.specforge import export_for_servers, load_export
    from eagle3_pipeline.drafter.model.draft_config import drafter_config
    from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
    from eagle3_pipeline.testing.drafter_reference import tiny_kimi_text_config

    target = tiny_kimi_text_config()
    model = Eagle3Drafter(drafter_config(target, 32, [1, 3, 4], {}))
    folder = export_for_servers(model, tmp_path / "export", target, dtype="float32")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert raw["eagle3_pipeline"] == {"target_family": DEEPSEEK, "sglang_versions": SGLANG_RELEASES}
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    save_file(
        {"model.embed_tokens.weight": model.embed_tokens.weight.detach().clone()}, str(target_dir / "model.safetensors")
    )
    (target_dir / "config.json").write_text(json.dumps(target))
    reloaded = load_export(folder, target_dir)
    assert reloaded.config.aux_layer_ids == [1, 3, 4] and torch.equal(reloaded.fc.weight, model.fc.weight)
    for first in (0, 2):
        with pytest.raises(LayerIdError, match=rf"aux layer ids \[{first}, 3, 4\]: a DeepSeek-family target"):
            export_for_servers(
                Eagle3Drafter(drafter_config(target, 32, [first, 3, 4], {})),
                tmp_path / f"export-{first}",
                target,
                dtype="float32",
            )
