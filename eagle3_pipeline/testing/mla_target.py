"""A tiny random DeepSeek-V3 target that vLLM's CPU build serves with MLA, for the MLA draft head's serving
checks (``benchmarks/mla_vllm_serve.py``, ``real_vllm/test_mla_served_vllm.py``).

It is the Kimi-K2.5 stand-in's language model (``testing/kimi``: its text config, MoE, YaRN and tokenizer)
with Kimi's latent width, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: vLLM 0.32's CPU MLA backend takes
only 320, 512 or 576 for that sum, and the stand-in's own 16 + 8 is refused ("Head dimension 24 is not
supported by MLA"). Random weights, bf16, saved with ``save_pretrained``; loading needs remote code only
for the tokenizer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.testing.kimi.fixture import build_kimi_text_checkpoint, text_config

TOKENIZER_FILES = ("tiktoken.model", "tokenization_kimi.py", "tool_declaration_ts.py", "tokenizer_config.json")
LATENT = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def deepseek_mla_target(folder: Path, seed: int = 0) -> dict[str, Any]:
    """Write the target to ``folder/target`` (the stand-in's files under ``folder/stand-in``); returns its
    config as a flat dict (``rope_theta``/``rope_scaling`` in the old form)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    stand_in = build_kimi_text_checkpoint(folder / "stand-in")
    raw: dict[str, Any] = text_config() | LATENT
    torch.manual_seed(seed)
    target = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(json.loads(json.dumps(raw))))  # it edits its input
    target.bfloat16().save_pretrained(folder / "target")
    for name in TOKENIZER_FILES:
        shutil.copyfile(stand_in / name, folder / "target" / name)
    return raw


# Prompts whose greedy continuations by the random target a drafter learns in a few dozen epochs.
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "a b c d e f g h i j k",
    "Monday, Tuesday, Wednesday,",
    "January, February, March, April,",
    "10, 20, 30, 40, 50, 60,",
    "one two three four five six",
    "The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
]
# What vLLM needs beside the EAGLE-3 flags for this target: its tokenizer is remote code; a short context.
SERVER_ARGS = ["--trust-remote-code", "--max-model-len", "512"]


@dataclass
class TrainedMLA:
    target: Path
    export: Path
    prompt_ids: list[list[int]]
    result: dict[str, Any]


def train_mla_drafter(
    work: Path, *, new_tokens: int, epochs: int, steps: int, switches: dict[str, Any], draft_vocab: int = 256
) -> TrainedMLA:
    """The target in ``work``, a store of its greedy continuations of :data:`PROMPTS` (each row in both
    splits), and an MLA drafter (``attention: mla`` plus ``switches``) trained on it by the train phase,
    exported with its last checkpoint; ``result`` is the phase's (its last eval is the export's τ@``steps``)."""
    from eagle3_pipeline.drafter.train.phase import run
    from eagle3_pipeline.testing.reporter import Recorder
    from eagle3_pipeline.testing.tiny_store import greedy_store
    from eagle3_pipeline.testing.train_settings import train_settings

    deepseek_mla_target(work)
    target = work / "target"
    prompt_ids = greedy_store(work / "store", work / "vocab", target, PROMPTS, new_tokens, draft_vocab)
    settings = train_settings(
        ttt_steps=steps, lr=1e-2, epochs=epochs, batch_tokens=1024, max_seq_len=128, checkpoint_every=epochs,
        eval_samples=len(PROMPTS), seed=0, model={"attention": "mla", **switches},
    )  # fmt: skip
    spec = {
        "store": str(work / "store"),
        "draft_vocab": str(work / "vocab"),
        "target_weights": str(target),
        "run_dir": str(work / "run"),
        "export_dir": str(work / "export"),
        "settings": settings,
    }
    return TrainedMLA(target, work / "export", prompt_ids, run(spec, Recorder()))
