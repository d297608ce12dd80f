"""What the operator reads from the CLI: the pipeline's status (:mod:`.status`, ``eagle3-pipeline status``)
and the main job's GPU schedule (:mod:`.schedule`, ``eagle3-pipeline plan``)."""
