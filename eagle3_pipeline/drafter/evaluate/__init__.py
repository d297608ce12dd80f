"""The ``evaluate`` phase (the `drafter_eval` asset): τ, the bigram baseline, what more data would buy."""
