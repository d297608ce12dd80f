"""The ``train`` phase (the `eagle3_drafter` asset): lifecycle, loop, loss, batches, checkpoints, warm start."""
