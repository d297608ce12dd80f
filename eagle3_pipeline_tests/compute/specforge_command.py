"""Stands in for SpecForge's ``prepare_hidden_states.py`` as a ``compute.command`` in the tests:
``python -m eagle3_pipeline_tests.compute.specforge_command SPEC OUTPUT_DIR`` reads the extract
spec the orchestrator wrote (host paths), and writes one file per ``training_data`` row (train
shards, then eval shards, as the importer expects) in SpecForge's offline format, with the
sample's real input_ids and loss_mask and random states of the target's shape (from its
config.json). Real SpecForge would run the target under SGLang; the states' values are not what
these tests check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from eagle3_pipeline.hidden_states.store import default_aux_layer_ids
from eagle3_pipeline.training_data.reader import SPLITS, TrainingData, read_column
from eagle3_pipeline_tests.hidden_states.specforge_files import Sample, write_specforge


def main(spec_path: str, output_dir: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    layers = len(spec.get("aux_layer_ids") or default_aux_layer_ids(int(config["num_hidden_layers"])))
    data = TrainingData.open(Path(spec["training_data"]))
    generator = torch.Generator().manual_seed(0)
    samples = []
    for split in SPLITS:
        for path in data.shard_files(split):
            for ids, mask in zip(read_column(path, "input_ids"), read_column(path, "loss_mask"), strict=True):
                length = len(ids)
                samples.append(
                    Sample(
                        idx=len(samples),
                        sample_id="",
                        dataset="",
                        split=split,
                        input_ids=torch.tensor(ids, dtype=torch.int64),
                        loss_mask=torch.tensor(mask, dtype=torch.int64),
                        aux=torch.randn(length, layers * hidden, generator=generator),
                        hidden=torch.randn(length, hidden, generator=generator),
                    )
                )
    write_specforge(Path(output_dir), samples)
    print(f"wrote {len(samples)} samples to {output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
