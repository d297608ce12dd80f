"""What the stand-ins of both SGLang releases (``../../0.5.14/sglang``, ``../../0.5.23/sglang``)
share: not an SGLang module. Each release tree's modules are laid out as that release's, and take
from here the parts whose entry points did not change between the releases (the pools, the logits
processor, the sampling parameters, the model config, the batch steps, the transformers-backed
models), so that both releases compute the same states the same way.

See the ``sglang`` package docstring of either tree for what the stand-in implements and why.
"""
