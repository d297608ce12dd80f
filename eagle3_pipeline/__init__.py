"""eagle3_pipeline: prompts → target responses → EAGLE-3 training data, as a Dagster code location.

The domain modules here know nothing of Dagster; `eagle3_pipeline.components` is the Dagster layer (the
`dg` defs folder) and `eagle3_pipeline.orchestration` the launch, gating and dispatch policy it calls.
"""
