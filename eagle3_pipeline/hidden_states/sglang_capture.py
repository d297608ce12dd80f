"""Hidden states from SGLang's own model runner, in process, with tensor parallelism: the state
source of ``hidden_states.backend: sglang`` (:func:`open_sglang_target`), for a target only SGLang can
hold (Kimi-K2.5 INT4 at tensor parallelism 8).

SGLang runs our ``input_ids`` and nothing else (no text, no tokenizer, radix cache and chunked
prefill off, no CUDA graphs); the states are read where the model hands them to its
``LogitsProcessor``, and the EAGLE-3 aux layers SGLang captures are checked to be ours before
anything is extracted. Every rank of the torchrun launch computes every batch; rank 0 alone writes.
SGLang is reached only through :class:`.sglang_api.SGLangApi`. The steps and why: hidden_states/DESIGN.md
"SGLang capture". sglang and torch are imported inside the functions that use them.
"""

from __future__ import annotations

import inspect
import os
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from eagle3_pipeline.hidden_states.capture import target_identity
from eagle3_pipeline.hidden_states.sglang_api import Ranks, SGLangApi, SGLangError, Started
from eagle3_pipeline.hidden_states.store import TargetIdentity
from eagle3_pipeline.target.folder import read_config
from eagle3_pipeline.target.layer_ids import server_layer_ids, target_family


