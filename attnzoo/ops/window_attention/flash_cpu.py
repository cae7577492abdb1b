"""Causal sliding-window attention with sinks on the CPU through PyTorch's fused flash-attention kernel.

The sequence is cut into blocks of W = `window` queries. Query t of block c sees its own block up to itself and the
keys of block c - 1 after position t: the window (i - W, i]. Both parts are dense causal attentions, which the fused
kernel computes tile by tile, skipping the tiles above the diagonal, with no mask tensor:

- own block: queries and keys of block c, causal;
- previous block: queries 0 .. W-2 and keys 1 .. W-1 of block c - 1, both reversed: key j > t becomes key j' <= t',
  causal again;
- the sinks (the first S keys, for queries at least W after them): a dense [L, S] product, small;
- with `own_score`, a query's own key is a piece of its own (a constant score), and the own block is causal strictly
  below the diagonal (queries 1 .. W-1 over keys 0 .. W-2).

Each piece gives its output and log-sum-exp; they are merged by their log-sum-exps into the output over all near
keys. The work is about L * W per head, against L^2 / 2 for exact causal attention.

The backward is the kernel's own, run per piece with the merged output and log-sum-exp (what ring attention does
across devices): the kernel recomputes each piece's probabilities from the merged log-sum-exp, so they are the
probabilities of the whole softmax. A gradient on the log-sum-exp (a windowed layer that merges a far part with this
output) enters as one extra feature column: grad_out gets a column of ones and out one of -grad_lse, so the
kernel's row term D = sum(grad_out * out) becomes D - grad_lse, which is the log-sum-exp's contribution to the score
gradients, P * (dP - D + grad_lse).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def flash_cpu_available() -> bool:
    """Whether this PyTorch has the CPU flash-attention kernels (forward and backward) this path calls."""
    return _FORWARD is not None and _BACKWARD is not None


def _blocks(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, nb * w, ...] -> [B, nb, H, w, ...]."""
    return x.unflatten(2, (-1, width)).transpose(1, 2)


def _unblocks(x: torch.Tensor) -> torch.Tensor:
    """[B, nb, H, w, ...] -> [B, H, nb * w, ...]."""
    return x.transpose(1, 2).flatten(2, 3)


ALL = slice(None)
#: each piece of the near part in block layout [B, nb, H, w, ...]: (blocks, items) of its queries, (blocks, items) of
#: its keys, and whether both run reversed (module docstring)
PIECES = {
    "own": ((ALL, ALL), (ALL, ALL), False),
    "own_strict": ((ALL, slice(1, None)), (ALL, slice(None, -1)), False),
    "previous": ((slice(1, None), slice(None, -1)), (slice(None, -1), slice(1, None)), True),
}


def piece_names(blocks: int, width: int, own_score) -> list[str]:
    """The fused pieces a layout needs: the own block (strictly below the diagonal when the own key has a score of
    its own) and, with more than one block, the previous one."""
    names = []
    if own_score is None or width > 1:
        names.append("own" if own_score is None else "own_strict")
    if blocks > 1 and width > 1:
        names.append("previous")
    return names


def take(name: str, x: torch.Tensor, keys: bool) -> torch.Tensor:
    """A piece's queries (keys=False) or keys out of a block tensor, in the order the piece runs."""
    blocks, items = PIECES[name][keys]
    y = x[:, blocks, :, items]
    return y.flip(3) if PIECES[name][2] else y


def put(name: str, full: torch.Tensor, piece: torch.Tensor, keys: bool, add: bool = True) -> None:
    """The inverse of `take`: `piece` added (or copied) into its place in the block tensor `full`."""
    blocks, items = PIECES[name][keys]
    target = full[:, blocks, :, items]
    piece = piece.flip(3) if PIECES[name][2] else piece
    target.add_(piece) if add else target.copy_(piece)


def _flash(q, k, v, scale):
    """The fused causal kernel over [B, nb, H, m, d] pieces: (out [B, nb, H, m, e], lse [B, nb, H, m])."""
    lead = q.shape[:2]
    out, lse = _FORWARD(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), is_causal=True, scale=scale)
    return out.unflatten(0, lead), lse.unflatten(0, lead)


