"""Stand-in for ``sglang.srt.model_executor.forward_batch_info`` (see the sglang package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardBatch:
    input_ids: Any
    positions: Any
    extend_seq_lens: list[int]

    @classmethod
    def init_new(cls, batch: Any, model_runner: Any) -> ForwardBatch:
        import torch

        if batch.input_ids is None:
            raise RuntimeError(
                "ForwardBatch.init_new: batch.input_ids is None (the ids were not moved from prefill_input_ids_cpu)"
            )
        positions = torch.cat(
            [
                torch.arange(start, start + length)
                for start, length in zip(batch.prefix_lens, batch.extend_lens, strict=True)
            ]
        )
        return cls(input_ids=batch.input_ids, positions=positions, extend_seq_lens=list(batch.extend_lens))
