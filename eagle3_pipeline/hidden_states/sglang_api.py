"""The SGLang names the in-process capture (:mod:`.sglang_capture`) uses, one list per supported
release (:data:`RELEASES`: modules, classes, methods, functions, attributes and keywords, and each
decoder's :class:`AuxForm`), the steps whose calls differ between releases (:class:`Release`), and
the one gate through which the capture reaches SGLang (:class:`SGLangApi`), which refuses a name not
listed for the release found. Why two releases and what changed between them: hidden_states/DESIGN.md
"SGLang capture".
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from eagle3_pipeline.hidden_states.capture import TargetLoadError

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
                f"{' and '.join(SUPPORTED_VERSIONS)} (eagle3_pipeline.hidden_states.sglang_api.RELEASES): "
                "install one of them in the venv"
            )
        self.release = release
        self._uses = {use.name: use for use in release.uses}

    def _use(self, name: str, kind: str) -> SGLangUse:
        use = self._uses.get(name)
        if use is None or use.kind != kind:
            raise SGLangError(
                f"{name}: not an SGLang {kind} of the uses of sglang {self.release.version} "
                "(eagle3_pipeline.hidden_states.sglang_api.RELEASES)"
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
