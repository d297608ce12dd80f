"""Stand-ins shared by the tests (``eagle3_pipeline_tests``) and the benchmarks (``benchmarks/``).

Nothing in the pipeline imports this package; it exists so both can import the same fakes normally.
Each module stands in for something a test or a benchmark cannot have here:

- :mod:`~eagle3_pipeline.testing.fake_openai`: a real OpenAI-compatible HTTP server on loopback whose
  answers are scripted, for the inference server (SGLang/vLLM) where the tiny real model cannot produce
  a behaviour on demand (429s, hangs, truncated bodies); also runnable as a separate process.
- :mod:`~eagle3_pipeline.testing.sshd_fixture`: a real sshd on loopback with a scripted ``nvidia-smi``
  and fake SGLang processes, for a GPU inference host reached over SSH.
- :mod:`~eagle3_pipeline.testing.c1_records`: response tables written as the generation phase writes
  them (contract C1), for the target model's responses.
- :mod:`~eagle3_pipeline.testing.training_data`: tokenized training-data shards with random ids (or a
  real tokenizer's), for the training-data phase's output.
- :mod:`~eagle3_pipeline.testing.stores` and :mod:`~eagle3_pipeline.testing.tiny_store`: small real
  hidden-state stores and draft vocabularies, for the 1T target's hidden states, and the comparisons
  of two stores; :mod:`~eagle3_pipeline.testing.extract_specs`: the ``extract`` specs that make them.
- :mod:`~eagle3_pipeline.testing.reference_texts`: texts and a foreign tokenizer for the serving
  reference's tests.
- :mod:`~eagle3_pipeline.testing.reporter`: ``Recorder``, the reporter a phase called in process talks
  back to, keeping its log lines and progress points.
- :mod:`~eagle3_pipeline.testing.kimi`: a tiny random-weight checkpoint shaped like Kimi-K2.5 (remote
  code, slow tiktoken tokenizer, K2.5 chat template), for the 1T target itself.
- :mod:`~eagle3_pipeline.testing.drafter_reference`: Kimi-K2.5's language-model config as a dict, the
  server's chain drafting and the drafter's earlier full-score training pass, as references, and a
  small random drafter.
- :mod:`~eagle3_pipeline.testing.train_settings`: the ``train`` phase's settings as a pipeline file's
  ``drafter:`` section gives them, for a training run on a store of the test's own (and a whole spec
  over a small random store).
- :mod:`~eagle3_pipeline.testing.datasets`: JSONL dataset files of ShareGPT conversations, for a user's
  datasets.
- :mod:`~eagle3_pipeline.testing.webhook`: a webhook receiver on loopback, for the chat service alerts go to.
- :mod:`~eagle3_pipeline.testing.process_groups`: the live processes of a process group, read from /proc,
  for checking that a server's stop left none.

torch, transformers and safetensors are imported inside the functions that need them.
"""
