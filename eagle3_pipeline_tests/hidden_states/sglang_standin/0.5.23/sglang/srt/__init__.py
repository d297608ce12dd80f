"""Stand-in for ``sglang.srt`` (see the package docstring)."""
