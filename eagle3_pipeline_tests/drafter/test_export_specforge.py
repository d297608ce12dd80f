"""Our export loads into SpecForge's own ``LlamaForCausalLMEagle3`` (``specforge==0.2.0``, whose
export names are ours), strictly, at toy size with matching logits and at Kimi-K2.5's
full size on the meta device.

The wheel is fetched with ``pip download --no-deps`` once per test session (a failure fails the test
when ``CI`` is set, else skips it). Only ``specforge/modeling/draft/base.py`` and
``specforge/modeling/draft/llama3_eagle.py`` are loaded from it, with importlib; the SpecForge
modules they import that are not the model are stubbed:

- ``specforge.modeling.draft.registry.register_draft``: the draft-class registry decorator (identity);
- ``specforge.utils.print_with_rank``: logging (does nothing);
- ``specforge.distributed.get_sp_ring_group``/``get_sp_ulysses_group``: sequence-parallel groups of the
  USP attention backend; ``specforge.modeling.draft.flex_attention``: the flex-attention backend's
  helpers; ``specforge.modeling._mask_utils``: the masks of ``Eagle3DraftModel``'s generic
  ``prepare_decoder_attention_mask``, which this class does not use (llama3_eagle.py has its own):
  all raise if called.

SpecForge's forward runs on the CPU with its default ``sdpa`` backend once ``torch.compile`` is
disabled (its RMSNorm, rotary and RoPE helpers are compiled functions).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

F = torch.nn.functional

from eagle3_pipeline.drafter.draft_config import drafter_config
from eagle3_pipeline.drafter.export import export_for_servers, exported_tensors, server_config
from eagle3_pipeline.drafter.model import Eagle3Drafter
from eagle3_pipeline.testing.drafter_reference import KIMI_AUX, kimi_k25_text_config, tiny_kimi_text_config

SPECFORGE = "specforge==0.2.0"
PACKAGE = "specforge.modeling.draft"
MODEL_FILES = ("base", "llama3_eagle")  # specforge/modeling/draft/{name}.py, loaded in this order
STEPS = 4


def _fetch_wheel(folder: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(folder),
        SPECFORGE,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        problem = None if done.returncode == 0 else (done.stderr or done.stdout).strip()[-800:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = str(exc)
    wheels = sorted(folder.glob("specforge-*.whl"))
    if problem or not wheels:
        message = f"could not download {SPECFORGE} with `{' '.join(command)}`: {problem or 'no wheel written'}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return wheels[0]


def _stub(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so the relative imports of the loaded files resolve
    module.__dict__.update(attributes)
    return module


def _unused(what: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"SpecForge stub called: {what} is not part of the model under test")

    return call


@pytest.fixture(scope="module")
def specforge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[types.ModuleType]:
    """SpecForge's ``llama3_eagle`` module, loaded from the wheel with the stubs of the docstring."""
    folder = tmp_path_factory.mktemp("specforge-wheel")
    wheel = _fetch_wheel(folder)
    stubs = {
        "specforge": _stub("specforge"),
        "specforge.modeling": _stub("specforge.modeling"),
        PACKAGE: _stub(PACKAGE),
        "specforge.modeling._mask_utils": _stub("specforge.modeling._mask_utils", _expand_mask=_unused("_expand_mask"),
                                                _make_causal_mask=_unused("_make_causal_mask")),
        f"{PACKAGE}.flex_attention": _stub(
            f"{PACKAGE}.flex_attention",
            compile_friendly_create_block_mask=_unused("flex attention"),
            compile_friendly_flex_attention=_unused("flex attention"),
            generate_eagle3_mask=_unused("flex attention"),
        ),
        f"{PACKAGE}.registry": _stub(f"{PACKAGE}.registry", register_draft=lambda cls: cls),
        "specforge.utils": _stub("specforge.utils", print_with_rank=lambda message: None),
        "specforge.distributed": _stub("specforge.distributed", get_sp_ring_group=_unused("sequence parallelism"),
                                       get_sp_ulysses_group=_unused("sequence parallelism")),
    }  # fmt: skip
    # torch's own config patch: a monkeypatch of torch._dynamo.config.disable, once undone, deletes the
    # setting from torch's config module, and the next module to load SpecForge's code in this process fails.
    with (
        pytest.MonkeyPatch.context() as patch,
        zipfile.ZipFile(wheel) as archive,
        torch._dynamo.config.patch(disable=True),
    ):
        for name, module in stubs.items():
            patch.setitem(sys.modules, name, module)
        for stem in MODEL_FILES:
            source = Path(archive.extract(f"specforge/modeling/draft/{stem}.py", folder / "files"))
            spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{stem}", source)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            patch.setitem(sys.modules, spec.name, module)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "flash_attn is not found, falling back to flex_attention"
                spec.loader.exec_module(module)
        yield sys.modules[f"{PACKAGE}.llama3_eagle"]


