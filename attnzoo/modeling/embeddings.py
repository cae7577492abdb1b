"""Position embeddings (learned, sinusoidal, axial, none) and the DeiT-style patch embedding for images."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def sinusoidal_table(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """The fixed sin/cos embedding of Vaswani et al. for integer positions of any shape -> [..., dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.float()[..., None] * freqs
    table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return nn.functional.pad(table, (0, dim - 2 * half))


class AxialPositionEmbedding(nn.Module):
    """Reformer's factorised position table (Reformer, arXiv 2001.04451, §5 and the appendix on axial positional
    encodings): position p with row-major digits (i_1..i_n) over `axial_pos_shape` gets concat(E_1[i_1], ..., E_n[i_n]);
    the dims sum to hidden_size. It looks positions up directly, so any length up to the shape's product works, in
    training too."""

    def __init__(self, shape: list[int], dims: list[int]):
        super().__init__()
        self.shape = list(shape)
        # Direct parameters (weight_0, weight_1, ...), not a ParameterList: transformers' init skips a custom
        # module that has no parameters of its own.
        for axis, (size, dim) in enumerate(zip(shape, dims, strict=True)):
            self.register_parameter(f"weight_{axis}", nn.Parameter(torch.empty(size, dim)))
        # Plain ints, not buffers: from_pretrained builds models on the meta device, where buffers would be lost.
        self.strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]

    @property
    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight_{axis}") for axis in range(len(self.shape))]

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        # An embedding lookup rather than `weight[index]`: torch.compile's CPU backend mis-compiles the indexing's
        # backward here (an index out of bounds at run time), and the embedding is what nn.Embedding runs anyway.
        parts = [F.embedding((position_ids // stride) % size, weight)
                 for weight, stride, size in zip(self.weights, self.strides, self.shape, strict=True)]
        return torch.cat(parts, dim=-1)


class PositionEmbedding(nn.Module):
    """Adds position information to token embeddings according to `config.position_embedding_type`."""

    def __init__(self, config):
        super().__init__()
        self.kind = config.position_embedding_type
        self.hidden_size = config.hidden_size
        self.max_positions = config.max_position_embeddings
        if self.kind == "learned":
            self.table = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        elif self.kind == "axial":
            self.table = AxialPositionEmbedding(config.axial_pos_shape, config.axial_pos_embds_dim)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        if self.kind in ("none", "rotary"):  # rotary positions act inside the attentions
            return None
        if self.kind == "sinusoidal":
            return sinusoidal_table(position_ids, self.hidden_size)
        return self.table(position_ids)

    def check_length(self, total_length: int) -> None:
        if self.kind in ("learned", "axial") and total_length > self.max_positions:
            raise ValueError(
                f"the sequence needs {total_length} positions but max_position_embeddings={self.max_positions}; "
                "shorten the input or build the model with a larger max_position_embeddings."
            )


class PatchEmbedding(nn.Module):
    """Non-overlapping patches -> tokens, plus an optional class token and 2-D position embeddings (DeiT)."""

    def __init__(self, config):
        super().__init__()
        self.image_size, self.patch_size, self.num_channels = config.image_size, config.patch_size, config.num_channels
        self.grid = config.image_size // config.patch_size
        self.projection = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if config.pooling == "cls" else None
        num_tokens = self.grid * self.grid + (1 if self.cls_token is not None else 0)
        self.kind = config.position_embedding_type
        if self.kind in ("learned", "axial"):  # a learned table over the patch grid is DeiT's 2-D embedding
            self.position_embeddings = nn.Parameter(torch.zeros(1, num_tokens, config.hidden_size))
        self.hidden_size = config.hidden_size

    def sinusoidal_2d(self, device) -> torch.Tensor:
        """Fixed 2-D positions: half the features encode the patch row, half its column (class token: zeros)."""
        rows, cols = torch.meshgrid(torch.arange(self.grid, device=device), torch.arange(self.grid, device=device),
                                    indexing="ij")
        half = self.hidden_size // 2
        table = torch.cat([sinusoidal_table(rows.flatten(), half),
                           sinusoidal_table(cols.flatten(), self.hidden_size - half)], dim=-1)
        if self.cls_token is not None:
            table = torch.cat([table.new_zeros(1, self.hidden_size), table])
        return table[None]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}; expected (batch, {', '.join(map(str, expected))})"
                " as set by num_channels and image_size in the config; resize the images or change the config."
            )
        tokens = self.projection(pixel_values).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        if self.kind in ("learned", "axial"):
            tokens = tokens + self.position_embeddings
        elif self.kind == "sinusoidal":
            tokens = tokens + self.sinusoidal_2d(tokens.device).to(tokens.dtype)
        return tokens
