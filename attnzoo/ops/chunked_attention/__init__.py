"""Windowed chunk attention, the core of Reformer's LSH and local attention, with fused backends.

q, k, v [N, C, m, d] (C chunks of m queries per row), each chunk attending to its own chunk, `before` chunks back and
`after` ahead, with the keys a query may use described by a `ChunkMask`; returns (out [N, C, m, d], lse [N, C, m])
with gradients through both.

Backends: "torch" (`torch_chunks`: the PyTorch path, the CPU path and the reference of the others), "triton"
(`triton_chunks`: fused flash-style kernels), "flex" (`flex`: PyTorch's FlexAttention with a block mask; backward on
CUDA only). `naive` holds a dense reference written for autograd.
"""

from __future__ import annotations

import torch

from attnzoo.ops.chunked_attention.torch_chunks import ChunkMask, mask_values, pad_to_multiple
from attnzoo.ops.chunked_attention.torch_chunks import chunked_attention as torch_chunked_attention
from attnzoo.ops.triton_utils import resolve_backend

# The mask description and the two helpers callers build it with are part of the op's interface.
__all__ = ["ChunkMask", "mask_values", "pad_to_multiple", "chunked_attention"]

CHUNK_BACKENDS = ("auto", "torch", "triton", "flex")


def _check_inputs(q, k, v, mask: ChunkMask) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k and v must all be [N, C, m, d]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}.")
    if tuple(mask.positions.shape) != tuple(q.shape[:3]) or tuple(mask.valid.shape) != tuple(q.shape[:3]):
        raise ValueError(f"the mask's positions and valid must be [N, C, m] = {tuple(q.shape[:3])}; got "
                         f"{tuple(mask.positions.shape)} and {tuple(mask.valid.shape)}.")
    if mask.round_locations is not None and q.shape[0] % mask.round_locations.shape[-1]:
        raise ValueError(f"round_locations lists {mask.round_locations.shape[-1]} hash rounds, but there are "
                         f"{q.shape[0]} rows: pass whole groups of rows, one row per round with the round innermost.")


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ChunkMask, scale: float = 1.0,
                       dropout_p: float = 0.0, save_probs: bool = False, backend: str = "auto"):
    """Chunked attention over each chunk's window -> (out [N, C, m, d], lse [N, C, m]), both in q's dtype.

    backend: "auto" (Triton on CUDA when importable and the inputs are not float64, else PyTorch), "torch",
    "triton" (CUDA, or the CPU under TRITON_INTERPRET=1) or "flex" (FlexAttention; forward only on the CPU). The fused
    backends have no dropout: with dropout_p > 0 every backend runs the PyTorch path, which samples the dropout mask
    itself. `save_probs` (PyTorch path) keeps the probabilities for the backward instead of recomputing them.
    """
    if backend not in CHUNK_BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {CHUNK_BACKENDS}.")
    _check_inputs(q, k, v, mask)
    if torch.compiler.is_compiling() and not q.is_cuda:
        # The hand-written backward (an autograd.Function) does not trace with dynamic shapes inside a checkpointed
        # reversible block; the plain-ops form does, and the compiler fuses it.
        from attnzoo.ops.chunked_attention.naive import naive_chunked_attention

        return naive_chunked_attention(q, k, v, mask, scale, dropout_p)
    if dropout_p > 0.0:
        return torch_chunked_attention(q, k, v, mask, scale, dropout_p, save_probs)
    if backend == "flex":
        from attnzoo.ops.chunked_attention.flex import flex_chunked_attention

        return flex_chunked_attention(q, k, v, mask, scale)
    if resolve_backend(backend, q, "chunked_attention") == "torch":
        return torch_chunked_attention(q, k, v, mask, scale, 0.0, save_probs)
    from attnzoo.ops.chunked_attention.triton_chunks import TritonChunkedAttention

    return TritonChunkedAttention.apply(q, k, v, mask, scale)
