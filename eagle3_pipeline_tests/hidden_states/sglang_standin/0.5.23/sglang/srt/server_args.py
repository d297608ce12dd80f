"""Stand-in for ``sglang.srt.server_args`` (see the sglang package docstring)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerArgs:
    """Raw input: ``page_size`` and ``device`` are what the operator typed (``None``: decide for me);
    ``resolve_once`` (which ``runtime_context.publish`` runs) decides them into the config bags."""

    model_path: str
    trust_remote_code: bool = False
    dtype: str = "auto"
    tp_size: int = 1
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    disable_radix_cache: bool = False
    chunked_prefill_size: int | None = None
    disable_cuda_graph: bool = False
    ep_size: int = 1
    page_size: int | None = None
    device: str | None = None

    def resolve_once(self) -> dict[str, object]:
        """The resolved values, decided once."""
        resolved = getattr(self, "_resolved", None)
        if resolved is None:
            resolved = {"page_size": self.page_size or 1, "device": self.device or "cpu"}
            self._resolved = resolved
        return resolved
