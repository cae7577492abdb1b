"""Chunked attention with neighbouring-chunk windows: the batching device shared by LSH and local attention.

Queries come in chunks of `m` consecutive positions of some order (the hash-sorted order for LSH, the sequence
for local attention); each chunk attends to the keys of its own chunk, of `before` chunks before it and of `after`
chunks after it (seed 001 §2, Figure 2d). Which of those keys a query may really use is described by a
`WindowMask` of small per-position integer tensors, from which the dense [m, window] masks are rebuilt on demand.

`windowed_attention` is an autograd Function: it keeps only the inputs, the output and the log-sum-exp for the
backward pass and recomputes the scores there (as flash attention does), so the [chunks, m, window] score and
probability tensors exist only transiently; it returns the log-sum-exp too, with its gradient, because LSH combines
hash rounds through it (Appendix A, eq. 14).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Masked scores get a large finite value (not -inf), so a row whose keys are all masked stays finite (seed 001,
#: Appendix A; trax and transformers do the same); the self-attention penalty is smaller so a token attends to
#: itself only when nothing else is allowed. Half precision needs values it can represent.
MASK_VALUES = {torch.float16: (-1e4, -1e3)}
DEFAULT_MASK_VALUES = (-1e9, -1e5)


def mask_values(dtype: torch.dtype) -> tuple[float, float]:
    """(masked, self) score values for a dtype."""
    return MASK_VALUES.get(dtype, DEFAULT_MASK_VALUES)


def fold_windows(grad: torch.Tensor, before: int, after: int, chunk_dim: int) -> torch.Tensor:
    """The adjoint of `windows` for vectors [..., C, W, d]: add each window block's gradient back onto the chunk it
    was copied from."""
    if before == 0 and after == 0:
        return grad
    num_chunks = grad.shape[chunk_dim]
    blocks = grad.unflatten(chunk_dim + 1, (before + 1 + after, -1))
    out_shape = list(blocks.shape)
    del out_shape[chunk_dim + 1]
    out_shape[chunk_dim] = num_chunks + before + after
    total = blocks.new_zeros(out_shape)
    for offset in range(before + 1 + after):
        total.narrow(chunk_dim, offset, num_chunks).add_(blocks.select(chunk_dim + 1, offset))
    return total.narrow(chunk_dim, before, num_chunks)


def windows(x: torch.Tensor, before: int, after: int, fill=0, rest_dims: int = 0) -> torch.Tensor:
    """[..., C, m, *rest] chunks (`rest_dims` trailing feature dims) -> [..., C, (before + 1 + after) * m, *rest]:
    each chunk's neighbourhood, from `before` chunks back to `after` ahead, with `fill` beyond the ends (no
    wrap-around, eq. 11)."""
    if before == 0 and after == 0:
        return x
    chunk_dim = x.dim() - 2 - rest_dims
    num_chunks = x.shape[chunk_dim]
    pad = [0, 0] * (rest_dims + 1) + [before, after]
    if x.dtype == torch.bool:
        padded = F.pad(x.to(torch.uint8), pad, value=int(fill)).bool()
    else:
        padded = F.pad(x, pad, value=fill)
    # One copy of the window per chunk: the keys' share of the work is small next to the [m, W] scores.
    shifted = [padded.narrow(chunk_dim, offset, num_chunks) for offset in range(before + 1 + after)]
    return torch.cat(shifted, dim=chunk_dim + 1)


@dataclass
class WindowMask:
    """Which window keys each query may attend to, from per-position tensors in chunk layout.

    Shapes use N (flattened batch dims), C chunks of m queries, and W = (before + 1 + after) * m window keys.
    - positions [N, C, m]: original sequence positions (causality, self-attention).
    - valid [N, C, m]: real keys (False for padding).
    - causal: a query sees keys at positions <= its own.
    - self_penalty: a query's own key gets the large finite self value instead of its score (shared-QK).
    - band_locations [N, C, m] with band=(lo, hi): additionally require lo <= loc(key) - loc(query) <= hi.
    - count_locations [N, C, m, R] with count_band=(lo, hi): subtract log(number of rounds r with
      lo <= loc_r(key) - loc_r(query) <= hi) from the score (LSH's duplicate correction, Appendix A eq. 16).
    """

    positions: torch.Tensor
    valid: torch.Tensor
    before: int
    after: int
    causal: bool = False
    self_penalty: bool = False
    band_locations: torch.Tensor | None = None
    band: tuple[int, int] = (0, 0)
    count_locations: torch.Tensor | None = None
    count_band: tuple[int, int] = (0, 0)

    def window(self, x: torch.Tensor, fill, rest_dims: int = 0) -> torch.Tensor:
        return windows(x, self.before, self.after, fill, rest_dims)

    def build(self, dtype: torch.dtype):
        """(allowed [N, C, m, W] bool, self [N, C, m, W] bool or None, log_count [N, C, m, W] or None)."""
        q_pos = self.positions.unsqueeze(-1)
        k_pos = self.window(self.positions, -1).unsqueeze(-2)
        allowed = self.window(self.valid, False).unsqueeze(-2)
        if self.causal:
            allowed = allowed & (k_pos <= q_pos)
        else:
            allowed = allowed.expand(*q_pos.shape[:-1], k_pos.shape[-1])
        if self.band_locations is not None:
            allowed = allowed & _in_band(self.band_locations, self.window(self.band_locations, 0), self.band)
        self_mask = (k_pos == q_pos) if self.self_penalty else None
        log_count = None
        if self.count_locations is not None and self.count_locations.shape[-1] > 1:
            k_locs = self.window(self.count_locations, 0, rest_dims=1)
            count = torch.zeros(allowed.shape, dtype=torch.uint8, device=allowed.device)
            # One round at a time: the [N, C, m, W] comparisons are the largest tensors here.
            for r in range(self.count_locations.shape[-1]):
                count += _in_band(self.count_locations[..., r], k_locs[..., r], self.count_band)
            log_table = torch.log(torch.arange(self.count_locations.shape[-1] + 1, device=count.device,
                                               dtype=dtype).clamp(min=1))
            log_count = log_table[count.long()]
        return allowed, self_mask, log_count


def _in_band(q_loc: torch.Tensor, k_loc: torch.Tensor, band: tuple[int, int]) -> torch.Tensor:
    lo, hi = band
    q = q_loc.unsqueeze(-1)
    k = k_loc.unsqueeze(-2)
    return (k >= q + lo) & (k <= q + hi)


def _scores(q, k_win, mask: WindowMask, scale: float):
    scores = torch.matmul(q, k_win.transpose(-1, -2))
    if scale != 1.0:
        scores.mul_(scale)
    allowed, self_mask, log_count = mask.build(scores.dtype)
    masked_value, self_value = mask_values(scores.dtype)
    if log_count is not None:
        scores.sub_(log_count)
    scores.masked_fill_(~allowed, masked_value)
    if self_mask is not None:
        scores.masked_fill_(self_mask, self_value)
    # Entries replaced by a constant carry no gradient to the dot product.
    replaced = ~allowed if self_mask is None else (~allowed) | self_mask
    return scores, replaced


class WindowedAttention(torch.autograd.Function):
    """(q [N, C, m, d], k [N, C, m, d], v [N, C, m, d], mask, scale, dropout_p) -> (out [N, C, m, d], lse [N, C, m])."""

    @staticmethod
    def forward(ctx, q, k, v, mask: WindowMask, scale: float, dropout_p: float):
        before, after = mask.before, mask.after
        k_win, v_win = mask.window(k, 0, rest_dims=1), mask.window(v, 0, rest_dims=1)
        scores, _ = _scores(q, k_win, mask, scale)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = scores.sub_(lse).exp_()
        keep = None
        if dropout_p > 0.0:
            keep = torch.rand_like(probs) >= dropout_p
            probs.mul_(keep).div_(1.0 - dropout_p)
        out = torch.matmul(probs, v_win)
        del probs, scores, k_win, v_win
        ctx.mask, ctx.scale, ctx.dropout_p, ctx.window = mask, scale, dropout_p, (before, after)
        ctx.save_for_backward(q, k, v, out, lse, keep)
        return out, lse.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, keep = ctx.saved_tensors
        mask, scale, dropout_p = ctx.mask, ctx.scale, ctx.dropout_p
        before, after = ctx.window
        chunk_dim = q.dim() - 3
        k_win, v_win = mask.window(k, 0, rest_dims=1), mask.window(v, 0, rest_dims=1)
        scores, replaced = _scores(q, k_win, mask, scale)
        probs = scores.sub_(lse).exp_()
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        # d(probs): the gradient reaching the (undropped) probabilities.
        grad_probs = torch.matmul(grad_out, v_win.transpose(-1, -2))
        if keep is not None:
            dropped = probs * keep / (1.0 - dropout_p)
            grad_v_win = torch.matmul(dropped.transpose(-1, -2), grad_out)
            del dropped
            grad_probs.mul_(keep).div_(1.0 - dropout_p)
        else:
            grad_v_win = torch.matmul(probs.transpose(-1, -2), grad_out)
        # Softmax backward with the log-sum-exp's own gradient: dS = P * (dP - rowsum(dO * O) + dlse).
        delta = (grad_out * out).sum(-1, keepdim=True)
        if grad_lse is not None:
            delta = delta - grad_lse.unsqueeze(-1)
        grad_scores = grad_probs.sub_(delta).mul_(probs)
        del probs, scores
        grad_scores.masked_fill_(replaced, 0.0)
        if scale != 1.0:
            grad_scores.mul_(scale)
        grad_q = torch.matmul(grad_scores, k_win)
        grad_k_win = torch.matmul(grad_scores.transpose(-1, -2), q)
        grad_k = fold_windows(grad_k_win, before, after, chunk_dim)
        grad_v = fold_windows(grad_v_win, before, after, chunk_dim)
        return grad_q, grad_k, grad_v, None, None, None


def windowed_attention(q, k, v, mask: WindowMask, scale: float = 1.0, dropout_p: float = 0.0):
    """Chunked attention over each chunk's window; returns (out [N, C, m, d], lse [N, C, m])."""
    return WindowedAttention.apply(q, k, v, mask, scale, dropout_p)


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int, value=0) -> torch.Tensor:
    """Pad `dim` of x at the end to a multiple of `multiple`."""
    extra = (-x.shape[dim]) % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, extra]
    if x.dtype == torch.bool:
        return F.pad(x.to(torch.uint8), pad, value=int(value)).bool()
    return F.pad(x, pad, value=value)


def ceil_to(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple
