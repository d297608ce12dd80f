"""Data–target agreement and τ against the target's argmax on a real store from the embedded model
(SmolLM2-135M-Instruct, the target's stand-in): the same chat prompts answered greedily (``B1_chat``,
as the pipeline's ``temperature: 0``) and sampled at temperature 0.8 (``B1_chat_t08``). The sampled
data disagree with the target's argmax, so ``drafter_eval`` warns about that dataset and not about
the greedy one. Run with ``-s`` to see the figures."""

from __future__ import annotations

import io
import json
import logging
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dagster as dg

from eagle3_pipeline.cli.cmd_run import CliListener, MainJob
from eagle3_pipeline.components.eagle3.drafter_eval import build_drafter_eval
from eagle3_pipeline.config import (
    DatasetConfig,
    PromptsConfig,
    load_config,
    local_profile_path,
)
from eagle3_pipeline.drafter.evaluate.acceptance import AcceptanceStats, target_reference
from eagle3_pipeline.drafter.evaluate.phase import read_rows, select_rows, target_next_argmax
from eagle3_pipeline.drafter.evaluate.results import WARNING
from eagle3_pipeline.drafter.export.specforge import export_for_servers
from eagle3_pipeline.drafter.model.draft_config import drafter_config
from eagle3_pipeline.drafter.spec import drafter_paths, target_weights
from eagle3_pipeline.drafter.train.phase import build_model
from eagle3_pipeline.generation.prompts import load_prompts
from eagle3_pipeline.hidden_states.store import (
    HIDDEN_KEY,
    IDS_KEY,
    MASK_KEY,
    HiddenStateStore,
    ShardWriter,
    StoreManifest,
    TargetIdentity,
    default_aux_layer_ids,
    load_draft_vocab,
    save_draft_vocab,
)
from eagle3_pipeline.target.weights import load_target_weights
from eagle3_pipeline.testing.tiny_store import make_vocab
from eagle3_pipeline_tests.dagster_runs import pipeline_resources

pytestmark = pytest.mark.local_model

SAMPLES = Path(__file__).resolve().parents[3] / "eagle3_pipeline" / "samples"
PROMPTS, PROMPT_TOKENS, TRAIN, NEW_TOKENS, DRAFT_VOCAB = 8, 64, 3, 32, 512
GREEDY, SAMPLED = "B1_chat", "B1_chat_t08"
STEPS = (3, 5, 7)


