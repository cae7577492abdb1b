"""Reference form of causal sliding-window attention with sinks: dense [L, L] scores, the near mask written out, the
softmax by autograd. The fused paths are tested against it (values, log-sum-exp and gradients)."""

from __future__ import annotations

import torch


def near_mask(length: int, window: int, sinks: int, device=None) -> torch.Tensor:
    """[L, L] bool: key j is near query i when 0 <= i - j < window (the window) or j < sinks (a sink; one inside the
    window is the window's)."""
    index = torch.arange(length, device=device)
    gap = index[:, None] - index[None, :]
    return (gap >= 0) & ((gap < window) | (index[None, :] < sinks))


def naive_window_attention(q, k, v, window: int, sinks: int, scale: float, sink_q=None, own_score=None):
    """(out [B, H, L, e], lse [B, H, L]) of queries q [B, H, L, d] over their near keys among k [B, Hkv, L, d], v
    [B, Hkv, L, e] (grouped heads: query head h reads key head h // (H / Hkv)), every token real and in order. A
    sink outside the query's window is scored by `sink_q` when given; `own_score`, when given, replaces the score of
    each query's own key (a constant: no gradient through it)."""
    heads, length = q.shape[1], q.shape[2]
    k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    index = torch.arange(length, device=q.device)
    if sink_q is not None:
        as_sink = (index[None, :] < sinks) & (index[:, None] - index[None, :] >= window)
        scores = torch.where(as_sink, (sink_q @ k.transpose(-1, -2)) * scale, scores)
    if own_score is not None:
        scores = torch.where(torch.eye(length, dtype=torch.bool, device=q.device), own_score, scores)
    scores = scores.masked_fill(~near_mask(length, window, sinks, q.device), float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)
