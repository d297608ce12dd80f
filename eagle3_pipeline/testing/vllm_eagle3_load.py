# pyright: reportMissingImports=false
# (vllm lives in the vLLM venv, which runs this file; the project's venv has none.)
"""Build vLLM's own EAGLE-3 draft class from exported drafter folders and load their weights, in the vLLM
venv, without an engine: the strict-load check of an export. The class is the one vLLM's registry maps the
export's architecture to: ``Eagle3LlamaForCausalLM`` (``LlamaForCausalLMEagle3``) or, for the MLA head,
``Eagle3DeepseekV2ForCausalLM`` (``deepseek_eagle3.py``).

Run by that venv's python (it imports nothing of this package)::

    python vllm_eagle3_load.py TARGET_DIR OUT_DIR EXPORT_DIR[::TARGET_DIR]...

(an export's own ``::TARGET_DIR`` replaces the first: the MLA head's target is a DeepSeek-V3 model).
For each export i: vLLM's config from the target and the export as its ``eagle3`` speculative model, the
draft model class built on the CPU (one gloo rank), every parameter filled with NaN, then its own
``load_weights`` over the export's ``model.safetensors`` (vLLM raises on a name it does not know), then
the CPU's weight post-processing, as vLLM's loader does.
Writes ``OUT_DIR/result.json``: per export the class, the parameters still NaN (not loaded), every parameter
name and shape, and the flags the class read (``norm_before_fc``, ``fc_norm``, ``norm_output``); for the MLA
head also the attention's softmax scale and its RoPE cos/sin cache rows 0..``ROPE_ROWS``-1 (what the
trainer's :mod:`eagle3_pipeline.drafter.model.mla` must equal); and
``OUT_DIR/combined-{i}.safetensors``: ``combine_hidden_states`` of the aux states in
``OUT_DIR/aux.safetensors`` (key ``aux-{i}``, else ``aux``), so a test compares vLLM's step-0 input with the trainer's.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

ROPE_ROWS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(target: str, out: Path, exports: list[str]) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    auxes = load_file(str(out / "aux.safetensors"))
    results = []
    for i, spec in enumerate(exports):
        export, _, own_target = spec.partition("::")
        mla = json.loads((Path(export) / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        cls = Eagle3DeepseekV2ForCausalLM if mla else Eagle3LlamaForCausalLM
        speculative = {"method": "eagle3", "model": export, "num_speculative_tokens": 3}
        args = EngineArgs(
            model=own_target or target, speculative_config=speculative, dtype="float32", max_model_len=512,
            enforce_eager=True, trust_remote_code=True,
        )  # fmt: skip
        config = args.create_engine_config()
        with set_current_vllm_config(config):
            if i == 0:
                init_distributed_environment(
                    world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                    local_rank=0, backend="gloo",
                )  # fmt: skip
                initialize_model_parallel(1, 1)
            model = cls(vllm_config=config)
            with torch.no_grad():
                for param in model.parameters():
                    param.fill_(-1 if not param.is_floating_point() else float("nan"))
                model.load_weights(load_file(str(Path(export) / "model.safetensors")).items())
                not_loaded = sorted(
                    n for n, p in model.named_parameters()
                    if (p.isnan().any() if p.is_floating_point() else (p < 0).all())
                )  # fmt: skip
                shapes = {name: list(p.shape) for name, p in model.named_parameters()}
                process_weights_after_loading(model, config.speculative_config.draft_model_config, torch.device("cpu"))
                aux = auxes.get(f"aux-{i}", auxes["aux"])
                combined = model.combine_hidden_states(aux.to(torch.float32))
        save_file({"combined": combined.contiguous()}, str(out / f"combined-{i}.safetensors"))
        params = dict(model.named_parameters())
        result = {
            "export": export,
            "class": cls.__name__,
            "not_loaded": not_loaded,
            "parameters": sorted(params),
            "shapes": shapes,
            "norm_before_fc": bool(getattr(model.model, "norm_before_fc", False)),
            "fc_norm": model.model.fc_norm is not None,
            "norm_output": bool(model.model.norm_output),
        }
        if mla:
            attn = model.model.layers[0].self_attn
            result["softmax_scale"] = float(attn.scaling)
            result["rope_class"] = type(attn.rotary_emb).__name__
            result["rope_neox"] = bool(attn.rotary_emb.is_neox_style)
            save_file(
                {"cos_sin": attn.rotary_emb.cos_sin_cache[:ROPE_ROWS].float().contiguous()},
                str(out / f"rope-{i}.safetensors"),
            )
        results.append(result)
    (out / "result.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
