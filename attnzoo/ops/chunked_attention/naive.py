"""Reference form of windowed chunk attention: every chunk's window keys copied out ([N, C, W, d]), the scores masked
by `ChunkMask.apply`, and the softmax written out so that autograd differentiates it. The tests compare the fused
and hand-differentiated paths with it, and under torch.compile on the CPU it is the path (the compiler traces plain
ops, and its partitioner decides what to recompute in the backward)."""

from __future__ import annotations

import torch

from attnzoo.ops.chunked_attention.torch_chunks import ChunkMask, mask_values, neighbour_chunks


def naive_chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ChunkMask,
                             scale: float = 1.0, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, C, m, d], lse [N, C, m]) of q, k, v [N, C, m, d] over each chunk's window; `dropout_p` drops
    attention probabilities (not the log-sum-exp).

    Masked scores are -inf, a query's own key (self_penalty) the constant self value; the row maximum is floored at
    the masked value, so a row with no allowed key gets probabilities 0 and that floor as its log-sum-exp. Constant
    scores carry no gradient, so a row left with only its own key passes none to q or k."""
    k_windows = neighbour_chunks(k, mask.before, mask.after, 0, rest_dims=1)  # [N, C, W, d]
    v_windows = neighbour_chunks(v, mask.before, mask.after, 0, rest_dims=1)
    scores = mask.apply((q @ k_windows.transpose(-1, -2)) * scale)
    floor = mask_values(scores.dtype)[0]
    top = scores.amax(-1, keepdim=True).clamp(min=floor).detach()  # cancels: only there for range
    weights = (scores - top).exp()
    total = weights.sum(-1, keepdim=True)  # >= 1 as soon as one key is allowed (its maximum gives 1)
    # 0 -> 1 for rows with nothing allowed; not clamp(min=1), whose gradient vanishes at a total of exactly 1
    total = torch.where(total > 0, total, torch.ones_like(total))
    probs = torch.nn.functional.dropout(weights / total, dropout_p) if dropout_p > 0.0 else weights / total
    return probs @ v_windows, (top + total.log()).squeeze(-1)
