"""Stands in for SGLang 0.5.23's CUDA runtime (the current release line), which this project's
machines lack (no GPU, no sglang): the tests put this folder's parent and ``../core`` on
``sys.path`` (or ``PYTHONPATH``) so that the worker of ``hidden_states.backend: sglang``
(:mod:`eagle3_pipeline.hidden_states.sglang_capture`) runs unchanged.

It implements exactly the entries of the release's uses (``Release0523.uses``), checked with the
same source reader that checks the real wheel, and shares with ``../../0.5.14/sglang`` what did not
change (``../core/sglang_standin_core``: transformers on the CPU, SGLang's capture rules; see that
tree's docstring). What 0.5.23 changed, it enforces as 0.5.23 does:

- ``ServerArgs`` is raw input until ``runtime_context.publish(server_args, role=..., ranks=SpawnRanks(...))``
  resolves it; its ``page_size`` and ``device`` stay ``None`` (the resolved values are
  ``get_schedule().page_size`` and ``get_device().device``), and ``ModelRunner`` refuses a record
  that was not published for the scheduler role;
- the process groups come from ``distributed.bootstrap.init_parallel_runtime`` (after publish, once),
  which the runner requires; the runner takes no ranks (they come from the published placement);
- ``ChunkCache`` is gone: the prefix cache with the radix cache off is a disabled
  ``UnifiedRadixCache`` whose ``CacheInitParams`` name its ``tree_components``;
- ``Req.extend_end`` (``None`` until admission) replaces ``fill_len``;
- ``ForwardBatch.init_new`` has a required keyword-only ``return_hidden_states_before_norm``;
- ``DeepseekV2Model`` (DeepSeek-V3, Kimi) hands the ``LogitsProcessor`` one packed [N, K·H] aux
  tensor; ``LlamaModel`` still a list.
"""