def _flash_backward(grad_out, q, k, v, out, lse, grad_lse, scale):
    """The fused kernel's backward over a piece, with the merged `out` and `lse` at its rows; `grad_lse` (or None)
    enters through one extra feature column (module docstring)."""
    lead, dim, value_dim = q.shape[:2], q.shape[-1], v.shape[-1]
    if grad_lse is not None:
        q, k, v = (F.pad(x, (0, 1)) for x in (q, k, v))
        grad_out = torch.cat([grad_out, torch.ones_like(grad_out[..., :1])], -1)
        out = torch.cat([out, -grad_lse[..., None].to(out.dtype)], -1)
    grads = _BACKWARD(*(x.flatten(0, 1) for x in (grad_out, q, k, v, out)), lse.flatten(0, 1), 0.0, True,
                      scale=scale)
    dq, dk, dv = (g.unflatten(0, lead) for g in grads)
    return dq[..., :dim], dk[..., :dim], dv[..., :value_dim]


class FlashWindowAttention(torch.autograd.Function):
    """(out, lse) of `flash_window_attention`; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, sink_q, window, sinks, scale, own_score):
        length, kv_heads = q.shape[2], (k.shape[1], v.shape[1])
        q, k, v, sink_q = _prepare(q, k, v, sink_q, window)
        out, lse = _merge(q, k, v, sink_q, window, sinks, scale, own_score)
        ctx.save_for_backward(q, k, v, sink_q, out, lse)
        ctx.settings = (length, kv_heads, window, sinks, scale, own_score)
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient, and no extra feature column
        return out[:, :, :length], lse[:, :, :length]

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, sink_q, out, lse = ctx.saved_tensors
        length, kv_heads, window, sinks, scale, own_score = ctx.settings
        pad = q.shape[2] - length
        grad_out = torch.zeros_like(out) if grad_out is None else F.pad(grad_out.to(out.dtype), (0, 0, 0, pad))
        if grad_lse is not None:
            grad_lse = F.pad(grad_lse.to(lse.dtype), (0, pad))
        dq, dk, dv, dsink_q = _merge_backward(q, k, v, sink_q, out, lse, grad_out, grad_lse, window, sinks, scale,
                                              own_score)
        heads = q.shape[1]
        dk, dv = (g[:, :, :length].unflatten(1, (n, heads // n)).sum(2) for g, n in zip((dk, dv), kv_heads,
                                                                                         strict=True))
        return (dq[:, :, :length], dk, dv, None if dsink_q is None else dsink_q[:, :, :length], None, None, None,
                None)


def _prepare(q, k, v, sink_q, window):
    """Padded to whole blocks (the padded queries and keys come after every real one: no real query sees them),
    grouped key/value heads repeated."""
    pad = (-q.shape[2]) % window
    heads = q.shape[1]
    k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x for x in (k, v))
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        sink_q = None if sink_q is None else F.pad(sink_q, (0, 0, 0, pad))
    return q, k, v, sink_q


def _sink_scores(q, sink_q, ks, window, scale):
    """[B, H, Lp, S] scores of the sink columns, -inf where the sink is inside the query's window (or after it)."""
    scores = ((q if sink_q is None else sink_q) @ ks.transpose(-1, -2)) * scale
    index = torch.arange(q.shape[2], device=q.device)
    sink_index = torch.arange(ks.shape[2], device=q.device)
    return scores.masked_fill(index[:, None] - sink_index[None, :] < window, float("-inf"))


def _share(lse, merged):
    """exp(lse - merged): a part's share of a merged softmax, 0 where neither part has a key (-inf - -inf)."""
    return torch.exp(lse - merged).nan_to_num_(0.0)


def _add_piece(out, lse, piece_out, piece_lse):
    """Merge a piece (output and log-sum-exp at the same rows) into `out` and `lse`, in place: the softmax over the
    union of their keys."""
    merged = torch.logaddexp(lse, piece_lse)
    out.mul_(_share(lse, merged).unsqueeze(-1)).add_(piece_out * _share(piece_lse, merged).unsqueeze(-1))
    lse.copy_(merged)