def _join(tp_size: int) -> Ranks:
    """This process's place among the tensor-parallel ranks; joins torch.distributed (NCCL with
    CUDA, gloo without) through torchrun's environment, or as a world of one."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp_size:
        raise SGLangError(
            f"hidden_states.tp_size is {tp_size} but this launch has {world} process(es): the worker runs under "
            f"torchrun with --nproc_per_node tp_size (eagle3_pipeline.compute.worker_argv)"
        )
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if dist.is_initialized():
        return Ranks(rank, world, local_rank, joined_here=False)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world > 1:
        dist.init_process_group(backend)
    else:
        # torch.distributed documents HashStore but imports it from torch._C without re-exporting it.
        store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return Ranks(rank, world, local_rank, joined_here=True)


@contextmanager
def _reading_logits_processor_inputs(api: SGLangApi, model: Any) -> Iterator[dict[str, Any]]:
    """What the model hands its one ``LogitsProcessor`` in each forward, by parameter name."""
    processor_class = api.cls("LogitsProcessor")
    processors = [module for module in model.modules() if isinstance(module, processor_class)]
    if len(processors) != 1:
        raise SGLangError(f"SGLang {type(model).__name__}: expected one LogitsProcessor, found {len(processors)}")
    [processor] = processors
    names = api.parameters(processor, "forward")
    signature = inspect.signature(type(processor).forward)
    caught: dict[str, Any] = {}

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        bound = signature.bind(module, *args, **kwargs)
        caught.update({name: bound.arguments.get(name) for name in names})

    handle = processor.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield caught
    finally:
        handle.remove()


class SGLangTarget:
    """SGLang's model runner as a state source of the `extract` loop
    (:class:`eagle3_pipeline.hidden_states.extract.StateSource`)."""

    spot_check_method = "alone (one request per forward) through the same SGLang runner"

    def __init__(
        self, api: SGLangApi, started: Started, identity: TargetIdentity, family: str, ranks: Ranks, dtype: str
    ) -> None:
        self.api = api
        self.release = api.release
        self.started = started
        self.runner = started.runner
        self.identity = identity
        self.family = family
        self.ranks = ranks
        self.dtype = dtype
        self.device = started.device
        self._layers: list[int] | None = None
        self._decoder: type | None = None
        self._record: dict[str, Any] = {}
        self._forwards = 0

    @property
    def writer(self) -> bool:
        return self.ranks.rank == 0

    def describe(self) -> str:
        return f"SGLang {self.release.version} ModelRunner, tensor parallelism {self.ranks.world}, dtype {self.dtype}"

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.ranks.world == 1:
            return value
        import torch.distributed as dist

        holder = [value if self.writer else None]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def _capture_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Turn on SGLang's EAGLE-3 capture for our output-of-layer ids, once; check what it captures."""
        wanted = [int(i) for i in aux_layer_ids]
        if self._layers == wanted:
            return
        model = self.api.get(self.runner, "model")
        written = server_layer_ids(self.family, wanted).sglang
        self.api.call(model, "set_eagle3_layers_to_capture", written)
        holders = [module for module in model.modules() if hasattr(module, "layers_to_capture")]
        if len(holders) != 1:
            raise SGLangError(
                f"SGLang {type(model).__name__}: expected one decoder holding layers_to_capture, found {len(holders)}"
            )
        captured = [int(i) for i in self.api.get(holders[0], "layers_to_capture")]
        expected = [i + 1 for i in wanted]
        if captured != expected:
            raise SGLangError(
                f"SGLang {type(model).__name__}.set_eagle3_layers_to_capture({written}) captures the inputs "
                f"of layers {captured}; hidden_states.aux_layer_ids {wanted} (outputs of those layers) need "
                f"the inputs of {expected}: the {self.family!r} family rule of eagle3_pipeline.target.layer_ids "
                "does not hold for this model class"
            )
        self._layers = wanted
        self._decoder = type(holders[0])
        self._record = {
            "backend": "sglang",
            "sglang_version": self.release.version,
            "tp_size": self.ranks.world,
            "device": self.device,
            "dtype": self.dtype,
            "model_class": type(model).__name__,
            "family": self.family,
            "family_rule": "id + 1 for every id" if self.family == "llama" else "id + 1 only when the first id is 1",
            "set_eagle3_layers_to_capture": written,
            "layers_to_capture": captured,
            "aux_form": self.release.aux_form(self._decoder),
        }

    def capture(self, aux_layer_ids: Sequence[int]) -> dict[str, Any]:
        """How the states are captured, for the store's manifest."""
        self._capture_layers(aux_layer_ids)
        return dict(self._record)

    def _check_fits(self, lengths: Sequence[int]) -> None:
        pool = int(self.api.get(self.runner, "max_total_num_tokens"))
        slots = int(self.api.get(self.runner, "max_running_requests"))
        if sum(lengths) > pool:
            raise SGLangError(
                f"a batch of {sum(lengths)} tokens ({len(lengths)} samples, the longest {max(lengths)}) does not fit "
                f"SGLang's KV pool of {pool} tokens: lower hidden_states.batch_tokens or raise "
                "hidden_states.mem_fraction_static"
            )
        if len(lengths) > slots:
            raise SGLangError(
                f"a batch of {len(lengths)} samples exceeds SGLang's {slots} request slots: "
                "lower hidden_states.max_batch_size"
            )

    def batch_states(self, aux_layer_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[tuple[Any, Any]]:
        """``(aux [T, 3H], hidden [T, H])`` per sequence from one extend pass of the packed batch."""
        self._capture_layers(aux_layer_ids)
        lengths = [len(s) for s in sequences]
        self._check_fits(lengths)
        caught = self._forward(sequences)
        hidden, aux = caught["hidden_states"], caught["aux_hidden_states"]
        total = sum(lengths)
        joined = self._joined(aux, len(aux_layer_ids), hidden)
        if hidden.shape[0] != total or joined.shape[0] != total:
            raise SGLangError(
                f"SGLang returned states of {hidden.shape[0]} and {joined.shape[0]} rows for a batch of {total} "
                "tokens; expected one row per token (states scattered across ranks: data-parallel attention is not "
                "supported)"
            )
        return list(zip(joined.split(lengths), hidden.split(lengths), strict=True))

    def _joined(self, aux: Any, layers: int, hidden: Any) -> Any:
        """The captured states as one [N, K·H] tensor, from the form this release's decoder hands over."""
        import torch

        assert self._decoder is not None  # _capture_layers ran
        form = self.release.aux_form(self._decoder)
        where = f"SGLang {self.release.version} {self._decoder.__name__}"
        size = layers * int(hidden.shape[-1])
        if form == "packed":
            if not isinstance(aux, torch.Tensor) or aux.dim() != 2 or aux.shape[-1] != size:
                shape = tuple(aux.shape) if isinstance(aux, torch.Tensor) else type(aux).__name__
                raise SGLangError(
                    f"{where} handed its LogitsProcessor aux states {shape}; its AuxForm is one packed [N, {size}] "
                    f"tensor ({layers} layers of {hidden.shape[-1]})"
                )
            return aux
        if isinstance(aux, torch.Tensor) or aux is None or len(aux) != layers:
            found = "none" if aux is None else (tuple(aux.shape) if isinstance(aux, torch.Tensor) else len(aux))
            raise SGLangError(
                f"{where} handed its LogitsProcessor aux states {found}; its AuxForm is a list of {layers} [N, "
                f"{hidden.shape[-1]}] tensors"
            )
        return torch.cat(list(aux), dim=-1)

    def reference_states(self, aux_layer_ids: Sequence[int], sequence: Sequence[int]) -> tuple[Any, Any]:
        [states] = self.batch_states(aux_layer_ids, [sequence])
        return states

    def _forward(self, sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
        """One extend pass of ``sequences`` as new requests, as the scheduler runs a prefill batch."""
        import torch

        api, runner = self.api, self.runner
        requests_pool = api.get(runner, "req_to_token_pool")
        tokens_pool = api.get(runner, "token_to_kv_pool_allocator")
        cache = self.release.prefix_cache(api, self.started)
        sampling = api.new("SamplingParams", max_new_tokens=1, temperature=0.0, top_k=1)
        self._forwards += 1
        reqs = []
        for index, sequence in enumerate(sequences):
            req = api.new(
                "Req",
                rid=f"extract-{self._forwards}-{index}",
                origin_input_text="",
                origin_input_ids=array("q", sequence),
                sampling_params=sampling,
            )
            api.call(req, "init_next_round_input", tree_cache=cache)
            api.put(req, self.release.fill_field, len(sequence))
            reqs.append(req)
        batch_class = api.cls("ScheduleBatch")
        batch = api.call(
            batch_class,
            "init_new",
            reqs=reqs,
            req_to_token_pool=requests_pool,
            token_to_kv_pool_allocator=tokens_pool,
            tree_cache=cache,
            model_config=api.get(runner, "model_config"),
            enable_overlap=False,
            spec_algorithm=api.get(api.cls("SpeculativeAlgorithm"), "NONE"),
        )
        try:
            api.call(batch, "prepare_for_extend")
            api.put(batch, "input_ids", api.get(batch, "prefill_input_ids_cpu").to(api.get(batch, "device")))
            api.put(batch, "prefill_input_ids_cpu", None)
            forward_batch = self.release.forward_batch(api, batch, runner)
            with torch.no_grad(), _reading_logits_processor_inputs(api, api.get(runner, "model")) as caught:
                api.call(runner, "forward", forward_batch=forward_batch)
        finally:
            api.call(requests_pool, "clear")
            api.call(tokens_pool, "clear")
        return caught


@contextmanager
def open_sglang_target(
    model: str,
    name: str,
    *,
    tp_size: int,
    dtype: str,
    mem_fraction_static: float,
    max_batch_size: int,
    trust_remote_code: bool,
) -> Iterator[SGLangTarget]:
    """SGLang's runner for ``model`` on this rank (module docstring, steps 1-2)."""
    import torch.distributed as dist

    api = SGLangApi()
    ranks = _join(tp_size)
    try:
        identity = target_identity(model, name)
        family = target_family(read_config(model))
        settings = {
            "model_path": model,
            "trust_remote_code": trust_remote_code,
            "dtype": dtype,
            "tp_size": tp_size,
            "mem_fraction_static": mem_fraction_static,
            "max_running_requests": max_batch_size,
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
            "disable_cuda_graph": True,
        }
        started = api.release.start(api, ranks, settings, mem_fraction_static)
        api.call(started.runner, "alloc_memory_pool")
        api.call(started.runner, "init_attention_backends")
        api.call(started.runner, "init_cuda_graphs")
        yield SGLangTarget(api, started, identity, family, ranks, dtype)
    finally:
        if ranks.joined_here:
            dist.destroy_process_group()
