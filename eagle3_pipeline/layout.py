"""Where each phase keeps its outputs under the artifacts root."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ArtifactLayout:
    root: Path

    def prompts(self, dataset_id: str) -> Path:
        return self.root / "prompts" / f"{dataset_id}.parquet"

    def responses(self, dataset_id: str) -> Path:
        return self.root / "responses" / f"{dataset_id}.parquet"

    def checkpoint(self, dataset_id: str) -> Path:
        return self.root / "responses" / f"{dataset_id}.checkpoint.jsonl"

    def errors(self, dataset_id: str) -> Path:
        return self.root / "responses" / f"{dataset_id}.errors.jsonl"

    def fingerprint(self, dataset_id: str) -> Path:
        """What produced the dataset's checkpoint (written before its first answer)."""
        return self.root / "responses" / f"{dataset_id}.fingerprint.json"

    def accounting(self, dataset_id: str) -> Path:
        """Why prompts of the last run have no answer in the table (over length, held back by the budget)."""
        return self.root / "responses" / f"{dataset_id}.accounting.json"

    def failover(self, dataset_id: str) -> Path:
        """The decisions of `generation.failover` to move the dataset to another backend, one JSON line each."""
        return self.root / "responses" / f"{dataset_id}.failover.jsonl"

    def previous_responses(self, dataset_id: str, version: str) -> Path:
        """Where a dataset's answers made under an earlier fingerprint are kept aside."""
        return self.root / "responses" / "previous" / f"{dataset_id}.{version}"

    def response_files(self, dataset_id: str) -> list[Path]:
        """Every file the responses phase keeps for one dataset."""
        return [
            self.checkpoint(dataset_id),
            self.errors(dataset_id),
            self.fingerprint(dataset_id),
            self.accounting(dataset_id),
            self.failover(dataset_id),
            self.responses(dataset_id),
        ]

    @property
    def training_data(self) -> Path:
        return self.root / "training_data"

    @property
    def training_data_record(self) -> Path:
        """What the last finished training_data run was made from and reported (beside the folder, which
        a rebuild replaces whole): a rerun with the same inputs and settings reuses it."""
        return self.root / "training_data.phase.json"

    @property
    def drafter_benchmark(self) -> Path:
        """The online benchmark's result with what produced it (drafter, prompts, settings)."""
        return self.root / "drafter_benchmark.json"

    @property
    def served_drafter(self) -> Path:
        """The drafter the managed server serves, the one it served before, and their launch lines."""
        return self.root / "served_drafter.json"

    @property
    def serving_reference(self) -> Path:
        """The serving target's answers for hidden_states' validation (beside training_data: a
        rebuilt training_data folder is replaced whole; the file names the version it is for)."""
        return self.root / "serving_reference.json"

    @property
    def draft_vocab(self) -> Path:
        return self.root / "draft_vocab"

    @property
    def hidden_states(self) -> Path:
        return self.root / "hidden_states"

    @property
    def server_log(self) -> Path:
        return self.root / "logs" / "embedded-server.log"
