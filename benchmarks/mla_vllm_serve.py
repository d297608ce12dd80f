"""Whether the real vLLM CPU build serves the MLA draft head (``drafter.model.attention: mla``), and what
its speculative-decoding counters say.

The target is a tiny random DeepSeek-V3 (the Kimi-K2.5 stand-in's language model, ``testing/kimi``,
with Kimi's latent width: ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64; vLLM's MLA attention takes
only 320, 512 or 576 for their sum, so the stand-in itself (24) is served by no vLLM MLA backend) and
the draft a random-weight MLA export of it with EAGLE-3.1 switches and a 64-token draft vocabulary. A
random draft is accepted by chance only: τ near 1 is the expected figure; what this shows is that vLLM
builds, loads and runs the export's MLA draft layer with its latent KV cache, step after step.

Prints vLLM's spec-decode counters (drafts, draft tokens, accepted per position) and τ = 1 + accepted /
drafts after greedy completions of ``--prompts`` prompts of ``--max-tokens`` tokens.

    EAGLE3_VLLM_PYTHON=/work/main/.vllm-venv/bin/python .venv/bin/python -m benchmarks.mla_vllm_serve [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

from eagle3_pipeline.drafter.export.specforge import export_for_servers
from eagle3_pipeline.drafter.model.draft_config import drafter_config, target_rope
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.testing.kimi.fixture import build_kimi_text_checkpoint, text_config
from eagle3_pipeline.testing.real_vllm import vllm_server

PROMPTS = ["The quick brown fox jumps over", "Once upon a time there was", "def fibonacci(n):", "The capital of"]
TOKENIZER_FILES = ("tiktoken.model", "tokenization_kimi.py", "tool_declaration_ts.py", "tokenizer_config.json")


def deepseek_target(folder: Path) -> dict[str, Any]:
    """A random DeepSeek-V3 at the stand-in's size but Kimi's latent width, with the stand-in's tokenizer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    stand_in = build_kimi_text_checkpoint(folder / "stand-in")
    raw: dict[str, Any] = text_config() | {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(json.loads(json.dumps(raw))))  # it edits its input
    target.bfloat16().save_pretrained(folder / "target")
    for name in TOKENIZER_FILES:
        shutil.copyfile(stand_in / name, folder / "target" / name)
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the MLA draft head in the real vLLM CPU build.")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="mla-serve-"))
    raw = deepseek_target(work)
    theta, scaling = target_rope(raw)
    config = drafter_config(
        raw | {"rope_theta": theta, "rope_scaling": scaling}, 64, [1, 3, 5],
        {"attention": "mla", "fc_norm": True, "norm_output": True},
    )  # fmt: skip
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    model.set_vocab(torch.arange(64) * 3, torch.arange(config.vocab_size) % 3 == 0)
    export = export_for_servers(model, work / "mla", raw, dtype="bfloat16")
    speculative = {"method": "eagle3", "model": str(export), "num_speculative_tokens": 3}
    extra = ["--trust-remote-code", "--max-model-len", "512", "--speculative-config", json.dumps(speculative)]
    with vllm_server(work / "target", work / "vllm.log", extra_args=extra) as server:
        for prompt in PROMPTS:
            body = {"model": "target", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            httpx.post(f"{server.base_url}/completions", json=body, timeout=600).raise_for_status()
        metrics = httpx.get(f"{server.root_url}/metrics", timeout=30).text
    counters: dict[str, float] = {}
    for line in metrics.splitlines():
        found = re.match(r"vllm:spec_decode_(\w+)_total\{([^}]*)\} (\S+)$", line)
        if found:
            position = re.search(r'position="(\d+)"', found.group(2))
            counters[found.group(1) + (f"[{position.group(1)}]" if position else "")] = float(found.group(3))
    print(json.dumps(counters, indent=1))
    drafts = counters.get("num_drafts", 0.0)
    tau = 1 + counters.get("num_accepted_tokens", 0.0) / max(drafts, 1)
    print(f"tau = 1 + accepted/drafts = {tau:.3f} over {drafts:.0f} drafts")


if __name__ == "__main__":
    main()
