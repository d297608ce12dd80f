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
   (with graphs off it builds the eager runner the forward goes through). How a release starts a
   runner differs (:class:`Release`);
3. turns on EAGLE-3 aux capture with the model's own ``set_eagle3_layers_to_capture``, given the ids
   :func:`eagle3_pipeline.layer_ids.server_layer_ids` writes for SGLang for this target's family
   (Llama-like: SGLang adds 1 to every id; DeepSeek-V3/Kimi: only when the first id is 1, which the
   rule requires), and checks that the model's ``layers_to_capture`` are then the inputs of layers
   ``id + 1`` — the outputs of our output-of-layer ids — before anything is extracted;
4. per batch: one ``Req`` per sample built from our ids (``origin_input_ids``; no text, no
   tokenizer), the scheduler's own steps for a new request with the radix cache off
   (``init_next_round_input`` on a disabled prefix cache, the fill length as admission sets it),
   ``ScheduleBatch.init_new`` + ``prepare_for_extend``, the ids moved to the GPU as the scheduler's
   input step does, ``ForwardBatch.init_new``, ``ModelRunner.forward``. The states are read where
   the model hands them to its ``LogitsProcessor`` (a forward pre-hook): ``hidden_states`` [N, H],
   the final norm's output (the teacher), and ``aux_hidden_states``, the residual streams entering
   the captured layers: a list of K [N, H] tensors or one packed [N, K·H] tensor, as the release's
   decoder class collects them (:class:`AuxForm`); N is the batch's tokens packed in request order,
   split back by length. The processor itself runs as in serving (next-token logits of each
   request's last token only). The request and KV pools are cleared after every forward.

Every rank computes every batch (tensor parallelism); rank 0 alone writes (``writer``) and hands its
decisions to the others (:meth:`SGLangTarget.share`).

**Versions.** Two release lines, chosen by the ``sglang.__version__`` found in
``hidden_states.sglang_python``'s environment; any other is refused:

- **0.5.14**, the release SpecForge 0.2.0 pins (``sglang==0.5.14``, with torch 2.11) for the same
  in-process capture (``specforge/offline_capture/sglang_backend``), so a host set up for SpecForge's
  DeepSeek-V3 / Kimi recipes has it;
- **0.5.23**, the current line (torch 2.14.1, transformers 5.19), which a host serving Kimi-K2.5
  today runs. Against 0.5.14 it changed: ``ServerArgs`` resolves lazily and is published to the
  process's runtime context (``runtime_context.publish(…, role="scheduler", ranks=SpawnRanks(…))``,
  which ``ModelRunner`` asserts) and its fields keep the raw input (resolved values come from
  ``get_schedule()`` / ``get_device()``); the process groups are built by
  ``distributed.bootstrap.init_parallel_runtime`` before the runner, no longer by it; ``ModelRunner``
  takes no tp/pp/ep ranks; ``ChunkCache`` is gone (a disabled ``UnifiedRadixCache``); ``Req.fill_len``
  is ``extend_end``; ``ForwardBatch.init_new`` has a required keyword-only
  ``return_hidden_states_before_norm``; DeepSeek/Kimi hand the ``LogitsProcessor`` one packed
  [N, K·H] aux tensor (``layers/aux_hidden_states.py``).

**One list of names per release.** Every SGLang module, class, method, function, attribute and
keyword this module touches is an entry of its release's ``uses`` (:data:`RELEASES`), and it reaches
SGLang only through :class:`SGLangApi`, which refuses a name, a keyword or a positional count not
listed there. ``eagle3_pipeline_tests/hidden_states/test_sglang_signatures.py`` checks each
release's entries (and its :class:`AuxForm` contract) against that release's wheel; the stand-in the
tests run the worker on implements the same entries, one tree per release.

