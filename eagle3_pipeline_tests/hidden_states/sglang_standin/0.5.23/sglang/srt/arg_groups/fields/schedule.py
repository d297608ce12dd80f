"""Stand-in for ``sglang.srt.arg_groups.fields.schedule`` (see the sglang package docstring)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Schedule:
    """Namespace ``schedule``: the leaves of the ``get_schedule()`` config bag."""

    page_size: int | None = None
