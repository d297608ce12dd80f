"""Stands in for SGLang 0.5.14's CUDA runtime, which this project's machines lack (no GPU, no
sglang): the tests put this folder's parent and ``../core`` on ``sys.path`` (or ``PYTHONPATH``) so
that the worker of ``hidden_states.backend: sglang`` (:mod:`eagle3_pipeline.hidden_states.sglang_capture`)
runs unchanged. ``../../0.5.23/sglang`` stands in for the current release line the same way.

It implements exactly the entries of the release's uses (``Release0514.uses``) — the same modules,
classes, methods, attributes and keyword parameters, which a test checks with the same source reader
that checks the real wheel — backed by transformers on the CPU (the parts both releases share are in
``../core/sglang_standin_core``), and applies SGLang's semantics where they matter to the worker:

- capture: index ``k`` of ``layers_to_capture`` is the residual stream entering decoder layer ``k``
  (SGLang's Llama ``hidden_states + residual`` before the layer; DeepSeek's communicator capture);
- ``set_eagle3_layers_to_capture`` turns the ids it receives into ``layers_to_capture`` by the
  rule of the model family (``models/llama.py``: ``id + 1`` for every id;
  ``models/deepseek_v2.py``, which Kimi-K2.5 wraps: ``id + 1`` only when the first id is 1);
- the model hands its ``LogitsProcessor`` the final norm's output and the captured states packed over
  the batch's tokens in request order, as a list of [N, H] tensors (both families in 0.5.14); the
  processor computes the last token's logits per request;
- requests need slots in the request and token pools (cleared by ``clear``), ``fill_len`` must
  equal prefix + extend length, the ids must be moved to ``input_ids`` before ``ForwardBatch.init_new``,
  and the runner refuses the radix cache, chunked prefill and CUDA graphs;
- ranks: the runner takes the tp/pp/ep ranks and needs torch.distributed joined with ``tp_size``
  processes (SGLang then reuses that world); ``ServerArgs`` carries the resolved ``ep_size``,
  ``page_size`` and ``device``. Each rank computes the whole model (no sharding: the states are what
  a tensor-parallel run replicates on every rank).

Each request of a packed batch is computed alone, the way the transformers extractor computes a
batch of one (attention mask of ones, positions 0…T−1, float32), so the two give bit-identical states
and a comparison of their stores isolates what the worker does.
"""
