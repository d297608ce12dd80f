"""Hidden states from SGLang's own model runner, in process, with tensor parallelism: the state
source of ``hidden_states.backend: sglang`` (:func:`open_sglang_target`).

For a target only SGLang can hold (Kimi-K2.5 INT4 at tensor parallelism 8). SGLang's HTTP
``return_hidden_states`` gives only the final state and misaligns prompt rows under the radix cache
and chunked prefill; SpecForge's ``prepare_hidden_states.py`` re-tokenizes the conversations. Here
SGLang runs our ``input_ids`` and nothing else, and the `extract` loop writes our store.

Each of the ``hidden_states.tp_size`` ranks of a torchrun launch (one GPU each, the worker started
with ``hidden_states.sglang_python``; :func:`eagle3_pipeline.compute.worker_argv`):

1. joins torch.distributed (NCCL, torchrun's ``env://``; one process: a world of one). SGLang's
   ``init_distributed_environment`` then keeps that world instead of opening its own, so the
   runner's ``nccl_port`` is not used;
2. builds ``ServerArgs`` with the radix cache off, no chunked prefill and no CUDA graphs (every
   token of a request in one extend pass, eagerly), ``ModelConfig.from_server_args``, the
   ``ModelRunner``, then ``alloc_memory_pool``, ``init_attention_backends`` and ``init_cuda_graphs``
   (with graphs off it builds the eager runner the forward goes through);
3. turns on EAGLE-3 aux capture with the model's own ``set_eagle3_layers_to_capture``, given the ids
   :func:`eagle3_pipeline.layer_ids.server_layer_ids` writes for SGLang for this target's family
   (Llama-like: SGLang adds 1 to every id; DeepSeek-V3/Kimi: only when the first id is 1), and
   checks that the model's ``layers_to_capture`` are then the inputs of layers ``id + 1`` — the
   outputs of our output-of-layer ids — before anything is extracted;
4. per batch: one ``Req`` per sample built from our ids (``origin_input_ids``; no text, no
   tokenizer), the scheduler's own steps for a new request with the radix cache off
   (``init_next_round_input`` on a ``ChunkCache``, ``fill_len`` as admission sets it),
   ``ScheduleBatch.init_new`` + ``prepare_for_extend``, the ids moved to the GPU as the scheduler's
   input step does, ``ForwardBatch.init_new``, ``ModelRunner.forward``. The states are read where
   the model hands them to its ``LogitsProcessor`` (a forward pre-hook): ``hidden_states`` [N, H],
   the final norm's output (the teacher), and ``aux_hidden_states``, the residual streams entering
   the captured layers, [N, H] each; N is the batch's tokens packed in request order, split back by
   length. The processor itself runs as in serving (next-token logits of each request's last token
   only). The request and KV pools are cleared after every forward.

Every rank computes every batch (tensor parallelism); rank 0 alone writes (``writer``) and hands its
decisions to the others (:meth:`SGLangTarget.share`).

**Version.** Written against sglang **0.5.14** (:data:`SGLANG_VERSION`), and refuses another: it is
the release SpecForge 0.2.0 pins (``sglang==0.5.14``, with torch 2.11) for the same in-process
capture (``specforge/offline_capture/sglang_backend``), so a host set up for SpecForge's DeepSeek-V3 /
Kimi recipes has it, and the per-family layer-id rules of :mod:`eagle3_pipeline.layer_ids` were read
from it. PyPI's newest is 0.5.23; moving to it means re-reading these entry points
(``eagle3_pipeline_tests/hidden_states/test_sglang_signatures.py`` checks them against any wheel).

**One list of names.** Every SGLang module, class, method, attribute and keyword this module
touches is an entry of :data:`SGLANG_USES`, and it reaches SGLang only through :class:`SGLangApi`,
which refuses a name, a keyword or a positional count not listed there. The signature test checks
each entry against the pinned wheel's source; the stand-in the tests run the worker on implements
the same entries.

sglang and torch are imported inside the functions that use them.
"""

from __future__ import annotations

import importlib
import inspect
import os
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from eagle3_pipeline.hidden_states.capture import TargetLoadError, target_identity
from eagle3_pipeline.hidden_states.store import TargetIdentity
from eagle3_pipeline.layer_ids import server_layer_ids, target_family
from eagle3_pipeline.target import read_config

SGLANG_VERSION = "0.5.14"
PYTHON_SETTING = "hidden_states.sglang_python"


