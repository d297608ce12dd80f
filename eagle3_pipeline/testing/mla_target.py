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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_pipeline.testing.kimi.fixture import build_kimi_text_checkpoint, text_config

if TYPE_CHECKING:
    from eagle3_pipeline.testing.train_settings import GreedyTrained

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


def train_mla_drafter(
    work: Path, *, new_tokens: int, epochs: int, steps: int, switches: dict[str, Any], draft_vocab: int = 256
) -> GreedyTrained:
    """The target in ``work`` and an MLA drafter (``attention: mla`` plus ``switches``) trained on its greedy
    continuations of :data:`PROMPTS` (:func:`~eagle3_pipeline.testing.train_settings.train_on_greedy_store`)."""
    from eagle3_pipeline.testing.train_settings import train_on_greedy_store

    deepseek_mla_target(work)
    return train_on_greedy_store(
        work, work / "target", PROMPTS, new_tokens=new_tokens, epochs=epochs, steps=steps,
        model={"attention": "mla", **switches}, draft_vocab=draft_vocab,
    )  # fmt: skip
