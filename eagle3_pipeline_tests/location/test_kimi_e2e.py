"""The main job end to end on a Kimi-K2.5-shaped target: `eagle3-pipeline run` as a real process
on a real Dagster instance, prompts → responses → training_data → draft_vocab → hidden_states
(transformers, `trust_remote_code`) → eagle3_drafter (YaRN) → export → drafter_eval.

Stand-ins: the 1T target is the tiny random-weight Kimi-like checkpoint of
`eagle3_pipeline/testing/kimi/fixture.py` (remote-code `kimi_k25` config over a nested DeepSeek-V3
`text_config`, `language_model.` weights in shards, the slow TikToken tokenizer and K2.5 template);
the SGLang server is a loopback OpenAI-compatible server that answers as SGLang does with
`--reasoning-parser kimi_k2 --tool-call-parser kimi_k2`: `reasoning_content` apart from `content`,
tool calls as `tool_calls` (finish reason `tool_calls`) when the request carries tools.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline.testing.kimi.fixture import build_kimi_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]
SAMPLES = Path(__file__).resolve().parents[2] / "eagle3_pipeline" / "samples"


def reasoning_for(body: dict[str, Any]) -> str:
    return f"The user asks about {body['messages'][-1]['content'][:24].strip()}; answer briefly."


def kimi_server(body: dict[str, Any], _n: int) -> Reply:
    """SGLang with Kimi's reasoning and tool-call parsers: reasoning apart, tool calls parsed."""
    reasoning = reasoning_for(body)
    if body.get("tools"):
        tool = body["tools"][0]["function"]
        call = {
            "id": "functions.{}:0".format(tool["name"]),
            "type": "function",
            "function": {"name": tool["name"], "arguments": json.dumps({"query": "today"})},
        }
        return Reply(
            payload=echo_completion(
                body,
                completion_tokens=24,
                finish_reason="tool_calls",
                content=None,
                tool_calls=[call],
                reasoning_content=reasoning,
            )
        )
    return Reply(payload=echo_completion(body, completion_tokens=24, reasoning_content=reasoning))


def masked_texts(out: Path, tokenizer: Any) -> dict[str, str]:
    texts = {}
    for shard in sorted((out / "training_data").glob("*-*.parquet")):
        for row in pq.read_table(shard).to_pylist():
            ids = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
            texts[row["id"]] = tokenizer.decode(ids)
    return texts


def test_main_job_on_a_kimi_shaped_target(tmp_path: Path, specforge: Any) -> None:
    checkpoint = build_kimi_checkpoint(tmp_path / "Kimi-K2.5-tiny")
    from eagle3_pipeline.target.folder import load_tokenizer

    tokenizer = load_tokenizer(str(checkpoint), trust_remote_code=True)
    # The server's tokenize route tokenizes with the target's own tokenizer, as SGLang's does.
    server = FakeOpenAI(
        script=kimi_server, tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False)
    ).start()
    try:
        config = tmp_path / "pipeline.yaml"
        config.write_text(
            "name: kimi\nartifacts_root: out\nseed: 7\n"
            f"target: {{model: kimi-k2.5, tokenizer: '{checkpoint}', trust_remote_code: true, max_seq_len: 4096}}\n"
            f"inference: {{kind: endpoints, endpoints: [{{base_url: '{server.base_url}'}}]}}\n"
            "generation: {max_tokens: 64, concurrency: 4, reasoning: keep}\nhealth: {max_truncation_rate: 1.0}\n"
            "training_data: {eval_fraction: 0.3, reasoning: emit}\n"
            f"hidden_states: {{model: '{checkpoint}', shard_tokens: 4096, spot_check_samples: 2}}\n"
            f"drafter: {{target_weights: '{checkpoint}', ttt_steps: 2, lr: 0.003, epochs: 20, batch_tokens: 2048, "
            "max_seq_len: 1024}\n"
            "datasets:\n"
            f"  - {{id: B1_chat, source: '{SAMPLES / 'chat.jsonl'}', format: sharegpt, sample_size: 6}}\n"
            f"  - {{id: B2_tools, source: '{SAMPLES / 'tools.jsonl'}', format: openai, sample_size: 6}}\n"
        )
        env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home")}
        run = subprocess.run(
            [*CLI, "run", "--config", str(config)], capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path
        )
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        print(run.stdout[-3000:])
    finally:
        server.stop()
    out = tmp_path / "out"
    assert "acceptance length τ on the eval split" in run.stdout and "| all |" in run.stdout
    assert "tokenizer agreement: ok (8 rendered samples" in run.stdout + run.stderr
    responses = {
        r["id"]: r
        for d in ("B1_chat", "B2_tools")
        for r in pq.read_table(out / "responses" / f"{d}.parquet").to_pylist()
    }
    texts = masked_texts(out, tokenizer)
    assert texts and set(texts) <= set(responses)
    with_reasoning = [i for i in texts if responses[i]["reasoning"]]
    # K2.5's generation prompt ends with <think>: what the target emits starts with its reasoning.
    holding = [i for i in with_reasoning if texts[i].startswith(f"{responses[i]['reasoning']}</think>")]
    print(f"training rows whose masked tokens hold the server's reasoning: {len(holding)} of {len(with_reasoning)}")
    assert with_reasoning and holding == with_reasoning
    tool_rows = [i for i in texts if responses[i]["finish_reason"] == "tool_calls"]
    assert tool_rows and all("<|tool_calls_section_begin|>" in texts[i] for i in tool_rows)

    losses = re.search(r"loss ([0-9.]+) → ([0-9.]+)", run.stdout)
    assert losses, run.stdout
    first, last = (float(v) for v in losses.groups())
    assert last < first, "the drafter learns"

    # The export the pipeline wrote loads strictly into SpecForge's own class (the target's embedding
    # added, as SpecForge's Eagle3DraftModel.load_embedding does).
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from eagle3_pipeline.target.weights import load_target_weights

    folder = out / "drafter" / "export"
    export = json.loads((folder / "config.json").read_text())
    assert export["vocab_size"] == len(tokenizer) and export["max_position_embeddings"] >= 262144
    assert export["rope_scaling"]["rope_type"] == "yarn" and export["rope_scaling"]["factor"] == 64.0
    assert (export["num_key_value_heads"], export["head_dim"]) == (1, 128), "MLA target: the published GQA draft shape"
    assert export["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert export["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    theirs = specforge.LlamaForCausalLMEagle3(LlamaConfig.from_dict(export))
    weights = {
        **load_file(str(folder / "model.safetensors")),
        "embed_tokens.weight": load_target_weights(checkpoint).embedding,
    }
    # A full draft vocabulary exports no d2t/t2d (vLLM 0.32's EAGLE-3 classes refuse them then); SpecForge's class
    # always has the buffers, and the identity mapping is what this pipeline's load_export reads in their place.
    assert export["draft_vocab_size"] == export["vocab_size"] and "d2t" not in weights
    weights |= {
        "d2t": torch.zeros(export["vocab_size"], dtype=torch.int64),
        "t2d": torch.ones(export["vocab_size"], dtype=torch.bool),
    }
    theirs.load_state_dict(weights, strict=True)
