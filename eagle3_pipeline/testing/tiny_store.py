"""Small hidden-state stores for the drafter's tests and benchmark.

``real_store`` runs the embedded model (SmolLM2-135M-Instruct, the stand-in for the target) over
the shipped prompt sets and writes its aux/final hidden states with the real ``ShardWriter``, plus
a draft vocabulary built as SpecForge builds one (most frequent masked tokens, sorted). The prompts
have no target responses yet at this stage, so every token of the chat-templated prompt is a
trained token: the teacher is the target's own distribution, which is what matters for training.
``greedy_store`` stores given prompts with a model's own greedy continuation (the embedded model's or a tiny
target's; loss-masked), each sample in both splits: a drafter trained on it is measured on what a greedy
server generates.
``random_store`` writes random tensors for a small made-up target, for shape and resume tests.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_pipeline.config import DatasetConfig, PromptsConfig
from eagle3_pipeline.generation.prompts import load_prompts
from eagle3_pipeline.hidden_states.store import (
    HiddenStateStore,
    ShardWriter,
    StoreManifest,
    TargetIdentity,
    default_aux_layer_ids,
    save_draft_vocab,
)

if TYPE_CHECKING:
    import torch

SAMPLE_SETS = (
    ("B1_chat", "chat.jsonl"),
    ("B2_tools", "tools.jsonl"),
    ("B3_code", "code.jsonl"),
    ("B4_math", "math.jsonl"),
)
EVAL_EVERY = 10


def make_vocab(counts: Counter[int], vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    for pad in range(draft_vocab_size):
        if len(counts) >= draft_vocab_size:
            break
        counts.setdefault(pad, 0)
    used = torch.tensor(sorted(t for t, _ in counts.most_common(draft_vocab_size)), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab_size), t2d


def _finish(
    root: Path, shards: list[str], manifest: StoreManifest, writer_bytes: int, tokens: int, samples: int
) -> HiddenStateStore:
    store = HiddenStateStore(root)
    store.write_index(shards)
    manifest.shards, manifest.tokens, manifest.samples, manifest.bytes = shards, tokens, samples, writer_bytes
    store.write_manifest(manifest)
    return store


def real_store(
    root: Path,
    vocab_dir: Path,
    *,
    model_dir: Path,
    samples: int,
    draft_vocab_size: int,
    max_tokens: int = 256,
    shard_samples: int = 64,
) -> HiddenStateStore:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    config = json.loads((model_dir / "config.json").read_text())
    layers = default_aux_layer_ids(config["num_hidden_layers"])
    samples_dir = Path(__file__).resolve().parent.parent / "samples"
    records = []
    for dataset_id, name in SAMPLE_SETS:
        ds = DatasetConfig(id=dataset_id, source=str(samples_dir / name))
        records += load_prompts(ds, PromptsConfig(), seed=0)[0]
    records = records[:: max(1, len(records) // samples)][:samples]
    counts: Counter[int] = Counter()
    shards: list[str] = []
    total_bytes = tokens = 0
    writer = ShardWriter(root, 0)
    with torch.no_grad():
        for i, record in enumerate(records):
            text = tokenizer.apply_chat_template(record.messages, tokenize=False)
            ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens])
            out = model(ids[None], output_hidden_states=True)
            states = out.hidden_states
            aux = torch.cat([states[k + 1][0] for k in layers], dim=-1)
            mask = torch.ones_like(ids, dtype=torch.uint8)
            split = "eval" if i % EVAL_EVERY == EVAL_EVERY - 1 else "train"
            writer.add(
                record.id, record.dataset, split=split, input_ids=ids, loss_mask=mask, aux=aux, hidden=states[-1][0]
            )
            if split == "train":
                counts.update(ids.tolist())
            if writer.samples == shard_samples:
                total_bytes += writer.close()
                tokens += writer.tokens
                shards.append(writer.name)
                writer = ShardWriter(root, len(shards))
    if writer.samples:
        total_bytes += writer.close()
        tokens += writer.tokens
        shards.append(writer.name)
    identity = TargetIdentity(
        "SmolLM2-135M-Instruct", "test", config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    )
    d2t, t2d = make_vocab(counts, config["vocab_size"], draft_vocab_size)
    save_draft_vocab(
        vocab_dir, d2t, t2d, {"draft_vocab_size": draft_vocab_size, "target_vocab_size": config["vocab_size"]}
    )
    return _finish(root, shards, StoreManifest(identity, layers, "test"), total_bytes, tokens, len(records))


def greedy_store(
    root: Path, vocab_dir: Path, model_dir: Path, prompts: list[str], new_tokens: int, draft_vocab_size: int
) -> list[list[int]]:
    """A store of ``prompts`` (raw text, no template) each followed by the greedy continuation of
    ``new_tokens`` of the model in ``model_dir`` (the embedded model, or a tiny target whose tokenizer is
    remote code; float32; only the continuation trained), written once as ``train`` and once as ``eval``;
    the draft vocabulary the continuations' most frequent tokens. Returns the prompts' token ids (what a
    server is sent)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    config = json.loads((model_dir / "config.json").read_text())
    layers = default_aux_layer_ids(config["num_hidden_layers"])
    counts: Counter[int] = Counter()
    writer = ShardWriter(root, 0)
    prompt_ids: list[list[int]] = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            full = ids
            for _ in range(new_tokens):
                token = model(full[None]).logits[0, -1].argmax()
                full = torch.cat([full, token[None]])
                if int(token) == tokenizer.eos_token_id:
                    break
            states = model(full[None], output_hidden_states=True).hidden_states
            aux = torch.cat([states[k + 1][0] for k in layers], dim=-1)
            mask = (torch.arange(full.shape[0]) >= ids.shape[0]).to(torch.uint8)
            for split in ("train", "eval"):
                writer.add(
                    f"{split}{i}", "B1_chat", split=split, input_ids=full, loss_mask=mask, aux=aux, hidden=states[-1][0]
                )
            counts.update(full[ids.shape[0] :].tolist())
            prompt_ids.append(ids.tolist())
    total_bytes, tokens = writer.close(), writer.tokens
    identity = TargetIdentity(
        model_dir.name, "test", config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    )
    d2t, t2d = make_vocab(counts, config["vocab_size"], draft_vocab_size)
    save_draft_vocab(
        vocab_dir, d2t, t2d, {"draft_vocab_size": draft_vocab_size, "target_vocab_size": config["vocab_size"]}
    )
    _finish(root, [writer.name], StoreManifest(identity, layers, "test"), total_bytes, tokens, 2 * len(prompts))
    return prompt_ids


