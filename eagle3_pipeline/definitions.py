"""The code location: definitions for the pipeline file in `$EAGLE3_CONFIG` (default: the
shipped `local` profile). `dagster dev`, `dg` and `eagle3-pipeline` all load this module.

Loading reads only the pipeline file: missing source files and unset API-key variables are
reported by the run that needs them, so the webserver and the daemon load in any environment."""

from eagle3_pipeline.config import load_config
from eagle3_pipeline.defs.definitions import build_definitions

defs = build_definitions(load_config(runtime_checks=False))
