"""Benchmarks: each module measures one phase or mechanism and prints its figures and ratios.

Run them from the repository root as modules, e.g. ``.venv/bin/python -m benchmarks.health_tick``;
each module's docstring gives its command line and what it measures. They import the pipeline and its
shared stand-ins (:mod:`eagle3_pipeline.testing`) normally, and one benchmark may import another
(``benchmarks.store_dtype_tau`` reuses ``benchmarks.tau_scaling``'s reporter).
"""
