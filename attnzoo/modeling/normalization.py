"""The stack's normalisation layers: LayerNorm, or RMSNorm ("Root Mean Square Layer Normalization", arXiv
1910.07467; Llama's), chosen by `config.norm_type`."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight. The statistic is computed in float32 at least and the result cast back
    before the weight multiplies it, the order transformers' Llama uses, so a bf16 conversion rounds as its source."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def build_norm(config, size: int) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return RMSNorm(size, config.layer_norm_eps)
    return nn.LayerNorm(size, eps=config.layer_norm_eps)
