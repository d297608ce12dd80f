"""Stand-in (see the sglang package docstring)."""