def _merge(q, k, v, sink_q, window, sinks, scale, own_score):
    """Forward over padded, head-repeated inputs: (out [B, H, Lp, e], lse [B, H, Lp]). The pieces are merged in
    block layout, in place, into the first one's output (no buffer per piece)."""
    qb, kb, vb = (_blocks(x, window) for x in (q, k, v))
    names = piece_names(qb.shape[1], window, own_score)
    if names and names[0] == "own":
        out, lse = _flash(qb, kb, vb, scale)
        lse = lse.to(q.dtype)
    else:  # the own block strictly below the diagonal: the first row of each block sees no key there
        out = q.new_zeros(*qb.shape[:-1], v.shape[-1])
        lse = q.new_full(qb.shape[:-1], float("-inf"))
        if names:
            piece_out, piece_lse = _flash(take(names[0], qb, False), take(names[0], kb, True),
                                          take(names[0], vb, True), scale)
            put(names[0], out, piece_out, keys=False, add=False)
            put(names[0], lse, piece_lse.to(q.dtype), keys=False, add=False)
    if "previous" in names:  # one or two fused calls in all, whatever the length
        piece_out, piece_lse = _flash(take("previous", qb, False), take("previous", kb, True),
                                      take("previous", vb, True), scale)
        (blocks, items), _, _ = PIECES["previous"]
        _add_piece(out[:, blocks, :, items], lse[:, blocks, :, items], piece_out.flip(3),
                   piece_lse.flip(3).to(q.dtype))
    count = min(sinks, q.shape[2])
    if count:
        scores = _blocks(_sink_scores(q, sink_q, k[:, :, :count], window, scale), window)  # [B, nb, H, w, S]
        sink_lse = scores.logsumexp(-1)
        merged = torch.logaddexp(lse, sink_lse)
        out.mul_(_share(lse, merged).unsqueeze(-1)).add_(_share(scores, merged.unsqueeze(-1)) @ v[:, None, :, :count])
        lse = merged
    if own_score is not None:
        _add_piece(out, lse, vb, torch.full_like(lse, own_score))
    return _unblocks(out).to(q.dtype), _unblocks(lse)


def _merge_backward(q, k, v, sink_q, out, lse, grad_out, grad_lse, window, sinks, scale, own_score):
    """The backward of `_merge`: (dq, dk, dv, dsink_q or None), keys and values still head-repeated."""
    qb, kb, vb, ob, gb = (_blocks(x, window) for x in (q, k, v, out, grad_out))  # out, lse: the merged ones
    lb = _blocks(lse, window)
    glb = None if grad_lse is None else _blocks(grad_lse, window)
    dqb, dkb, dvb = torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb)
    for name in piece_names(qb.shape[1], window, own_score):
        dq, dk, dv = _flash_backward(take(name, gb, False), take(name, qb, False), take(name, kb, True),
                                     take(name, vb, True), take(name, ob, False), take(name, lb, False),
                                     None if glb is None else take(name, glb, False), scale)
        put(name, dqb, dq, keys=False)
        put(name, dkb, dk, keys=True)
        put(name, dvb, dv, keys=True)
    dq, dk, dv = _unblocks(dqb), _unblocks(dkb), _unblocks(dvb)
    dsink_q = None
    count = min(sinks, q.shape[2])
    row_term = (grad_out * out).sum(-1) - (0.0 if grad_lse is None else grad_lse)  # D - grad_lse
    if count:
        ks, vs = k[:, :, :count], v[:, :, :count]
        sq = q if sink_q is None else sink_q
        probs = torch.exp(_sink_scores(q, sink_q, ks, window, scale) - lse[..., None])  # 0 where masked
        grad_scores = probs * (grad_out @ vs.transpose(-1, -2) - row_term[..., None])
        dsq = (grad_scores @ ks) * scale
        dk[:, :, :count] += (grad_scores.transpose(-1, -2) @ sq) * scale
        dv[:, :, :count] += probs.transpose(-1, -2) @ grad_out
        if sink_q is None:
            dq = dq + dsq
        else:
            dsink_q = dsq
    if own_score is not None:
        dv = dv + torch.exp(own_score - lse)[..., None] * grad_out
    return dq, dk, dv, dsink_q


def flash_window_attention(q, k, v, window: int, sinks: int, scale: float, sink_q=None, own_score=None):
    """(out [B, H, L, e], lse [B, H, L]) of causal sliding-window attention with sinks over real, in-order tokens (as
    `naive.naive_window_attention`), on the CPU kernels; differentiable in q, k, v and sink_q, through both outputs."""
    return FlashWindowAttention.apply(q, k, v, sink_q, window, sinks, scale, own_score)