sglang and torch are imported inside the functions that use them.
"""

from __future__ import annotations

import importlib
import inspect
import os
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from eagle3_pipeline.hidden_states.capture import TargetLoadError, target_identity
from eagle3_pipeline.hidden_states.store import TargetIdentity
from eagle3_pipeline.layer_ids import server_layer_ids, target_family
from eagle3_pipeline.target import read_config

PYTHON_SETTING = "hidden_states.sglang_python"


@dataclass(frozen=True)
class SGLangUse:
    """One SGLang name the worker uses. ``name``: ``Class``, ``Class.member`` or a module-level
    ``attribute`` or ``function``. ``keywords``: the parameters the worker passes by name (a class
    without keywords is only referenced, not constructed);
    ``positional``: how many it passes by position (after ``self``/``cls``). ``reads``: the worker
    does not call it but reads the ``keywords`` parameters from the model's call
    (``LogitsProcessor.forward``)."""

    module: str
    name: str
    kind: Literal["class", "method", "attribute", "function"]
    keywords: tuple[str, ...] = ()
    positional: int = 0
    reads: bool = False


@dataclass(frozen=True)
class AuxForm:
    """How a decoder class (the one holding ``layers_to_capture``) collects the aux states it hands
    the ``LogitsProcessor``: ``list``, K tensors [N, H]; ``packed``, one tensor [N, K·H]."""

    module: str
    decoder: str
    form: Literal["list", "packed"]


_SRT = "sglang.srt"
_RUNNER = f"{_SRT}.model_executor.model_runner"
_BATCH = f"{_SRT}.managers.schedule_batch"
_CONTEXT = f"{_SRT}.runtime_context"
VERSION_USE = SGLangUse("sglang.version", "__version__", "attribute")
# The server settings every release takes alike (ServerArgs keywords) and the names both use alike.
_SERVER_KEYWORDS = (
    "model_path",
    "trust_remote_code",
    "dtype",
    "tp_size",
    "mem_fraction_static",
    "max_running_requests",
    "disable_radix_cache",
    "chunked_prefill_size",
    "disable_cuda_graph",
)
COMMON_USES: tuple[SGLangUse, ...] = (
    VERSION_USE,
    SGLangUse(f"{_SRT}.server_args", "ServerArgs", "class", keywords=_SERVER_KEYWORDS),
    SGLangUse(f"{_SRT}.configs.model_config", "ModelConfig", "class"),
    SGLangUse(f"{_SRT}.configs.model_config", "ModelConfig.from_server_args", "method", keywords=("server_args",)),
    SGLangUse(_RUNNER, "ModelRunner.alloc_memory_pool", "method"),
    SGLangUse(_RUNNER, "ModelRunner.init_attention_backends", "method"),
    SGLangUse(_RUNNER, "ModelRunner.init_cuda_graphs", "method"),
    SGLangUse(_RUNNER, "ModelRunner.forward", "method", keywords=("forward_batch",)),
    SGLangUse(_RUNNER, "ModelRunner.model", "attribute"),
    SGLangUse(_RUNNER, "ModelRunner.model_config", "attribute"),
    SGLangUse(_RUNNER, "ModelRunner.req_to_token_pool", "attribute"),
    SGLangUse(_RUNNER, "ModelRunner.token_to_kv_pool_allocator", "attribute"),
    SGLangUse(_RUNNER, "ModelRunner.max_total_num_tokens", "attribute"),
    SGLangUse(_RUNNER, "ModelRunner.max_running_requests", "attribute"),
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
        reads=True,
    ),
    SGLangUse(
        f"{_SRT}.sampling.sampling_params",
        "SamplingParams",
        "class",
        keywords=("max_new_tokens", "temperature", "top_k"),
    ),
    SGLangUse(_BATCH, "Req", "class", keywords=("rid", "origin_input_text", "origin_input_ids", "sampling_params")),
    SGLangUse(_BATCH, "Req.init_next_round_input", "method", keywords=("tree_cache",)),
    SGLangUse(_BATCH, "ScheduleBatch", "class"),
    SGLangUse(
        _BATCH,
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
    SGLangUse(_BATCH, "ScheduleBatch.prepare_for_extend", "method"),
    SGLangUse(_BATCH, "ScheduleBatch.prefill_input_ids_cpu", "attribute"),
    SGLangUse(_BATCH, "ScheduleBatch.input_ids", "attribute"),
    SGLangUse(_BATCH, "ScheduleBatch.device", "attribute"),
    SGLangUse(f"{_SRT}.speculative.spec_info", "SpeculativeAlgorithm", "class"),
    SGLangUse(f"{_SRT}.speculative.spec_info", "SpeculativeAlgorithm.NONE", "attribute"),
    SGLangUse(f"{_SRT}.model_executor.forward_batch_info", "ForwardBatch", "class"),
)
_CACHE_KEYWORDS = ("disable", "req_to_token_pool", "token_to_kv_pool_allocator", "page_size")


@dataclass(frozen=True)
class Started:
    """A release's runner as :func:`open_sglang_target` built it, with the resolved settings the
    forwards need."""

    server_args: Any
    runner: Any
    page_size: int
    device: str


class Release(ABC):
    """One SGLang release line's entry points: its ``uses`` (the names :class:`SGLangApi` lets the
    worker touch), its :class:`AuxForm` contract, and the steps whose calls differ between releases."""

    version: ClassVar[str]
    uses: ClassVar[tuple[SGLangUse, ...]]
    aux: ClassVar[tuple[AuxForm, ...]]
    fill_field: ClassVar[str]  # the Req field the scheduler's admission sets to prefix + extend length

    def aux_form(self, decoder: type) -> str:
        for entry in self.aux:
            if entry.decoder == decoder.__name__:
                return entry.form
        raise SGLangError(
            f"SGLang {self.version} {decoder.__name__}: no aux form listed (the release's AuxForm entries: "
            f"{[entry.decoder for entry in self.aux]})"
        )

    @abstractmethod
    def start(self, api: SGLangApi, ranks: Ranks, settings: dict[str, Any], mem_fraction_static: float) -> Started:
        """``ServerArgs`` from ``settings`` and the ``ModelRunner`` of this rank."""

    @abstractmethod
    def prefix_cache(self, api: SGLangApi, started: Started) -> Any:
        """SGLang's prefix cache with the radix cache off (no prefix is ever matched)."""

    def forward_batch(self, api: SGLangApi, batch: Any, runner: Any) -> Any:
        return api.call(api.cls("ForwardBatch"), "init_new", batch=batch, model_runner=runner)

    @staticmethod
    def _model_config(api: SGLangApi, server_args: Any) -> Any:
        return api.call(api.cls("ModelConfig"), "from_server_args", server_args=server_args)