def _llama_config(export: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig.from_dict(export)


def test_a_tiny_kimi_like_export_loads_strictly_into_specforge_with_the_same_logits(
    specforge: types.ModuleType, tmp_path: Path
) -> None:
    target = tiny_kimi_text_config()
    config = drafter_config(target, 32, [1, 3, 4], {"head_dim": 16})  # 16 heads over 8 KV heads: GQA
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    used = torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab(used - torch.arange(config.draft_vocab_size), t2d)
    model.eval()
    folder = export_for_servers(model, tmp_path / "export", target, dtype="float32")

    from safetensors.torch import load_file

    exported = json.loads((folder / "config.json").read_text())
    assert exported["rope_scaling"]["rope_type"] == "yarn" and exported["vocab_size"] == target["vocab_size"]
    weights = load_file(str(folder / "model.safetensors"))
    assert "embed_tokens.weight" not in weights  # SpecForge loads the target's (Eagle3DraftModel.load_embedding)
    theirs = specforge.LlamaForCausalLMEagle3(_llama_config(exported)).eval()
    theirs.load_state_dict({**weights, "embed_tokens.weight": model.embed_tokens.weight.detach().clone()}, strict=True)
    assert torch.equal(theirs.midlayer.self_attn.rotary_emb.inv_freq, model.inv_freq)

    g = torch.Generator().manual_seed(1)
    b, t = 2, 12
    aux = torch.randn(b, t, 3 * config.target_hidden_size, generator=g)
    ids = torch.randint(0, config.vocab_size, (b, t), generator=g)
    with torch.no_grad():
        ours = model.ttt_forward(aux, ids, STEPS)
        # SpecForge's training-time test (OnlineEagle3Model): fc once, then per step the teacher-forced
        # token one further, the draft's own pre-norm hidden state, keys/values cached across steps.
        hidden = theirs.project_hidden_states(aux)
        mask = specforge.prepare_decoder_attention_mask(torch.ones(b, t, dtype=torch.bool), (b, t), hidden, 0)
        positions = torch.arange(t)[None]
        cache: list[list[torch.Tensor]] = [[], []]
        for j in range(STEPS):
            embeds = theirs.embed_input_ids(F.pad(ids[:, j + 1 :], (0, j + 1)))
            hidden = theirs.backbone(embeds, hidden, cache, mask, positions)
            torch.testing.assert_close(theirs.compute_logits(hidden), ours[j], rtol=1e-4, atol=1e-4)


def test_the_full_size_kimi_export_has_specforges_names_and_shapes(specforge: types.ModuleType) -> None:
    """Kimi-K2.5's drafter at full size (hidden 7168, vocab 163840, draft vocab 32000, YaRN ×64): the
    tensors our export writes are SpecForge's state dict less the embedding, which the servers and
    SpecForge take from the target; both models built on the meta device."""
    target = kimi_k25_text_config()
    config = drafter_config(target, 32000, KIMI_AUX, {})
    exported = server_config(config, target, "bfloat16")
    with torch.device("meta"):
        ours = exported_tensors(Eagle3Drafter(config))
        theirs = specforge.LlamaForCausalLMEagle3(_llama_config(exported)).state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {
        k: tuple(v.shape) for k, v in theirs.items() if k != "embed_tokens.weight"
    }
    assert tuple(theirs["embed_tokens.weight"].shape) == (target["vocab_size"], target["hidden_size"])
    assert tuple(ours["midlayer.self_attn.k_proj.weight"].shape) == (8 * 128, 2 * 7168) and tuple(
        ours["lm_head.weight"].shape
    ) == (32000, 7168)
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == KIMI_AUX and exported[
        "eagle_aux_hidden_state_layer_ids"
    ] == [2, 30, 58]
