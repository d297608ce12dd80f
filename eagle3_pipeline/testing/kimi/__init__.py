"""A tiny random-weight stand-in for Kimi-K2.5 (remote code, slow tiktoken tokenizer, K2.5 chat
template), built by the tests: see :mod:`eagle3_pipeline.testing.kimi.fixture`."""
