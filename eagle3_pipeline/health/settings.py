"""What a health tick checks (`ServerSpec`, `GenerationTarget`) and where its lines are
(`HealthThresholds`).

Sizes called `_gb` are GiB (2**30 bytes), as `df -h` and `free -g` print them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

__all__ = ["CHECK_NAMES", "GenerationTarget", "HealthThresholds", "ServerKind", "ServerSpec", "server_root"]

ServerKind = Literal["sglang", "vllm", "transformers", "custom"]
GenerationProbe = Literal["chat", "health_generate"]

CHECK_NAMES = ("server_process", "port", "generation", "throughput", "gpus", "disk", "host_memory", "progress")

_PYTHON = r"^(?:\S*/)?python[0-9.]*\s+(?:-\S+\s+)*"
_DEFAULT_PATTERNS: dict[str, str] = {
    # The python process itself: a bash wrapper or a health-check loop that merely mentions the
    # module has a different argv[0] and does not match.
    "sglang": _PYTHON + r"-m\s+sglang\.launch_server(?:\s|$)",
    "vllm": r"^(?:(?:\S*/)?python[0-9.]*\s+(?:-\S+\s+)*)?(?:\S*/)?vllm\s+serve(?:\s|$)"
    r"|" + _PYTHON + r"-m\s+vllm\.entrypoints\.openai\.api_server(?:\s|$)",
    "transformers": r"^(?:(?:\S*/)?python[0-9.]*\s+(?:-\S+\s+)*)?(?:\S*/)?transformers\s+serve(?:\s|$)",
}
_DEFAULT_COMMANDS = {
    "sglang": "python -m sglang.launch_server",
    "vllm": "vllm serve",
    "transformers": "transformers serve",
}
_DEFAULT_METRICS_PATHS: dict[str, str | None] = {
    "sglang": "/metrics",
    "vllm": "/metrics",
    "transformers": None,
    "custom": None,
}


@dataclass(frozen=True)
class ServerSpec:
    """The inference server a tick checks.

    `tp_size` and `process_pattern` mirror the file's `health.server` (or `serving:`) settings and have
    no default here. `process_pattern` is a regex searched in each process's full command line (`ps`
    args); empty means the default for `kind` (required for "custom"). `port` is the port on the host;
    `base_url` is how this process reaches the server over HTTP (it may be a tunnel).
    `metrics_path` "" means the default for `kind` (None: no Prometheus endpoint, no throughput
    check). `api_key` is sent as a bearer token and never printed.
    """

    kind: ServerKind
    port: int
    base_url: str
    model: str
    tp_size: int
    process_pattern: str
    generation_probe: GenerationProbe = "chat"
    metrics_path: str | None = ""
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("sglang", "vllm", "transformers", "custom"):
            raise ValueError(f"ServerSpec.kind: expected sglang, vllm, transformers or custom, got {self.kind!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"ServerSpec.port: expected 1..65535, got {self.port}")
        if self.tp_size < 1:
            raise ValueError(f"ServerSpec.tp_size: expected >= 1, got {self.tp_size}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError("ServerSpec.base_url: expected an http:// or https:// URL")
        if self.kind == "custom" and not self.process_pattern:
            raise ValueError("ServerSpec.process_pattern: required when kind is 'custom'")
        try:
            re.compile(self.command_pattern)
        except re.error as exc:
            raise ValueError(f"ServerSpec.process_pattern: not a valid regex ({exc})") from None

    @property
    def command_pattern(self) -> str:
        return self.process_pattern or _DEFAULT_PATTERNS[self.kind]

    @property
    def command_description(self) -> str:
        """What the process check looks for, for messages: the command, or the custom regex."""
        return repr(self.process_pattern) if self.process_pattern else _DEFAULT_COMMANDS[self.kind]

    @property
    def metrics_endpoint(self) -> str | None:
        return _DEFAULT_METRICS_PATHS[self.kind] if self.metrics_path == "" else self.metrics_path

    @property
    def expected_scheduler_ranks(self) -> int | None:
        """SGLang runs one `sglang::scheduler_TP<rank>` process per tensor-parallel rank."""
        return self.tp_size if self.kind == "sglang" else None

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def target(self) -> GenerationTarget:
        """The server as a generation target, probed the way `generation_probe` says."""
        return GenerationTarget(
            base_url=self.url("/v1"), model=self.model, api_key=self.api_key, probe=self.generation_probe
        )


def server_root(base_url: str) -> str:
    """`http://box:30000/v1` → `http://box:30000` (where `/health_generate` and `/metrics` live)."""
    trimmed = base_url.rstrip("/")
    return trimmed[: -len("/v1")] if trimmed.endswith("/v1") else trimmed


@dataclass(frozen=True)
class GenerationTarget:
    """A server that work is sent to: every tick asks it for a real 1-token completion.

    `base_url` is the OpenAI-compatible base the generation client uses (`http://box:30000/v1`).
    A hosted target (an API reached with a key from the variable `api_key_env`) is asked at most
    once per `HealthThresholds.hosted_probe_interval_s`; its last verdict is reused in between,
    with its age. A target whose key variable is unset is CRITICAL without a request. The key is
    sent as a bearer token and never printed.
    """

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None
    probe: GenerationProbe = "chat"

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError("GenerationTarget.base_url: expected an http:// or https:// URL")

    @property
    def hosted(self) -> bool:
        return self.api_key_env is not None

    @property
    def label(self) -> str:
        """The base URL without credentials, query or trailing slash: how reports name it."""
        parts = urlsplit(self.base_url)
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        netloc += f":{parts.port}" if parts.port is not None else ""
        return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}"

    @property
    def probe_url(self) -> str:
        if self.probe == "chat":
            return self.label + "/chat/completions"
        return server_root(self.label) + "/health_generate"


@dataclass(frozen=True)
class HealthThresholds:
    """The lines a tick draws, the paths it watches and how long each probe may take.

    `expected_gpus` 0 means no GPU is required (the GPU check passes without calling nvidia-smi).
    The disk check looks at `artifacts_dir` (or "/"); the progress check at `log_path` and the
    newest file under `artifacts_dir`, which must have advanced within `stall_window_s`. Hosted
    endpoints get a real completion at most every `hosted_probe_interval_s`. The GPU check reads
    Xids from `kernel_log_path` when neither dmesg nor journalctl can read the kernel log. Checks
    named in `optional_checks` are reported but do not make a report unhealthy.

    The fields up to `optional_checks` are the pipeline file's `health:` section and have no defaults
    of their own (`eagle3_pipeline.health.gate.thresholds_for` builds them from the validated file); the
    rest are the tick's own, which the file does not set.
    """

    expected_gpus: int
    min_disk_free_gb: float
    min_mem_free_gb: float
    stall_window_s: float
    artifacts_dir: str | None
    log_path: str | None
    shell_section_timeout_s: float
    generation_timeout_s: float
    tick_timeout_s: float
    hosted_probe_interval_s: float
    kernel_log_path: str
    optional_checks: frozenset[str]
    throughput_min_interval_s: float = 10.0
    gpu_temp_warn_c: float = 85.0
    gpu_temp_critical_c: float = 92.0
    metrics_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.expected_gpus < 0:
            raise ValueError(f"HealthThresholds.expected_gpus: expected >= 0, got {self.expected_gpus}")
        for name in ("artifacts_dir", "log_path", "kernel_log_path"):
            value = getattr(self, name)
            if value is not None and not value.startswith("/"):
                raise ValueError(f"HealthThresholds.{name}: expected an absolute path on the host, got {value!r}")
        for name in (
            "shell_section_timeout_s",
            "generation_timeout_s",
            "metrics_timeout_s",
            "tick_timeout_s",
            "hosted_probe_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"HealthThresholds.{name}: expected > 0, got {getattr(self, name)}")
        unknown = set(self.optional_checks) - set(CHECK_NAMES)
        if unknown:
            raise ValueError(
                f"HealthThresholds.optional_checks: unknown check(s) {sorted(unknown)}; known: {CHECK_NAMES}"
            )

    @property
    def disk_path(self) -> str:
        return self.artifacts_dir or "/"