def random_target(folder: Path, hidden: int = 32, vocab: int = 96, layers: int = 8) -> Path:
    """A made-up target folder (config + tied embedding) for shape and resume tests."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "hidden_size": hidden, "vocab_size": vocab, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden // 4, "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": True,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    save_file(
        {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator)},
        str(folder / "model.safetensors"),
    )
    return folder


def random_store(
    root: Path,
    vocab_dir: Path,
    *,
    target_dir: Path,
    samples: int,
    draft_vocab_size: int,
    length: int = 24,
    seed: int = 0,
) -> HiddenStateStore:
    """Random states whose teacher (the tied embedding applied to ``hidden``) is learnable."""
    import torch

    config = json.loads((target_dir / "config.json").read_text())
    h, v = config["hidden_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    writer = ShardWriter(root, 0)
    shards, total_bytes, tokens = [], 0, 0
    counts: Counter[int] = Counter()
    for i in range(samples):
        n = length - (i % 5)
        ids = torch.randint(0, v, (n,), generator=generator)
        hidden = torch.randn(n, h, generator=generator)
        aux = torch.cat([hidden + 0.1 * torch.randn(n, h, generator=generator) for _ in range(3)], dim=-1)
        split = "eval" if i % EVAL_EVERY == EVAL_EVERY - 1 else "train"
        writer.add(
            f"s{i}",
            "B1",
            split=split,
            input_ids=ids,
            loss_mask=torch.ones(n, dtype=torch.uint8),
            aux=aux,
            hidden=hidden,
        )
        counts.update(ids.tolist())
        if writer.samples == 16:
            total_bytes += writer.close()
            tokens += writer.tokens
            shards.append(writer.name)
            writer = ShardWriter(root, len(shards))
    if writer.samples:
        total_bytes += writer.close()
        tokens += writer.tokens
        shards.append(writer.name)
    d2t, t2d = make_vocab(counts, v, draft_vocab_size)
    save_draft_vocab(vocab_dir, d2t, t2d, {"draft_vocab_size": draft_vocab_size, "target_vocab_size": v})
    identity = TargetIdentity("random", "test", config["num_hidden_layers"], h, v)
    return _finish(
        root,
        shards,
        StoreManifest(identity, default_aux_layer_ids(config["num_hidden_layers"]), "test"),
        total_bytes,
        tokens,
        samples,
    )
