"""Rotary positions (RoPE, "RoFormer", arXiv 2104.09864) applied to an attention's queries and keys.

Each attention module of a rotary model owns a `RotaryEmbedding` over its own head width and rotates q and k by
their positions before its own mechanism runs (random features, hashing, sampling, landmarks, windows):
docs/llama_backbones.md says how each kind combines with it. Angles are computed in float32 and cast, as
transformers' Llama does, so a converted checkpoint sees its source's exact angles in any dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from attnzoo.configuration.rope import inverse_frequencies


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension (the "half-split" RoPE layout Llama uses)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of given positions for `dim`-wide heads; `rotate(x, cos, sin)` applies them."""

    def __init__(self, config, dim: int):
        super().__init__()
        if dim % 2:
            raise ValueError(f"position_embedding_type='rotary' needs an even head width, got {dim}; change "
                             "hidden_size / num_attention_heads (or the family's head size).")
        self.dim = dim
        self.rope_theta, self.rope_scaling = config.rope_theta, config.rope_scaling
        # Not persistent: the table follows from the config, so checkpoints stay as they are. A model built on the
        # meta device gets it back from `_init_weights`, which copies `table()` into it.
        self.register_buffer("inv_freq", self.table(), persistent=False)

    def table(self) -> torch.Tensor:
        return inverse_frequencies(self.rope_theta, self.dim, self.rope_scaling)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [batch, 1, length, dim] (to broadcast over heads) for [batch, length] positions."""
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            angles = position_ids[..., None].float() * self.inv_freq.float()
            angles = torch.cat((angles, angles), dim=-1)
            return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rope_theta={self.rope_theta}, rope_scaling={self.rope_scaling}"

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + rotate_half(x) * sin
