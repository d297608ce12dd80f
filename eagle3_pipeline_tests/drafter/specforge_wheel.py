"""SpecForge's ``LlamaForCausalLMEagle3`` (``specforge==0.2.0``) loaded from its wheel, for the tests that compare
our export with it (a helper module, not a test).

The wheel is fetched with ``pip download --no-deps`` once per test module (a failure skips the test,
or fails it under ``CI``). Only ``specforge/modeling/draft/base.py`` and
``specforge/modeling/draft/llama3_eagle.py`` are loaded from it, with importlib; the SpecForge
modules they import that are not the model are stubbed:

- ``specforge.modeling.draft.registry.register_draft``: the draft-class registry decorator (identity);
- ``specforge.utils.print_with_rank``: logging (does nothing);
- ``specforge.distributed.get_sp_ring_group``/``get_sp_ulysses_group``: sequence-parallel groups of the
  USP attention backend; ``specforge.modeling.draft.flex_attention``: the flex-attention backend's
  helpers; ``specforge.modeling._mask_utils``: the masks of ``Eagle3DraftModel``'s generic
  ``prepare_decoder_attention_mask``, which this class does not use (llama3_eagle.py has its own):
  all raise if called.

SpecForge's forward runs on the CPU with its default ``sdpa`` backend once ``torch.compile`` is disabled (its
RMSNorm, rotary and RoPE helpers are compiled functions).
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline_tests.wheels import download_wheel

SPECFORGE_VERSION = "0.2.0"
PACKAGE = "specforge.modeling.draft"
MODEL_FILES = ("base", "llama3_eagle")  # specforge/modeling/draft/{name}.py, loaded in this order


def _stub(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so the relative imports of the loaded files resolve
    module.__dict__.update(attributes)
    return module


def _unused(what: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"SpecForge stub called: {what} is not part of the model under test")

    return call


@contextmanager
def llama3_eagle(folder: Path) -> Iterator[types.ModuleType]:
    """SpecForge's ``llama3_eagle`` module, loaded from the wheel (downloaded into ``folder``) with the stubs of
    the module docstring; the stubs and the module leave ``sys.modules`` on exit."""
    import torch

    wheel = download_wheel("specforge", SPECFORGE_VERSION, folder, timeout_s=300)
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
