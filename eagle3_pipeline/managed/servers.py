"""A pipeline file's managed servers, resolved: where each runs, how it is reached and checked, and its
launch line for a purpose (:func:`launch_for`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from eagle3_pipeline.config import HealthConfig, HostConfig, PipelineConfig, ServingConfig, TargetConfig
from eagle3_pipeline.config.serving import is_loopback, managed_base_url
from eagle3_pipeline.health import HealthThresholds, ServerSpec, server_root
from eagle3_pipeline.health.gate import thresholds_for
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed.launch import (
    EngineSettings,
    LaunchLine,
    ServerPurpose,
    build_launch,
    family_parsers,
    resolve_parser,
)


@dataclass(frozen=True)
class ServerSetup:
    """One managed server: its effective `serving` section, the host it runs on and how it is checked.

    ``name`` is the inference host's name (``serving`` without `inference.hosts`); ``setting`` where
    its section is in the pipeline file, for messages."""

    name: str
    setting: str
    serving: ServingConfig
    host: HostConfig
    base_url: str
    served_name: str
    expected_gpus: int
    thresholds: HealthThresholds

    @property
    def engine(self) -> str:
        return self.serving.engine

    @property
    def port(self) -> int:
        return self.serving.listen_port

    @property
    def bind_host(self) -> str:
        """Where it listens: ``serving.bind_host``, else loopback, on an SSH host too (reached by a tunnel)."""
        return self.serving.bind_host if self.serving.bind_host is not None else "127.0.0.1"

    @property
    def tunnelled(self) -> bool:
        """Whether this machine reaches it through an SSH tunnel: it listens on the loopback of an SSH host,
        and its URL names that host (a URL naming this machine's loopback is a forward of the user's own)."""
        host = urlsplit(self.base_url).hostname or ""
        return self.host.kind == "ssh" and is_loopback(self.bind_host) and not is_loopback(host)

    def api_key(self) -> str | None:
        """The key it requires (the value of ``serving.api_key_env``), None without one; ValueError naming the
        variable when the file names one that is not set here."""
        variable = self.serving.api_key_env
        if variable is None:
            return None
        value = os.environ.get(variable)
        if not value:
            raise ValueError(
                f"{self.setting}.api_key_env: environment variable {variable} is not set (expected the key the "
                "managed server requires)"
            )
        return value

    def server_spec(self) -> ServerSpec:
        """What the health tick checks to call the server ready: its process, port and a generation."""
        return ServerSpec(
            kind=self.serving.engine,
            port=self.port,
            base_url=server_root(self.base_url),
            model=self.served_name,
            tp_size=self.serving.tp_size,
            process_pattern=self.serving.process_pattern,
            generation_probe="health_generate" if self.engine == "sglang" else "chat",
            api_key=os.environ.get(self.serving.api_key_env) if self.serving.api_key_env else None,
        )

    def engine_settings(self, trust_remote_code: bool, model_types: Sequence[str | None]) -> EngineSettings:
        """The builder's input; ``model_types``: the target's (outer, nested) model_type, for the parsers."""
        assert self.serving.model is not None  # the config refuses a managed server without one
        known = family_parsers(model_types)
        engine = self.serving.engine
        return EngineSettings(
            engine=engine,
            python=self.serving.python,
            model=self.serving.model,
            port=self.port,
            bind_host=self.bind_host,
            tp_size=self.serving.tp_size,
            served_name=self.served_name,
            trust_remote_code=trust_remote_code,
            reasoning_parser=resolve_parser(self.serving.reasoning_parser, known.reasoning(engine) if known else None),
            tool_call_parser=resolve_parser(self.serving.tool_call_parser, known.tools(engine) if known else None),
            extra_args=tuple(self.serving.extra_args),
            env=dict(self.serving.env),
            setting=self.setting,
            key_file=self.serving.key_path if self.serving.api_key_env else None,
        )


def _setup(
    serving: ServingConfig, health: HealthConfig, target: TargetConfig, artifacts_root: Path, name: str, setting: str
) -> ServerSetup:
    """One managed server from the sections as its host sees them (:meth:`PipelineConfig.for_host`)."""
    return ServerSetup(
        name=name,
        setting=setting,
        serving=serving,
        host=health.host,
        base_url=managed_base_url(serving, health.model_dump()),
        served_name=serving.served_name or target.model,
        expected_gpus=health.expected_gpus,
        thresholds=thresholds_for(health, artifacts_root),
    )


def managed_servers(config: PipelineConfig) -> list[ServerSetup]:
    """Every managed server of the pipeline: the top-level one, or one per managed inference host."""
    if not config.inference.hosts:
        if not config.serving.managed:
            return []
        return [_setup(config.serving, config.health, config.target, config.artifacts_root, "serving", "serving")]
    setups = []
    for index, host in enumerate(config.inference.hosts):
        seen = config.for_host(host.name)
        if seen.serving.managed:
            setting = f"inference.hosts[{index}] (name {host.name!r}).serving"
            setups.append(_setup(seen.serving, seen.health, seen.target, seen.artifacts_root, host.name, setting))
    return setups


def managed_server(config: PipelineConfig, host_name: str | None = None) -> ServerSetup | None:
    """The managed server of one inference host (None: the only one, or the first); None if unmanaged."""
    setups = managed_servers(config)
    if host_name is None:
        return setups[0] if setups else None
    return next((setup for setup in setups if setup.name == host_name), None)


def target_model_types(target: TargetConfig, setup: ServerSetup | None = None) -> list[str | None]:
    """The target's model_type and its nested language model's, from a config.json readable here: the
    target.tokenizer folder, else the managed server's model folder when it runs on this machine.
    Empty when neither is a local folder (the parsers' auto then finds no family)."""
    from eagle3_pipeline.target.folder import NESTED_CONFIG_KEYS, TargetError, read_config

    folders = [target.tokenizer]
    if setup is not None and setup.host.kind == "local":
        folders.append(setup.serving.model)
    for folder in folders:
        if folder is None or not (Path(folder) / "config.json").is_file():
            continue
        try:
            raw = read_config(folder)
        except TargetError:
            continue
        nested = [raw.get(key) for key in NESTED_CONFIG_KEYS]
        return [raw.get("model_type"), *(n.get("model_type") for n in nested if isinstance(n, dict))]
    return []


def prompts_need_tools(prompt_files: Iterable[Path]) -> bool:
    """Whether any prompt (the ``prompts`` phase's tables) carries tools."""
    import pyarrow.parquet as pq

    for path in prompt_files:
        tools = pq.read_table(path, columns=["tools"]).column("tools")
        if tools.null_count < len(tools):
            return True
    return False


# The roles a run that generates keeps serving: a server of the trained drafter generates the target's
# own greedy tokens (speculative decoding changes the speed, not the answers).
GENERATION_ACCEPTS = ("served-drafter",)


def generation_purpose(layout: ArtifactLayout, dataset_ids: Iterable[str]) -> ServerPurpose:
    """Generation for the pipeline's datasets: with the tool-call parser when the prompts written so far
    (every dataset's, so that one server serves each partition without a restart between them) carry tools."""
    written = [path for path in map(layout.prompts, dataset_ids) if path.exists()]
    return ServerPurpose.generation(needs_tools=prompts_need_tools(written))


def launch_for(target: TargetConfig, setup: ServerSetup, purpose: ServerPurpose) -> LaunchLine:
    """The server's launch line for ``purpose``, from the pipeline's target and the setup's serving section."""
    settings = setup.engine_settings(target.trust_remote_code, target_model_types(target, setup))
    return build_launch(settings, purpose)
