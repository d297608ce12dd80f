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

    @property
    def training_data(self) -> Path:
        return self.root / "training_data"

    @property
    def draft_vocab(self) -> Path:
        return self.root / "draft_vocab"

    @property
    def hidden_states(self) -> Path:
        return self.root / "hidden_states"

    @property
    def server_log(self) -> Path:
        return self.root / "logs" / "embedded-server.log"
