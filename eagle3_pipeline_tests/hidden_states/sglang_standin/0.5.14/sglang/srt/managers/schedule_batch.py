"""Stand-in for ``sglang.srt.managers.schedule_batch`` (see the sglang package docstring)."""

from __future__ import annotations

from array import array
from typing import Any

from sglang_standin_core.batch import ReqBase, ScheduleBatch

__all__ = ["Req", "ScheduleBatch"]


class Req(ReqBase):
    """0.5.14: admission sets ``fill_len`` (prefix + extend length)."""

    fill_field = "fill_len"

    def __init__(self, rid: str, origin_input_text: str, origin_input_ids: array, sampling_params: Any) -> None:
        super().__init__(rid, origin_input_text, origin_input_ids, sampling_params)
        self.fill_len = 0