@dataclass(frozen=True)
class SGLangUse:
    """One SGLang name the worker uses. ``name``: ``Class``, ``Class.member`` or a module-level
    ``attribute``. ``keywords``: the parameters the worker passes by name (for
    ``LogitsProcessor.forward``: the ones it reads by name from the model's call); ``positional``:
    how many it passes by position (after ``self``/``cls``)."""

    module: str
    name: str
    kind: Literal["class", "method", "attribute"]
    keywords: tuple[str, ...] = ()
    positional: int = 0


_SRT = "sglang.srt"
SGLANG_USES: tuple[SGLangUse, ...] = (
    SGLangUse("sglang.version", "__version__", "attribute"),
    SGLangUse(
        f"{_SRT}.server_args",
        "ServerArgs",
        "class",
        keywords=(
            "model_path",
            "trust_remote_code",
            "dtype",
            "tp_size",
            "mem_fraction_static",
            "max_running_requests",
            "disable_radix_cache",
            "chunked_prefill_size",
            "disable_cuda_graph",
        ),
    ),
    SGLangUse(f"{_SRT}.server_args", "ServerArgs.ep_size", "attribute"),
    SGLangUse(f"{_SRT}.server_args", "ServerArgs.page_size", "attribute"),
    SGLangUse(f"{_SRT}.server_args", "ServerArgs.device", "attribute"),
    SGLangUse(f"{_SRT}.configs.model_config", "ModelConfig", "class"),
    SGLangUse(f"{_SRT}.configs.model_config", "ModelConfig.from_server_args", "method", keywords=("server_args",)),
    SGLangUse(
        f"{_SRT}.model_executor.model_runner",
        "ModelRunner",
        "class",
        keywords=(
            "model_config",
            "mem_fraction_static",
            "gpu_id",
            "tp_rank",
            "tp_size",
            "moe_ep_rank",
            "moe_ep_size",
            "pp_rank",
            "pp_size",
            "nccl_port",
            "server_args",
        ),
    ),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.alloc_memory_pool", "method"),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.init_attention_backends", "method"),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.init_cuda_graphs", "method"),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.forward", "method", keywords=("forward_batch",)),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.model", "attribute"),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.model_config", "attribute"),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.req_to_token_pool", "attribute"),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.token_to_kv_pool_allocator", "attribute"),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.max_total_num_tokens", "attribute"),
    SGLangUse(f"{_SRT}.model_executor.model_runner", "ModelRunner.max_running_requests", "attribute"),
    SGLangUse(f"{_SRT}.mem_cache.memory_pool", "ReqToTokenPool.clear", "method"),
    SGLangUse(f"{_SRT}.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.clear", "method"),
    SGLangUse(f"{_SRT}.models.llama", "LlamaForCausalLM.set_eagle3_layers_to_capture", "method", positional=1),
    SGLangUse(f"{_SRT}.models.llama", "LlamaModel.layers_to_capture", "attribute"),
    SGLangUse(
        f"{_SRT}.models.deepseek_v2", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture", "method", positional=1
    ),
    SGLangUse(f"{_SRT}.models.deepseek_v2", "DeepseekV2Model.layers_to_capture", "attribute"),
    SGLangUse(
        f"{_SRT}.models.kimi_k25",
        "KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture",
        "method",
        positional=1,
    ),
    SGLangUse(f"{_SRT}.layers.logits_processor", "LogitsProcessor", "class"),
    SGLangUse(
        f"{_SRT}.layers.logits_processor",
        "LogitsProcessor.forward",
        "method",
        keywords=("hidden_states", "aux_hidden_states"),
    ),
    SGLangUse(
        f"{_SRT}.sampling.sampling_params",
        "SamplingParams",
        "class",
        keywords=("max_new_tokens", "temperature", "top_k"),
    ),
    SGLangUse(
        f"{_SRT}.managers.schedule_batch",
        "Req",
        "class",
        keywords=("rid", "origin_input_text", "origin_input_ids", "sampling_params"),
    ),
    SGLangUse(f"{_SRT}.managers.schedule_batch", "Req.init_next_round_input", "method", keywords=("tree_cache",)),
    SGLangUse(f"{_SRT}.managers.schedule_batch", "Req.fill_len", "attribute"),
    SGLangUse(f"{_SRT}.managers.schedule_batch", "ScheduleBatch", "class"),
    SGLangUse(
        f"{_SRT}.managers.schedule_batch",
        "ScheduleBatch.init_new",
        "method",
        keywords=(
            "reqs",
            "req_to_token_pool",
            "token_to_kv_pool_allocator",
            "tree_cache",
            "model_config",
            "enable_overlap",
            "spec_algorithm",
        ),
    ),
    SGLangUse(f"{_SRT}.managers.schedule_batch", "ScheduleBatch.prepare_for_extend", "method"),
    SGLangUse(f"{_SRT}.managers.schedule_batch", "ScheduleBatch.prefill_input_ids_cpu", "attribute"),
    SGLangUse(f"{_SRT}.managers.schedule_batch", "ScheduleBatch.input_ids", "attribute"),
    SGLangUse(f"{_SRT}.managers.schedule_batch", "ScheduleBatch.device", "attribute"),
    SGLangUse(
        f"{_SRT}.mem_cache.cache_init_params",
        "CacheInitParams",
        "class",
        keywords=("disable", "req_to_token_pool", "token_to_kv_pool_allocator", "page_size"),
    ),
    SGLangUse(f"{_SRT}.mem_cache.chunk_cache", "ChunkCache", "class", keywords=("params",)),
    SGLangUse(f"{_SRT}.speculative.spec_info", "SpeculativeAlgorithm", "class"),
    SGLangUse(f"{_SRT}.speculative.spec_info", "SpeculativeAlgorithm.NONE", "attribute"),
    SGLangUse(f"{_SRT}.model_executor.forward_batch_info", "ForwardBatch", "class"),
    SGLangUse(
        f"{_SRT}.model_executor.forward_batch_info",
        "ForwardBatch.init_new",
        "method",
        keywords=("batch", "model_runner"),
    ),
)


