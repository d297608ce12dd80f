"""Tests of the tiny Kimi-K2.5 stand-in (:mod:`eagle3_pipeline.testing.kimi.fixture`) and of the pipeline
loading, tokenizing and capturing through it."""
