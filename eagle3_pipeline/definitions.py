"""The code location: definitions for the pipeline file in `$EAGLE3_CONFIG` (default: the
shipped `local` profile). `dagster dev`, `dg` and `eagle3-pipeline` all load this module."""

from eagle3_pipeline.config import load_config
from eagle3_pipeline.defs.definitions import build_definitions

defs = build_definitions(load_config())
