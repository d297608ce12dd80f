"""The RMSNorm every drafter norm is (the servers' ``RMSNorm``: float32 statistics, the weight applied
in the input's dtype), shared by the Llama layer (:mod:`eagle3_pipeline.drafter.model.eagle3`) and the MLA
attention (:mod:`eagle3_pipeline.drafter.model.mla`)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
