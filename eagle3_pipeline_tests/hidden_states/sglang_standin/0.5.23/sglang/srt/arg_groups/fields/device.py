"""Stand-in for ``sglang.srt.arg_groups.fields.device`` (see the sglang package docstring)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Device:
    """Namespace ``device``: the leaves of the ``get_device()`` config bag (``gpu_id`` is the launcher's)."""

    device: str | None = None
    gpu_id: int | None = None
