"""The names one pipeline's definitions take in a code location: asset keys, check keys, job,
sensor and resource names.

A code location may hold several pipelines (several `Eagle3Pipeline` instances in its defs folder).
Dagster's names are global to it, so every pipeline but one takes a prefix: its asset keys gain the
prefix as their first path component (`other/prompts`), its jobs, sensors and resource keys the
prefix and two underscores (`other__generation_job`), and so do its asset groups (`other__data`), so
the UI shows each pipeline's groups apart. The pipeline without a prefix keeps the plain
names (`prompts`, `generation_job`, the resource `pipeline`), which the CLI and the UI use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import dagster as dg

PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True)
class PipelineNames:
    """Every name of one pipeline's definitions, from its prefix (None: the plain names)."""

    prefix: str | None = None

    def __post_init__(self) -> None:
        if self.prefix is not None and not PREFIX_PATTERN.match(self.prefix):
            raise ValueError(
                f"key_prefix: expected letters, digits and underscores (a Dagster name), got {self.prefix!r}"
            )

    @classmethod
    def of_key(cls, key: dg.AssetKey) -> PipelineNames:
        """The names of the pipeline that asset `key` belongs to (its first path component, when prefixed)."""
        return cls(key.path[0] if len(key.path) > 1 else None)

    @property
    def key_prefix(self) -> list[str] | None:
        """The `key_prefix` of this pipeline's asset decorators."""
        return [self.prefix] if self.prefix else None

    def key(self, asset: str) -> dg.AssetKey:
        """The key of asset `asset` (e.g. `responses`) of this pipeline."""
        return dg.AssetKey([self.prefix, asset]) if self.prefix else dg.AssetKey(asset)

    def check(self, asset: str, check: str) -> dg.AssetCheckKey:
        """The key of check `check` on asset `asset` of this pipeline."""
        return dg.AssetCheckKey(self.key(asset), check)

    def name(self, base: str) -> str:
        """A job, sensor, resource or asset group name of this pipeline (e.g. `generation_job`, `pipeline`,
        `data`)."""
        return f"{self.prefix}__{base}" if self.prefix else base

    @property
    def generation_job(self) -> str:
        return self.name("generation_job")

    @property
    def pipeline(self) -> str:
        """The key of the pipeline's settings resource
        (:class:`~eagle3_pipeline.components.resources.PipelineResource`)."""
        return self.name("pipeline")

    @property
    def inference(self) -> str:
        return self.name("inference")

    @property
    def phase_listener(self) -> str:
        return self.name("phase_listener")

    @property
    def pipes_subprocess_client(self) -> str:
        return self.name("pipes_subprocess_client")


DEFAULT_NAMES = PipelineNames()
