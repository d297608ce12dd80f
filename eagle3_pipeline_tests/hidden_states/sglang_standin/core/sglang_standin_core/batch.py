"""The request and batch steps both releases share (``managers.schedule_batch``,
``model_executor.forward_batch_info``); a release's ``Req`` names the fill length its own way
(``fill_field``)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, ClassVar


class ReqBase:
    """A request: its ids, and what the scheduler's steps set before a prefill."""

    fill_field: ClassVar[str]  # the field admission sets to prefix + extend length

    def __init__(self, rid: str, origin_input_text: str, origin_input_ids: array, sampling_params: Any) -> None:
        self.rid = rid
        self.origin_input_text = origin_input_text
        self.origin_input_ids = origin_input_ids
        self.sampling_params = sampling_params
        self.prefix_indices: list[int] = []
        self.full_untruncated_fill_ids = array("q")
        self.extend_input_len = 0

    def init_next_round_input(self, tree_cache: Any = None) -> None:
        self.full_untruncated_fill_ids = array("q", self.origin_input_ids)
        if tree_cache is not None:
            self.prefix_indices = tree_cache.match_prefix(self.full_untruncated_fill_ids)
        self.extend_input_len = len(self.full_untruncated_fill_ids) - len(self.prefix_indices)

    def fill_end(self) -> int:
        end = getattr(self, self.fill_field)
        if end is None or end - len(self.prefix_indices) != self.extend_input_len:
            raise AssertionError(
                f"request {self.rid}: {self.fill_field} {end} != prefix {len(self.prefix_indices)} "
                f"+ extend {self.extend_input_len}"
            )
        return int(end)


class ScheduleBatch:
    """A batch of requests prepared for one extend (prefill) pass on the CPU."""

    def __init__(
        self,
        reqs: list[Any],
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
        reqs: list[Any],
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

        ends = [req.fill_end() for req in self.reqs]
        self.req_to_token_pool.alloc(len(self.reqs))
        self.token_to_kv_pool_allocator.alloc(sum(req.extend_input_len for req in self.reqs))
        self.prefix_lens = [len(req.prefix_indices) for req in self.reqs]
        self.extend_lens = [req.extend_input_len for req in self.reqs]
        fill = [
            req.full_untruncated_fill_ids[len(req.prefix_indices) : end]
            for req, end in zip(self.reqs, ends, strict=True)
        ]
        self.prefill_input_ids_cpu = torch.tensor([token for ids in fill for token in ids], dtype=torch.int64)
        self.input_ids = None


@dataclass
class ForwardBatchBase:
    input_ids: Any
    positions: Any
    extend_seq_lens: list[int]

    @classmethod
    def from_batch(cls, batch: Any) -> Any:
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
