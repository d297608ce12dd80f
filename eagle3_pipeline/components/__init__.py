"""The Dagster layer: the `Eagle3Pipeline` component and the factories it composes, one folder per
area, each holding its assets, checks, sensors and automation as thin wiring over the domain packages
and `eagle3_pipeline.orchestration`:

- `generation/`: target_model, prompts, responses (+ checks), training_data, the scheduled backfill;
- `eagle3/`: draft_vocab, hidden_states, eagle3_drafter, drafter_eval, drafter_benchmark, served_drafter;
- `health/`: the inference servers as observed assets, the health and stall sensors;
- `execution/`: the automation sensor, the executor;
- `resources.py`: the pipeline's settings and the inference endpoint;
- `pipeline.py`: :func:`build_definitions` (one pipeline file → Definitions) and the `Eagle3Pipeline`
  component.

Component classes live here, instances in `eagle3_pipeline/defs/` (`defs/local/defs.yaml`; a second
instance beside it, with a `key_prefix`, is a second pipeline in the same code location), so
`load_from_defs_folder` finds nothing here to load by itself.
"""

from eagle3_pipeline.components.pipeline import Eagle3Pipeline, build_definitions

__all__ = ["Eagle3Pipeline", "build_definitions"]
