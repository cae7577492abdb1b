"""The blocked PyTorch path of sliding-window attention with sinks: queries in blocks of W, each block's keys its own
block, the block before (and, bidirectionally, the one after) and the sinks, scored in one batched product with the
disallowed keys masked. It takes what the fused CPU path does not (bidirectional layers, dropout, padded queries that
must see only real keys, other devices and dtypes) and is the form the rewrite of the windowed layers kept to the
digit (tests/attention/test_windowed_outputs_unchanged.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnzoo.ops.chunked_attention import mask_values, pad_to_multiple
from attnzoo.ops.window_attention.rule import in_window, outside_window


def window_scores(q, k, v, n_real, window: int, sinks: int, causal: bool, scale: float, sink_q=None):
    """The blocked window-with-sinks scores of left-aligned q, k, v [B, H, L, d] with `n_real` [B] real tokens:
    (scores [B, H, blocks, window, keys] with disallowed keys at the dtype's most negative value, values
    [B, H, blocks, keys, d]). Block c's keys are the sinks, then blocks c - 1 and c (and c + 1 when not causal); a
    sink inside a query's window is counted in the window only; a padded query with nothing to see gets its own
    key. Query rows past L (up to `blocks * window`) are padding. `sink_q` (left-aligned as q): the queries that
    score the sink columns (`sink_queries`), when not q."""
    batch, heads, _, dim = q.shape
    w = window
    q, k, v = (pad_to_multiple(x, w, dim=2) for x in (q, k, v))
    sink_q = q if sink_q is None else pad_to_multiple(sink_q, w, dim=2)
    blocks = q.shape[2] // w
    device = q.device
    position = torch.arange(blocks * w, device=device)
    real = position[None, :] < n_real[:, None]  # [B, Lp]
    neighbours = [-1, 0] if causal else [-1, 0, 1]

    def around(x):  # [B, H, Lp, d] -> [B, H, blocks, len(neighbours) * w, d]: each block's neighbour blocks
        x = x.view(*x.shape[:2], blocks, w, -1)
        padded = F.pad(x, (0, 0, 0, 0, 1, 1))
        return torch.cat([padded[:, :, 1 + n:1 + n + blocks] for n in neighbours], dim=3)

    keys, values = around(k), around(v)
    key_pos = (torch.arange(blocks, device=device)[:, None] * w
               + torch.arange(-w, (len(neighbours) - 1) * w, device=device)[None, :])  # [blocks, n * w]
    in_range = (key_pos >= 0) & (key_pos < blocks * w)
    key_real = real.gather(1, key_pos.clamp(0, blocks * w - 1).flatten()[None].expand(batch, -1)).view(
        batch, blocks, -1) & in_range
    query_pos = position.view(blocks, w)
    gap = query_pos[:, :, None] - key_pos[:, None, :]  # [blocks, w, n * w]
    near = in_window(query_pos[:, :, None], key_pos[:, None, :], w) if causal else gap.abs() < w
    allowed = near[None] & key_real[:, :, None, :]
    own = gap == 0
    sink_count = min(sinks, blocks * w)
    if sink_count:  # a sink inside the query's window is counted there
        sink_pos = torch.arange(sink_count, device=device)
        sink_gap = query_pos[:, :, None] - sink_pos  # [blocks, w, S]
        far = outside_window(query_pos[:, :, None], sink_pos, w) if causal else sink_gap.abs() >= w
        allowed = torch.cat([far[None] & real[:, None, None, :sink_count], allowed], dim=-1)
        values = torch.cat([v[:, :, None, :sink_count].expand(-1, -1, blocks, -1, -1), values], dim=3)
        own = torch.cat([torch.zeros_like(far), own], dim=-1)
    allowed = allowed | (~allowed.any(-1, keepdim=True) & own[None])
    scores = torch.einsum("bhcqd,bhckd->bhcqk", q.view(batch, heads, blocks, w, dim), keys)
    if sink_count:
        sink_scores = torch.einsum("bhcqd,bhkd->bhcqk", sink_q.view(batch, heads, blocks, w, dim), k[:, :, :sink_count])
        scores = torch.cat([sink_scores, scores], dim=-1)
    scores = scores * scale
    return scores.masked_fill(~allowed[:, None], mask_values(scores.dtype)[0]), values


def blocked_window_attention(q, k, v, n_real, window: int, sinks: int, causal: bool, scale: float, sink_q=None,
                             own_score=None, dropout: float = 0.0, training: bool = False):
    """(out [B, H, L, e], lse [B, H, L]) of left-aligned q [B, H, L, d] and k, v [B, H, L, .] (heads repeated) with
    `n_real` [B] real tokens, through `window_scores`. `own_score` replaces each query's own score (a causal layer's
    large finite penalty: LSH's shared QK); `dropout` drops near probabilities in training (not the log-sum-exp)."""
    batch, heads, length, _ = q.shape
    w = window
    scores, values = window_scores(q, k, v, n_real, w, sinks, causal, scale, sink_q)  # [B, H, blocks, w, keys]
    blocks, num_keys = scores.shape[2], scores.shape[-1]
    if own_score is not None:  # block row i's own key is window column w + i, after the sink columns
        own_column = min(sinks, blocks * w) + w + torch.arange(w, device=q.device)
        own = torch.arange(num_keys, device=q.device)[None, :] == own_column[:, None]  # [w, keys]
        scores = scores.masked_fill(own, own_score)
    top = scores.amax(-1, keepdim=True).detach()
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    probs = weights / total
    if dropout > 0.0 and training:
        probs = F.dropout(probs, dropout)
    out = torch.einsum("bhcqk,bhckd->bhcqd", probs, values).reshape(batch, heads, blocks * w, -1)[:, :, :length]
    lse = (top + total.log()).reshape(batch, heads, blocks * w)[:, :, :length]
    return out, lse