class Release0514(Release):
    version = "0.5.14"
    uses = (
        *COMMON_USES,
        SGLangUse(f"{_SRT}.server_args", "ServerArgs.ep_size", "attribute"),
        SGLangUse(f"{_SRT}.server_args", "ServerArgs.page_size", "attribute"),
        SGLangUse(f"{_SRT}.server_args", "ServerArgs.device", "attribute"),
        SGLangUse(
            _RUNNER,
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
        SGLangUse(f"{_SRT}.mem_cache.cache_init_params", "CacheInitParams", "class", keywords=_CACHE_KEYWORDS),
        SGLangUse(f"{_SRT}.mem_cache.chunk_cache", "ChunkCache", "class", keywords=("params",)),
        SGLangUse(_BATCH, "Req.fill_len", "attribute"),
        SGLangUse(
            f"{_SRT}.model_executor.forward_batch_info",
            "ForwardBatch.init_new",
            "method",
            keywords=("batch", "model_runner"),
        ),
    )
    aux = (
        AuxForm(f"{_SRT}.models.llama", "LlamaModel", "list"),
        AuxForm(f"{_SRT}.models.deepseek_v2", "DeepseekV2Model", "list"),
    )
    fill_field = "fill_len"

    def start(self, api: SGLangApi, ranks: Ranks, settings: dict[str, Any], mem_fraction_static: float) -> Started:
        """``ServerArgs`` resolved at construction; the runner joins the process groups itself."""
        server_args = api.new("ServerArgs", **settings)
        model_config = self._model_config(api, server_args)
        experts = int(api.get(server_args, "ep_size"))
        runner = api.new(
            "ModelRunner",
            model_config=model_config,
            mem_fraction_static=mem_fraction_static,
            gpu_id=ranks.local_rank,
            tp_rank=ranks.rank,
            tp_size=ranks.world,
            moe_ep_rank=ranks.rank // (ranks.world // experts),
            moe_ep_size=experts,
            pp_rank=0,
            pp_size=1,
            nccl_port=0,
            server_args=server_args,
        )
        return Started(server_args, runner, int(api.get(server_args, "page_size")), str(api.get(server_args, "device")))

    def prefix_cache(self, api: SGLangApi, started: Started) -> Any:
        params = api.new(
            "CacheInitParams",
            disable=True,
            req_to_token_pool=api.get(started.runner, "req_to_token_pool"),
            token_to_kv_pool_allocator=api.get(started.runner, "token_to_kv_pool_allocator"),
            page_size=started.page_size,
        )
        return api.new("ChunkCache", params=params)


class Release0523(Release):
    version = "0.5.23"
    uses = (
        *COMMON_USES,
        SGLangUse(_CONTEXT, "SpawnRanks", "class", keywords=("world_rank", "gpu_id")),
        SGLangUse(_CONTEXT, "publish", "function", keywords=("role", "ranks"), positional=1),
        SGLangUse(_CONTEXT, "get_schedule", "function"),
        SGLangUse(_CONTEXT, "get_device", "function"),
        SGLangUse(f"{_SRT}.arg_groups.fields.schedule", "Schedule.page_size", "attribute"),
        SGLangUse(f"{_SRT}.arg_groups.fields.device", "Device.device", "attribute"),
        SGLangUse(
            f"{_SRT}.distributed.bootstrap",
            "init_parallel_runtime",
            "function",
            keywords=("server_args", "device", "dist_port"),
        ),
        SGLangUse(f"{_SRT}.distributed.bootstrap", "init_layer_runtime", "function", keywords=("model_config",)),
        SGLangUse(
            _RUNNER,
            "ModelRunner",
            "class",
            keywords=("model_config", "mem_fraction_static", "gpu_id", "nccl_port", "server_args"),
        ),
        SGLangUse(
            f"{_SRT}.mem_cache.cache_init_params",
            "CacheInitParams",
            "class",
            keywords=(*_CACHE_KEYWORDS, "tree_components"),
        ),
        SGLangUse(f"{_SRT}.mem_cache.unified_cache.component_type", "ComponentType", "class"),
        SGLangUse(f"{_SRT}.mem_cache.unified_cache.component_type", "ComponentType.FULL", "attribute"),
        SGLangUse(f"{_SRT}.mem_cache.unified_radix_cache", "UnifiedRadixCache", "class", keywords=("params",)),
        SGLangUse(_BATCH, "Req.extend_end", "attribute"),
        SGLangUse(
            f"{_SRT}.model_executor.forward_batch_info",
            "ForwardBatch.init_new",
            "method",
            keywords=("batch", "model_runner", "return_hidden_states_before_norm"),
        ),
    )
    aux = (
        AuxForm(f"{_SRT}.models.llama", "LlamaModel", "list"),
        AuxForm(f"{_SRT}.models.deepseek_v2", "DeepseekV2Model", "packed"),
    )
    fill_field = "extend_end"

    def start(self, api: SGLangApi, ranks: Ranks, settings: dict[str, Any], mem_fraction_static: float) -> Started:
        """The scheduler process's entry steps: publish the ``ServerArgs`` (which resolves them) with
        this rank's placement, build the process groups and the layer runtime, then the runner."""
        server_args = api.new("ServerArgs", **settings)
        placement = api.new("SpawnRanks", world_rank=ranks.rank, gpu_id=ranks.local_rank)
        api.function("publish", server_args, role="scheduler", ranks=placement)
        device = str(api.setting("get_device", "Device.device"))
        model_config = self._model_config(api, server_args)
        api.function("init_parallel_runtime", server_args=server_args, device=device, dist_port=0)
        api.function("init_layer_runtime", model_config=model_config)
        runner = api.new(
            "ModelRunner",
            model_config=model_config,
            mem_fraction_static=mem_fraction_static,
            gpu_id=ranks.local_rank,
            nccl_port=0,
            server_args=server_args,
        )
        return Started(server_args, runner, int(api.setting("get_schedule", "Schedule.page_size")), device)

    def prefix_cache(self, api: SGLangApi, started: Started) -> Any:
        """A disabled ``UnifiedRadixCache`` over full attention, as ``mem_cache/registry.py`` builds
        it with ``--disable-radix-cache``."""
        params = api.new(
            "CacheInitParams",
            disable=True,
            req_to_token_pool=api.get(started.runner, "req_to_token_pool"),
            token_to_kv_pool_allocator=api.get(started.runner, "token_to_kv_pool_allocator"),
            page_size=started.page_size,
            tree_components=(api.get(api.cls("ComponentType"), "FULL"),),
        )
        return api.new("UnifiedRadixCache", params=params)

    def forward_batch(self, api: SGLangApi, batch: Any, runner: Any) -> Any:
        return api.call(
            api.cls("ForwardBatch"),
            "init_new",
            batch=batch,
            model_runner=runner,
            return_hidden_states_before_norm=False,
        )


RELEASES: dict[str, Release] = {release.version: release for release in (Release0514(), Release0523())}
SUPPORTED_VERSIONS = tuple(RELEASES)


class SGLangError(TargetLoadError):
    """SGLang cannot run the extraction as set up; the message names the setting to change."""


class SGLangApi:
    """SGLang reached only through the ``uses`` of the release found in this python: a name,
    keyword or positional count the worker uses that is not listed there is an error (the stand-in
    tests run every path of both releases, so the lists cannot fall behind the code)."""

    def __init__(self) -> None:
        try:
            found = getattr(importlib.import_module(VERSION_USE.module), VERSION_USE.name)
        except ImportError as exc:
            raise SGLangError(
                f"{PYTHON_SETTING}: cannot import sglang here ({exc}); expected the python of a venv with "
                f"sglang {' or '.join(SUPPORTED_VERSIONS)} and this package"
            ) from None
        release = RELEASES.get(found)
        if release is None:
            raise SGLangError(
                f"{PYTHON_SETTING}: this python has sglang {found}; the worker is written against sglang "
                f"{' and '.join(SUPPORTED_VERSIONS)} (eagle3_pipeline.hidden_states.sglang_capture.RELEASES): "
                "install one of them in the venv"
            )
        self.release = release
        self._uses = {use.name: use for use in release.uses}

    def _use(self, name: str, kind: str) -> SGLangUse:
        use = self._uses.get(name)
        if use is None or use.kind != kind:
            raise SGLangError(
                f"{name}: not an SGLang {kind} of the uses of sglang {self.release.version} "
                "(eagle3_pipeline.hidden_states.sglang_capture.RELEASES)"
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
            f"SGLang {classes[0].__name__}.{member}: not in the uses of sglang {self.release.version} "
            f"({', '.join(listed) or 'none'})"
        )

    @staticmethod
    def _check_call(use: SGLangUse, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        unknown = sorted(set(kwargs) - set(use.keywords))
        if unknown or len(args) != use.positional:
            raise SGLangError(
                f"{use.module}.{use.name}: called with {len(args)} positional argument(s) and keyword(s) "
                f"{sorted(kwargs)}; its use lists {use.positional} and {list(use.keywords)}"
            )

    def cls(self, name: str) -> type:
        use = self._use(name, "class")
        found: type = getattr(importlib.import_module(use.module), name)
        return found

    def new(self, name: str, **kwargs: Any) -> Any:
        use = self._use(name, "class")
        if not use.keywords:
            raise SGLangError(f"{use.module}.{name}: its use lists no keywords: referenced, not constructed")
        self._check_call(use, (), kwargs)
        return self.cls(name)(**kwargs)

    def function(self, name: str, *args: Any, **kwargs: Any) -> Any:
        use = self._use(name, "function")
        self._check_call(use, args, kwargs)
        return getattr(importlib.import_module(use.module), name)(*args, **kwargs)

    def setting(self, getter: str, field: str) -> Any:
        """A resolved setting: leaf ``Namespace.field`` of the config bag ``getter()`` returns."""
        self._use(field, "attribute")
        return getattr(self.function(getter), field.partition(".")[2])

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
                f"the inputs of {expected}: the {self.family!r} family rule of eagle3_pipeline.layer_ids "
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
