"""Stand-in for ``sglang.srt.managers.schedule_batch`` (see the sglang package docstring)."""

from __future__ import annotations

from array import array
from typing import Any


class Req:
    """A request: its ids, and what the scheduler's steps set before a prefill."""

    def __init__(self, rid: str, origin_input_text: str, origin_input_ids: array, sampling_params: Any) -> None:
        self.rid = rid
        self.origin_input_text = origin_input_text
        self.origin_input_ids = origin_input_ids
        self.sampling_params = sampling_params
        self.prefix_indices: list[int] = []
        self.full_untruncated_fill_ids = array("q")
        self.extend_input_len = 0
        self.fill_len = 0

    def init_next_round_input(self, tree_cache: Any = None) -> None:
        self.full_untruncated_fill_ids = array("q", self.origin_input_ids)
        if tree_cache is not None:
            self.prefix_indices = tree_cache.match_prefix(self.full_untruncated_fill_ids)
        self.extend_input_len = len(self.full_untruncated_fill_ids) - len(self.prefix_indices)


class ScheduleBatch:
    """A batch of requests prepared for one extend (prefill) pass on the CPU."""

    def __init__(
        self,
        reqs: list[Req],
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tree_cache: Any,
        model_config: Any,
        spec_algorithm: Any,
    ) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.model_config = model_config
        self.spec_algorithm = spec_algorithm
        self.device = "cpu"
        self.input_ids: Any = None
        self.prefill_input_ids_cpu: Any = None
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []

    @classmethod
    def init_new(
        cls,
        reqs: list[Req],
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tree_cache: Any,
        model_config: Any,
        enable_overlap: bool,
        spec_algorithm: Any,
    ) -> ScheduleBatch:
        if enable_overlap:
            raise RuntimeError("stand-in: the overlap scheduler is not part of an in-process forward")
        return cls(reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, model_config, spec_algorithm)

    def prepare_for_extend(self) -> None:
        import torch

        for req in self.reqs:
            if req.fill_len - len(req.prefix_indices) != req.extend_input_len:
                raise AssertionError(
                    f"request {req.rid}: fill_len {req.fill_len} != prefix {len(req.prefix_indices)} "
                    f"+ extend {req.extend_input_len}"
                )
        self.req_to_token_pool.alloc(len(self.reqs))
        self.token_to_kv_pool_allocator.alloc(sum(req.extend_input_len for req in self.reqs))
        self.prefix_lens = [len(req.prefix_indices) for req in self.reqs]
        self.extend_lens = [req.extend_input_len for req in self.reqs]
        fill = [req.full_untruncated_fill_ids[len(req.prefix_indices) : req.fill_len] for req in self.reqs]
        self.prefill_input_ids_cpu = torch.tensor([token for ids in fill for token in ids], dtype=torch.int64)
        self.input_ids = None
