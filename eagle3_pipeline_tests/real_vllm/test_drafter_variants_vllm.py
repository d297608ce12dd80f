"""Each drafter variant's export strict-loads in vLLM 0.32's own EAGLE-3 class (``Eagle3LlamaForCausalLM``,
built on the CPU from the export's config.json with the embedded model as the target, no engine started):
every parameter but the embedding (the target's, shared when serving) comes from the export, vLLM reads
the variant switches the trainer used, and its step-0 input (``combine_hidden_states``: ``input_norm``,
``fc_norm``, ``fc``) equals the trainer's :meth:`Eagle3Drafter.combine` on the same aux states.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.drafter.draft_config import drafter_config  # noqa: E402
from eagle3_pipeline.drafter.export import export_for_servers, load_export  # noqa: E402
from eagle3_pipeline.drafter.model import Eagle3Drafter  # noqa: E402
from eagle3_pipeline.testing import vllm_eagle3_load  # noqa: E402

VARIANTS = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "norm_before_fc": {"norm_before_fc": True, "norm_output": True},
}
DRAFT_VOCAB = 64


def _export(local_model: Path, folder: Path, switches: dict[str, bool]) -> Path:
    target = json.loads((local_model / "config.json").read_text())
    config = drafter_config(target, DRAFT_VOCAB, [1, 14, 26], switches)
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    with torch.no_grad():
        for param in model.parameters():  # norms off 1 too, so a norm vLLM skipped would show
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.2)
    model.set_vocab(torch.arange(DRAFT_VOCAB) * 3, torch.arange(config.vocab_size) % 3 == 0)
    return export_for_servers(model, folder, target, dtype="float32")


def test_each_variants_export_strict_loads_in_vllms_class_and_combines_as_trained(
    real_vllm_python: Path, local_model: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    exports = [_export(local_model, tmp_path / name, switches) for name, switches in VARIANTS.items()]
    aux = torch.randn(5, 3 * 576, generator=torch.Generator().manual_seed(1)) * 4
    save_file({"aux": aux}, str(tmp_path / "aux.safetensors"))
    done = subprocess.run(
        [str(real_vllm_python), vllm_eagle3_load.__file__, str(local_model), str(tmp_path), *map(str, exports)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "result.json").read_text())
    for i, ((name, switches), result) in enumerate(zip(VARIANTS.items(), results, strict=True)):
        assert result["not_loaded"] == ["model.embed_tokens.weight"], name
        for key in ("fc_norm", "norm_output", "norm_before_fc"):
            assert result[key] == switches.get(key, False), (name, key)
        assert ("model.fc_norm.2.weight" in result["parameters"]) == switches.get("fc_norm", False)
        assert ("model.input_norm.weight" in result["parameters"]) == switches.get("norm_before_fc", False)
        ours = load_export(exports[i], local_model)
        served = load_file(str(tmp_path / f"combined-{i}.safetensors"))["combined"]
        with torch.no_grad():
            torch.testing.assert_close(served, ours.combine(aux), rtol=1e-4, atol=1e-4)
