"""Stand-in for ``sglang.srt.model_executor.forward_batch_info`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any

from sglang_standin_core.batch import ForwardBatchBase


class ForwardBatch(ForwardBatchBase):
    @classmethod
    def init_new(
        cls, batch: Any, model_runner: Any, *, capture_hidden_mode: Any = None, return_hidden_states_before_norm: bool
    ) -> ForwardBatch:
        if return_hidden_states_before_norm:
            raise RuntimeError("stand-in: the LogitsProcessor is handed the final norm's output here")
        return cls.from_batch(batch)
