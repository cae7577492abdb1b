"""How a layer's far (global) part sees positions (`far_positions`, `far_query_scale` of the config).

Rotary positions do not extrapolate: a query-key pair further apart than any pair seen in training meets rotations
the model never learned to read. Long-context models that retrieve far beyond their training length keep rotary
positions only where attention is local and give their global attention none: Llama 4's iRoPE (NoPE global layers),
RNoPE-SWA ("Rope to Nope and Back Again", arXiv 2501.18795) and SWAN-GPT (arXiv 2504.08719). Per layer:

- "rotary" (the default): the far part sees the rotated queries and keys, as the near part does;
- "none": the far part hashes, features or scores the queries and keys before rotation (a windowed layer's exact
  window keeps its rotary positions; a "full" layer becomes a global layer without positions);
- "fixed" (windowed layers): every far key is read at the distance `window_size`, the nearest a far key can be:
  keys unrotated, queries rotated as if at position W. A pretrained rotary model then never meets a distance it did
  not train on, without training: InfLLM ("InfLLM: Training-Free Long-Context Extrapolation for LLMs with an
  Efficient Context Memory", arXiv 2402.04617, §3: far memory units read at the local window's distance) and
  LM-Infinite ("LM-Infinite: Zero-Shot Extreme Length Generalization for Large Language Models", arXiv 2308.16137:
  distances capped) read a model's far context so. Unlike "none" the far part keeps what rotary gives a pair at
  that distance, which the model's heads were trained to read.
- "grouped" (windowed layers): Self-Extend's grouped positions ("LLM Maybe LongLM: Self-Extend LLM Context Window
  Without Tuning", arXiv 2401.01325, §3), joined to the window: with G = `far_position_group`, a key at real position
  j is rotated as if at floor(j / G) and a query at i as if at floor(i / G) + W - floor(W / G), so a far key
  (j <= i - W) sits at W + floor(i / G) - floor(j / G) - floor(W / G) >= W. Distances go on from the window's edge,
  G times slower: a model trained on N tokens reads about G (N - W) with distances it trained on, and unlike
  "fixed" the far keys keep their order (only keys within one group share a position).

Without positions (or with far keys at one or few distances), attention dilutes as the context grows (more keys share
the mass; "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399, and arXiv 2404.12224), so the far part's
queries may be scaled with the log of the position p (counted in real tokens, from 0):

- "log": 1 + 0.1 · ln(floor((p + 1) / L0) + 1), L0 = `far_query_scale_length` (Llama 4's attention temperature
  tuning: 1 up to L0 tokens, then growing slowly);
- "learned": s_h · ln(p + 1), a weight per head s_h (scalable-softmax's s · log n), starting at
  1 / ln(max_position_embeddings) so that it is 1 at the configured length.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init

#: β of the "log" rule, Llama 4's `attn_scale`
LOG_SCALE_SLOPE = 0.1


def far_positions_of(config, layer_idx: int) -> str:
    """The `far_positions` entry of layer `layer_idx` (a shorter list repeats, as `attn_layers` does)."""
    entries = getattr(config, "far_positions", None) or ("rotary",)
    return entries[layer_idx % len(entries)]


class FarQueryScale(nn.Module):
    """The factor of the far part's queries at each position (module docstring); `weight` [heads] for "learned"."""

    def __init__(self, kind: str, heads: int, floor_length: int, max_positions: int):
        super().__init__()
        self.kind, self.floor_length = kind, floor_length
        self.initial = 1.0 / math.log(max_positions)
        if kind == "learned":
            self.weight = nn.Parameter(torch.full((heads,), self.initial))

    def reset_parameters(self) -> None:
        if self.kind == "learned":
            init.constant_(self.weight, self.initial)

    def forward(self, positions: torch.Tensor, dtype) -> torch.Tensor:
        """[B, heads | 1, L, 1] factors for real positions [B | 1, L]."""
        compute = torch.promote_types(dtype, torch.float32)
        count = positions.to(compute) + 1
        if self.kind == "log":
            factor = 1 + LOG_SCALE_SLOPE * torch.log(torch.floor(count / self.floor_length) + 1)
            return factor[:, None, :, None].to(dtype)
        return (self.weight.to(compute)[None, :, None, None] * torch.log(count)[:, None, :, None]).to(dtype)
