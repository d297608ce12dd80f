"""Orchestration policy: plain typed Python that the Dagster layer (`eagle3_pipeline.components`) calls.

It decides, from Dagster's run and event records (read through the public `dagster` API), which
`responses` partitions to launch and where (:mod:`.generation_decision`, :mod:`.partition_runs`,
:mod:`.hosts`, :mod:`.staleness`), refuses inputs whose blocking checks failed in an earlier run
(:mod:`.gating`) and runs a heavy phase where ``compute:`` says (:mod:`.heavy_phase`); the executors
read the step tags of :mod:`.step_tags`. Every asset key, job and resource name it reads comes from
:class:`.names.PipelineNames`, so several pipelines share a code location.
No asset, check or sensor is defined here.
"""