def responses(model: Any, tokenizer: Any, prompts: list[Any], temperature: float) -> list[list[int]]:
    """Each prompt's generated tokens up to and with the end of turn: greedy, or sampled at ``temperature``
    (no top-k/top-p), in one left-padded batch as a server batches requests."""
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature
        else {"do_sample": False}
    )
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id, **sampling)
    generated = out[:, batch["input_ids"].shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    return [tokens[: tokens.index(eos) + 1] if eos in tokens else tokens for tokens in generated]


@pytest.fixture(scope="module")
def generated_store(tmp_path_factory: pytest.TempPathFactory, local_model: Path) -> tuple[Path, Path]:
    """The store (prompt + response, the response masked) and a draft vocabulary of its train tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("agreement")
    tokenizer = AutoTokenizer.from_pretrained(str(local_model))
    model = AutoModelForCausalLM.from_pretrained(str(local_model), dtype=torch.float32).eval()
    config = json.loads((local_model / "config.json").read_text())
    layers = default_aux_layer_ids(config["num_hidden_layers"])
    rendered = [
        (record, tokenizer.apply_chat_template(record.messages, tokenize=False, add_generation_prompt=True))
        for record in load_prompts(
            DatasetConfig(id=GREEDY, source=str(SAMPLES / "chat.jsonl")), PromptsConfig(), seed=0
        )[0]
    ]
    short = [
        (r, text)
        for r, text in rendered
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= PROMPT_TOKENS
    ][:PROMPTS]
    records, texts = [r for r, _ in short], [text for _, text in short]  # short prompts: one batch, little padding
    writer = ShardWriter(root / "store", 0)
    counts: Counter[int] = Counter()
    for dataset, temperature in ((GREEDY, 0.0), (SAMPLED, 0.8)):
        for number, (record, text, response) in enumerate(
            zip(records, texts, responses(model, tokenizer, texts, temperature), strict=True)
        ):
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = torch.tensor(prompt + response)
            with torch.no_grad():
                states = model(ids[None], output_hidden_states=True).hidden_states  # the last one after the final norm
            split = "train" if number < TRAIN else "eval"
            mask = torch.tensor([0] * len(prompt) + [1] * len(response), dtype=torch.uint8)
            writer.add(
                f"{dataset}/{record.id}",
                dataset,
                split=split,
                input_ids=ids,
                loss_mask=mask,
                aux=torch.cat([states[k + 1][0] for k in layers], -1),
                hidden=states[-1][0],
            )
            if split == "train":
                counts.update(response)
    writer.close()
    store = HiddenStateStore(root / "store")
    index = store.write_index([writer.name])
    identity = TargetIdentity(
        "SmolLM2-135M-Instruct", "test", config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    )
    store.write_manifest(
        StoreManifest(
            identity,
            layers,
            "test",
            shards=[writer.name],
            samples=index.num_rows,
            tokens=sum(index.column("length").to_pylist()),
        )
    )
    d2t, t2d = make_vocab(counts, config["vocab_size"], DRAFT_VOCAB)
    save_draft_vocab(
        root / "draft_vocab", d2t, t2d, {"draft_vocab_size": DRAFT_VOCAB, "target_vocab_size": config["vocab_size"]}
    )
    return root / "store", root / "draft_vocab"


def untrained_export(folder: Path, store: Path, vocab: Path, target_dir: Path) -> Path:
    """A freshly initialised drafter in the served layout: the drafter path of the phase, not a good τ."""
    target = load_target_weights(target_dir)
    d2t, t2d, _ = load_draft_vocab(vocab)
    config = drafter_config(
        target.config, int(d2t.shape[0]), list(HiddenStateStore(store).manifest().aux_layer_ids), {}
    )
    return export_for_servers(build_model(config, target, d2t, t2d, seed=0), folder, target.config, "float32")


def pipeline_file(folder: Path, store: Path, vocab: Path, local_model: Path) -> Path:
    """The local profile over ``folder``: the store, vocabulary, an untrained export and a training_data
    manifest holding one eval prompt out in both datasets, where ``drafter_eval`` reads them."""
    artifacts = folder / "artifacts"
    paths = drafter_paths(artifacts)
    shutil.copytree(store, paths["store"])
    shutil.copytree(vocab, paths["draft_vocab"])
    untrained_export(paths["export_dir"], store, vocab, local_model)
    first = select_rows(HiddenStateStore(store), "eval")[0]["sample_id"].split("/", 1)[1]
    held_out = {dataset: [f"{dataset}/{first}"] for dataset in (GREEDY, SAMPLED)}  # the same prompt in both
    (artifacts / "training_data").mkdir()
    (artifacts / "training_data" / "manifest.json").write_text(json.dumps({"version": "test", "held_out": held_out}))
    text = (
        local_profile_path()
        .read_text()
        .replace("../samples/", str(local_profile_path().parent.parent / "samples") + "/")
    )
    config = folder / "pipeline.yaml"
    config.write_text(text + f"artifacts_root: {artifacts}\ndrafter_eval:\n  device: cpu\n  min_data_agreement: 0.9\n")
    return config


@pytest.mark.slow
def test_sampled_data_disagree_with_the_target_and_drafter_eval_says_so(
    generated_store: tuple[Path, Path], local_model: Path, tmp_path: Path
) -> None:
    """The drafter_eval asset materialized for real: the table and the warning first in its metadata, the
    warning in the run log (at WARNING) and in what the CLI prints from the result it hears in process."""
    config_path = pipeline_file(tmp_path, *generated_store, local_model)
    config = load_config(config_path)
    assert target_weights(config.drafter, config.compute) == str(
        local_model
    )  # the embedded model's folder: its lm_head gives the argmax
    listener = CliListener(None)
    with dg.DagsterInstance.ephemeral() as instance:
        outcome = dg.materialize(
            build_drafter_eval(config),
            instance=instance,
            resources={**pipeline_resources(config_path), "phase_listener": listener},
        )
        assert outcome.success
        metadata = outcome.asset_materializations_for_node("drafter_eval")[0].metadata
        logs = instance.all_logs(outcome.run_id)
    result: dict[str, Any] = {key: value.value for key, value in metadata.items()}
    print("\n" + result["table"])
    for dataset in (GREEDY, SAMPLED, "all"):
        print(
            f"{dataset}: agreement {result[f'data_agreement/{dataset}']:.4f} over "
            f"{result[f'eval_positions/{dataset}']} positions; "
            + "; ".join(
                f"{who} τ@{k} {result[f'{prefix}tau@{k}/{dataset}']:.3f} stored / "
                f"{result[f'{prefix}tau_vs_target@{k}/{dataset}']:.3f} target"
                for who, prefix in (("bigram", "bigram_"), ("untrained drafter", ""))
                for k in STEPS
            )
        )
    assert list(result)[:2] == ["table", WARNING]
    assert result[f"data_agreement/{GREEDY}"] >= 0.97  # greedy: the target's argmax up to float differences
    assert result[f"data_agreement/{SAMPLED}"] < 0.9
    warnings = result[WARNING].splitlines()
    assert [line.split(":")[0] for line in warnings] == [SAMPLED]
    assert "generated at temperature > 0, imported samples, or text re-tokenised since generation" in warnings[0]
    assert any(entry.level == logging.WARNING and entry.user_message == warnings[0] for entry in logs)  # the run log
    with dg.DagsterInstance.ephemeral() as instance:
        job = MainJob(config, None, instance, io.StringIO())
        job.listener = listener  # what the CLI heard from the run
        assert f"warning: {warnings[0]}" in "\n".join(job.drafter_summary())
    for dataset in (GREEDY, SAMPLED):
        assert result[f"held_out_samples/{dataset}"] == 1 and f"| {dataset} held-out | 1 |" in result["table"]
    # the greedy data's τ is the same number both ways where the tokens are the target's argmax
    for k in STEPS:
        assert abs(result[f"bigram_tau@{k}/{GREEDY}"] - result[f"bigram_tau_vs_target@{k}/{GREEDY}"]) < 0.1


def test_a_drafter_that_drafts_the_targets_argmax_loses_tau_only_against_sampled_tokens(
    generated_store: tuple[Path, Path], local_model: Path
) -> None:
    """The best teacher-forced drafter (depth j at t drafts the target's argmax after x_{≤t+1+j}) walked
    both ways: against the target's argmax it reaches the bound on both datasets; against the stored
    tokens it keeps that τ on greedy data and loses it on sampled data — the τ a user would misread."""
    store, _ = generated_store
    lm_head = load_target_weights(local_model).lm_head.float()
    stats = {(dataset, way): AcceptanceStats(STEPS) for dataset in (GREEDY, SAMPLED) for way in ("stored", "target")}
    rows = select_rows(HiddenStateStore(store), "eval")
    for row, tensors in read_rows(HiddenStateStore(store), rows, (IDS_KEY, MASK_KEY, HIDDEN_KEY)):
        ids, mask = tensors[IDS_KEY].long(), tensors[MASK_KEY].bool()
        argmax = target_next_argmax(tensors[HIDDEN_KEY], lm_head).numpy()
        padded = np.concatenate([argmax, np.full(max(STEPS) + 2, -1)])
        oracle = np.stack([padded[np.arange(ids.shape[0]) + 1 + j] for j in range(max(STEPS))])
        stats[row["dataset"], "stored"].add(oracle, ids, mask)
        stats[row["dataset"], "target"].add(oracle, ids, mask, target_reference(ids, argmax))
    for (dataset, way), tally in stats.items():
        print(
            f"\ntarget-argmax drafter on {dataset} against the {way} tokens: "
            + ", ".join(f"τ@{k} {tally.tau(k):.3f}" for k in STEPS)
        )
    for k in STEPS:
        greedy_stored, greedy_target = stats[GREEDY, "stored"].tau(k), stats[GREEDY, "target"].tau(k)
        sampled_stored, sampled_target = stats[SAMPLED, "stored"].tau(k), stats[SAMPLED, "target"].tau(k)
        assert greedy_target > k * 0.8 and sampled_target > k * 0.8  # every draft accepted but at the response ends
        assert abs(greedy_stored - greedy_target) < 0.15 * greedy_target
        assert sampled_stored < sampled_target - 1.0  # a whole token less per verify step, from K = 3 on
