"""Fused attention ops, one folder each (a PyTorch path, a naive reference beside it, and Triton kernels for CUDA):

- `decayed_linear_attention`: exact causal linear attention with a running-max normaliser (Performer, elu+1, LARA).
- `chunked_attention`: chunked attention over neighbouring-chunk windows with LSH/local masks (Reformer).

See docs/kernels.md for the math, the kernels' structure and how they are tested.
"""

from attnzoo.ops.chunked_attention import chunked_attention
from attnzoo.ops.decayed_linear_attention import decayed_linear_attention, decayed_linear_attention_step

__all__ = ["decayed_linear_attention", "decayed_linear_attention_step", "chunked_attention"]
