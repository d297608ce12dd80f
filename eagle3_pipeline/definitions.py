"""The code location: the component instances under `eagle3_pipeline/defs/` (only `defs.yaml` files),
loaded by `dg.load_from_defs_folder`.

The pipeline is the `Eagle3Pipeline` component (`eagle3_pipeline/components/`) instanced by
`defs/local/defs.yaml` (the shipped `local` profile); `dagster dev`, `dg` and `eagle3-pipeline` all
load this module. To load another pipeline file, point that defs.yaml's `config_file` at it, or build
its definitions in a file of your own: `defs = build_definitions(load_config(path, runtime_checks=False))`
(:func:`eagle3_pipeline.components.build_definitions`). The executor is set here, once for every
pipeline of the code location (`deploy.executor` of their files, which must agree)."""

from pathlib import Path

import dagster as dg

from eagle3_pipeline.components.execution.deploy import with_executor

defs = with_executor(dg.load_from_defs_folder(path_within_project=Path(__file__).parent))