class SGLangError(TargetLoadError):
    """SGLang cannot run the extraction as set up; the message names the setting to change."""


class SGLangApi:
    """SGLang reached only through :data:`SGLANG_USES`: a name, keyword or positional count the
    worker uses that is not listed there is an error (the stand-in tests run every path, so the
    list cannot fall behind the code)."""

    def __init__(self) -> None:
        self._uses = {use.name: use for use in SGLANG_USES}
        try:
            found = self.value("__version__")
        except ImportError as exc:
            raise SGLangError(
                f"{PYTHON_SETTING}: cannot import sglang here ({exc}); expected the python of a venv with "
                f"sglang=={SGLANG_VERSION} and this package"
            ) from None
        if found != SGLANG_VERSION:
            raise SGLangError(
                f"{PYTHON_SETTING}: this python has sglang {found}; the worker is written against "
                f"sglang=={SGLANG_VERSION} (eagle3_pipeline.hidden_states.sglang_capture): "
                "install that version in the venv"
            )

    def _use(self, name: str, kind: str) -> SGLangUse:
        use = self._uses.get(name)
        if use is None or use.kind != kind:
            raise SGLangError(
                f"{name}: not an SGLang {kind} of SGLANG_USES (the names checked against sglang {SGLANG_VERSION})"
            )
        return use

    def _member(self, owner: Any, member: str, kind: str) -> SGLangUse:
        """The entry ``Class.member`` of the first class in ``owner``'s MRO (``owner``: an instance or a class)."""
        classes = owner.__mro__ if isinstance(owner, type) else type(owner).__mro__
        for cls in classes:
            use = self._uses.get(f"{cls.__name__}.{member}")
            if use is not None and use.kind == kind:
                return use
        listed = sorted(name for name, use in self._uses.items() if use.kind == kind and name.endswith(f".{member}"))
        raise SGLangError(
            f"SGLang {classes[0].__name__}.{member}: not in SGLANG_USES (checked against sglang {SGLANG_VERSION}: "
            f"{', '.join(listed) or 'none'})"
        )

    @staticmethod
    def _check_call(use: SGLangUse, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        unknown = sorted(set(kwargs) - set(use.keywords))
        if unknown or len(args) != use.positional:
            raise SGLangError(
                f"{use.module}.{use.name}: called with {len(args)} positional argument(s) and keyword(s) "
                f"{sorted(kwargs)}; SGLANG_USES lists {use.positional} and {list(use.keywords)}"
            )

    def value(self, name: str) -> Any:
        use = self._use(name, "attribute")
        return getattr(importlib.import_module(use.module), name)

    def cls(self, name: str) -> type:
        use = self._use(name, "class")
        found: type = getattr(importlib.import_module(use.module), name)
        return found

    def new(self, name: str, **kwargs: Any) -> Any:
        use = self._use(name, "class")
        self._check_call(use, (), kwargs)
        return self.cls(name)(**kwargs)

    def call(self, owner: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        use = self._member(owner, method, "method")
        self._check_call(use, args, kwargs)
        return getattr(owner, method)(*args, **kwargs)

    def parameters(self, owner: Any, method: str) -> tuple[str, ...]:
        """The parameters of ``owner.method`` the worker reads by name."""
        return self._member(owner, method, "method").keywords

    def get(self, owner: Any, attribute: str) -> Any:
        self._member(owner, attribute, "attribute")
        return getattr(owner, attribute)

    def put(self, owner: Any, attribute: str, value: Any) -> None:
        self._member(owner, attribute, "attribute")
        setattr(owner, attribute, value)


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    joined_here: bool


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
        self,
        api: SGLangApi,
        runner: Any,
        server_args: Any,
        identity: TargetIdentity,
        family: str,
        ranks: Ranks,
        dtype: str,
    ) -> None:
        self.api = api
        self.runner = runner
        self.server_args = server_args
        self.identity = identity
        self.family = family
        self.ranks = ranks
        self.dtype = dtype
        self.device = str(api.get(server_args, "device"))
        self._layers: list[int] | None = None
        self._record: dict[str, Any] = {}
        self._forwards = 0

    @property
    def writer(self) -> bool:
        return self.ranks.rank == 0

    def describe(self) -> str:
        return f"SGLang {SGLANG_VERSION} ModelRunner, tensor parallelism {self.ranks.world}, dtype {self.dtype}"

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
                f"the inputs of {expected}: the {self.family!r} family rule of eagle3_pipeline.layer_ids "
                "does not hold for this model class"
            )
        self._layers = wanted
        self._record = {
            "backend": "sglang",
            "sglang_version": SGLANG_VERSION,
            "tp_size": self.ranks.world,
            "device": self.device,
            "dtype": self.dtype,
            "model_class": type(model).__name__,
            "family": self.family,
            "family_rule": "id + 1 for every id" if self.family == "llama" else "id + 1 only when the first id is 1",
            "set_eagle3_layers_to_capture": written,
            "layers_to_capture": captured,
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
        import torch

        self._capture_layers(aux_layer_ids)
        lengths = [len(s) for s in sequences]
        self._check_fits(lengths)
        caught = self._forward(sequences)
        hidden, aux = caught["hidden_states"], caught["aux_hidden_states"]
        if aux is None or len(aux) != len(aux_layer_ids):
            raise SGLangError(
                f"SGLang handed its LogitsProcessor {0 if aux is None else len(aux)} captured "
                f"layer(s), expected {len(aux_layer_ids)}"
            )
        total = sum(lengths)
        shapes = [tuple(t.shape) for t in (hidden, *aux)]
        if any(shape[0] != total for shape in shapes):
            raise SGLangError(
                f"SGLang returned states of shapes {shapes} for a batch of {total} tokens; expected {total} rows each "
                "(states scattered across ranks: data-parallel attention is not supported)"
            )
        joined = torch.cat(list(aux), dim=-1)
        return list(zip(joined.split(lengths), hidden.split(lengths), strict=True))

    def reference_states(self, aux_layer_ids: Sequence[int], sequence: Sequence[int]) -> tuple[Any, Any]:
        [states] = self.batch_states(aux_layer_ids, [sequence])
        return states

    def _forward(self, sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
        """One extend pass of ``sequences`` as new requests, as the scheduler runs a prefill batch."""
        import torch

        api, runner = self.api, self.runner
        requests_pool = api.get(runner, "req_to_token_pool")
        tokens_pool = api.get(runner, "token_to_kv_pool_allocator")
        params = api.new(
            "CacheInitParams",
            disable=True,
            req_to_token_pool=requests_pool,
            token_to_kv_pool_allocator=tokens_pool,
            page_size=api.get(self.server_args, "page_size"),
        )
        cache = api.new("ChunkCache", params=params)
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
            api.put(req, "fill_len", len(sequence))
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
            forward_batch = api.call(api.cls("ForwardBatch"), "init_new", batch=batch, model_runner=runner)
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
        server_args = api.new(
            "ServerArgs",
            model_path=model,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            tp_size=tp_size,
            mem_fraction_static=mem_fraction_static,
            max_running_requests=max_batch_size,
            disable_radix_cache=True,
            chunked_prefill_size=-1,
            disable_cuda_graph=True,
        )
        model_config = api.call(api.cls("ModelConfig"), "from_server_args", server_args=server_args)
        experts = int(api.get(server_args, "ep_size"))
        runner = api.new(
            "ModelRunner",
            model_config=model_config,
            mem_fraction_static=mem_fraction_static,
            gpu_id=ranks.local_rank,
            tp_rank=ranks.rank,
            tp_size=tp_size,
            moe_ep_rank=ranks.rank // (tp_size // experts),
            moe_ep_size=experts,
            pp_rank=0,
            pp_size=1,
            nccl_port=0,
            server_args=server_args,
        )
        api.call(runner, "alloc_memory_pool")
        api.call(runner, "init_attention_backends")
        api.call(runner, "init_cuda_graphs")
        yield SGLangTarget(api, runner, server_args, identity, family, ranks, dtype)
    finally:
        if ranks.joined_here:
            dist.destroy_process_group()
