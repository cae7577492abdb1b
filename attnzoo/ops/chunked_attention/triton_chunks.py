"""Windowed chunk attention as flash-attention-style Triton kernels (CUDA; verified on the CPU with Triton's
interpreter). Same contract as `torch_chunks.chunked_attention` without dropout: q, k, v [N, C, m, d] and a
`ChunkMask` -> (out [N, C, m, d], lse [N, C, m]), differentiable in q, k, v through both outputs.

The dense [m, W] masks are never built: every kernel recomputes a tile's mask in registers from the per-position
integers of the `ChunkMask` (read with their own strides, so broadcast metadata is not copied):
    allowed = valid[key] and (groups: same group, window-slot offset in group_band) and (causal: pos[key] <= pos[q])
              and (rounds: for each earlier round e < n mod R, not lo <= loc_e[key] - loc_e[q] <= hi);
    score   = scale q·k if allowed else -inf, and the self value for a query's own key (self_penalty).
Key chunks beyond the row's ends are skipped (they are always masked). The row maximum starts at the masked floor,
so a row with no allowed key gets probabilities 0 and lse = floor, as in `torch_chunks._softmax_`.

Kernels (grids put the N rows last, then the C chunks, then blocks of BM queries or BN keys of a chunk):
  _chunk_forward   one program per (query block, chunk, row): loops over the before + 1 + after key chunks of its
                    window with an online softmax; writes out (inputs' dtype) and lse (float32).
  _chunk_dq        one program per query block: recomputes P = exp(S - lse), dP = dO vᵀ and
                    dS = P ⊙ (dP - rowsum(dO ⊙ O) + dlse) (the log-sum-exp's own gradient enters here) and sums dS k.
  _chunk_dkdv      key-centric, one program per (key block, chunk, row): a key chunk is in the windows of the query
                    chunks c_key - after .. c_key + before, and this program loops over exactly those, summing
                    dv = Pᵀ dO and dk = dSᵀ q in registers. Every dk/dv row has one owner, so no atomics and the
                    result is deterministic; the price is computing the scores twice in the backward (once per
                    kernel), as flash attention's separate-dq variant does.
dS is zeroed at a query's own key (its score is a constant) and in rows whose lse is at or below half the self value
(only the own key, or nothing, was allowed), as `torch_chunks.ChunkedAttentionFunction.backward` does.
"""

from __future__ import annotations

import torch

try:  # optional: callers import this module only where Triton can run (inside `try`, so remote code needs no Triton)
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError("the fused kernels need Triton (pip install triton); the PyTorch path needs nothing") from err

from attnzoo.ops.chunked_attention.torch_chunks import ChunkMask, mask_values
from attnzoo.ops.triton_utils import dot_precision, feature_block


@triton.jit
def _masked_scores(scores, n, c, c_key, i, j, m, rounds,
                   positions, p_sn, p_sc, p_si, valid, v_sn, v_sc, v_si, groups, g_sn, g_sc, g_si,
                   locations, l_sn, l_sc, l_si, l_sr, group_lo, group_hi, round_lo, round_hi, self_value,
                   CAUSAL: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_ROUNDS: tl.constexpr,
                   SELF_PENALTY: tl.constexpr):
    """Scaled scores [BM, BN] of queries i of chunk c against keys j of chunk c_key (row n), masked."""
    rows = i < m
    cols = j < m
    allowed = rows[:, None] & (tl.load(valid + n * v_sn + c_key * v_sc + j * v_si, mask=cols, other=0) != 0)[None, :]
    if HAS_GROUPS:
        offset = (c_key - c) * m + j[None, :] - i[:, None]  # key slot - query slot in the window order
        group_q = tl.load(groups + n * g_sn + c * g_sc + i * g_si, mask=rows, other=-1)
        group_k = tl.load(groups + n * g_sn + c_key * g_sc + j * g_si, mask=cols, other=-2)
        allowed = allowed & (offset >= group_lo) & (offset <= group_hi) & (group_k[None, :] == group_q[:, None])
    if CAUSAL:
        position_q = tl.load(positions + n * p_sn + c * p_sc + i * p_si, mask=rows, other=0)
        position_k = tl.load(positions + n * p_sn + c_key * p_sc + j * p_si, mask=cols, other=0)
        allowed = allowed & (position_k[None, :] <= position_q[:, None])
    if HAS_ROUNDS:
        # rows come in groups of `rounds` (the round innermost): row n is round n % rounds, and drops the keys an
        # earlier round listed as candidates of its query
        for earlier in range(n % rounds):
            location_q = tl.load(locations + n * l_sn + c * l_sc + i * l_si + earlier * l_sr, mask=rows, other=0)
            location_k = tl.load(locations + n * l_sn + c_key * l_sc + j * l_si + earlier * l_sr, mask=cols,
                                 other=0)
            gap = location_k[None, :] - location_q[:, None]
            allowed = allowed & ((gap < round_lo) | (gap > round_hi))
    scores = tl.where(allowed, scores, float("-inf"))
    if SELF_PENALTY:
        scores = tl.where((c_key == c) & (j[None, :] == i[:, None]) & rows[:, None], self_value, scores)
    return scores


@triton.jit
def _chunk_forward(q, k, v, out, lse, C, m, D, rounds, scale, floor, self_value, group_lo, group_hi, round_lo,
                    round_hi, positions, p_sn, p_sc, p_si, valid, v_sn, v_sc, v_si, groups, g_sn, g_sc, g_si,
                    locations, l_sn, l_sc, l_si, l_sr,
                    BEFORE: tl.constexpr, AFTER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BD: tl.constexpr, CAUSAL: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_ROUNDS: tl.constexpr,
                    SELF_PENALTY: tl.constexpr, PRECISION: tl.constexpr):
    i_m, c, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = i_m * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rows = i < m
    row_base = (n.to(tl.int64) * C + c) * m
    queries = tl.load(q + (row_base + i)[:, None] * D + rd[None, :], mask=rows[:, None] & (rd[None, :] < D),
                      other=0.0)
    top = tl.zeros([BM], dtype=tl.float32) + floor
    total = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for block in tl.static_range(BEFORE + 1 + AFTER):
        c_key = c + block - BEFORE
        if (c_key >= 0) & (c_key < C):
            key_base = (n.to(tl.int64) * C + c_key) * m
            for i_n in range(tl.cdiv(m, BN)):
                j = i_n * BN + tl.arange(0, BN)
                tile = (j[:, None] < m) & (rd[None, :] < D)
                keys = tl.load(k + (key_base + j)[:, None] * D + rd[None, :], mask=tile, other=0.0)
                values = tl.load(v + (key_base + j)[:, None] * D + rd[None, :], mask=tile, other=0.0)
                scores = tl.dot(queries, tl.trans(keys), input_precision=PRECISION) * scale
                scores = _masked_scores(scores, n, c, c_key, i, j, m, rounds, positions, p_sn, p_sc, p_si, valid,
                                        v_sn, v_sc, v_si, groups, g_sn, g_sc, g_si, locations, l_sn, l_sc, l_si,
                                        l_sr, group_lo, group_hi, round_lo, round_hi, self_value, CAUSAL,
                                        HAS_GROUPS, HAS_ROUNDS, SELF_PENALTY)
                new_top = tl.maximum(top, tl.max(scores, axis=1))
                rescale = tl.exp(top - new_top)
                weights = tl.exp(scores - new_top[:, None])
                total = total * rescale + tl.sum(weights, axis=1)
                acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=PRECISION)
                top = new_top
    total = tl.maximum(total, 1.0)  # >= 1 whenever a key is allowed; 0 -> 1 for a row with none
    tl.store(out + (row_base + i)[:, None] * D + rd[None, :], acc / total[:, None],
             mask=rows[:, None] & (rd[None, :] < D))
    tl.store(lse + row_base + i, top + tl.log(total), mask=rows)


@triton.jit
def _score_gradients(queries, keys, values, grad_out, row_lse, row_delta, n, c, c_key, i, j, m, rounds, scale,
                     self_value, group_lo, group_hi, round_lo, round_hi, positions, p_sn, p_sc, p_si, valid, v_sn,
                     v_sc, v_si, groups, g_sn, g_sc, g_si, locations, l_sn, l_sc, l_si, l_sr,
                     CAUSAL: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_ROUNDS: tl.constexpr,
                     SELF_PENALTY: tl.constexpr, PRECISION: tl.constexpr):
    """(P, dS) [BM, BN] of a query tile against a key tile, recomputed from the saved lse."""
    scores = tl.dot(queries, tl.trans(keys), input_precision=PRECISION) * scale
    scores = _masked_scores(scores, n, c, c_key, i, j, m, rounds, positions, p_sn, p_sc, p_si, valid, v_sn, v_sc,
                            v_si, groups, g_sn, g_sc, g_si, locations, l_sn, l_sc, l_si, l_sr, group_lo, group_hi,
                            round_lo, round_hi, self_value, CAUSAL, HAS_GROUPS, HAS_ROUNDS, SELF_PENALTY)
    probs = tl.exp(scores - row_lse[:, None])
    grad_probs = tl.dot(grad_out, tl.trans(values), input_precision=PRECISION)
    grad_scores = probs * (grad_probs - row_delta[:, None])
    # constant scores pass no gradient: a query's own key, and rows that had nothing else
    live = (row_lse > self_value / 2)[:, None]
    if SELF_PENALTY:
        live = live & ((c_key != c) | (j[None, :] != i[:, None]))
    return probs, tl.where(live, grad_scores, 0.0)


@triton.jit
def _chunk_dq(q, k, v, grad_out, lse, delta, grad_q, C, m, D, rounds, scale, self_value, group_lo, group_hi,
               round_lo, round_hi, positions, p_sn, p_sc, p_si, valid, v_sn, v_sc, v_si, groups, g_sn, g_sc, g_si,
               locations, l_sn, l_sc, l_si, l_sr,
               BEFORE: tl.constexpr, AFTER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_ROUNDS: tl.constexpr,
               SELF_PENALTY: tl.constexpr, PRECISION: tl.constexpr):
    i_m, c, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = i_m * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rows = i < m
    row_base = (n.to(tl.int64) * C + c) * m
    tile_q = rows[:, None] & (rd[None, :] < D)
    queries = tl.load(q + (row_base + i)[:, None] * D + rd[None, :], mask=tile_q, other=0.0)
    grads = tl.load(grad_out + (row_base + i)[:, None] * D + rd[None, :], mask=tile_q, other=0.0)
    row_lse = tl.load(lse + row_base + i, mask=rows, other=float("inf"))
    row_delta = tl.load(delta + row_base + i, mask=rows, other=0.0)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for block in tl.static_range(BEFORE + 1 + AFTER):
        c_key = c + block - BEFORE
        if (c_key >= 0) & (c_key < C):
            key_base = (n.to(tl.int64) * C + c_key) * m
            for i_n in range(tl.cdiv(m, BN)):
                j = i_n * BN + tl.arange(0, BN)
                tile = (j[:, None] < m) & (rd[None, :] < D)
                keys = tl.load(k + (key_base + j)[:, None] * D + rd[None, :], mask=tile, other=0.0)
                values = tl.load(v + (key_base + j)[:, None] * D + rd[None, :], mask=tile, other=0.0)
                _, grad_scores = _score_gradients(
                    queries, keys, values, grads, row_lse, row_delta, n, c, c_key, i, j, m, rounds, scale,
                    self_value, group_lo, group_hi, round_lo, round_hi, positions, p_sn, p_sc, p_si, valid, v_sn,
                    v_sc, v_si, groups, g_sn, g_sc, g_si, locations, l_sn, l_sc, l_si, l_sr, CAUSAL, HAS_GROUPS,
                    HAS_ROUNDS, SELF_PENALTY, PRECISION)
                acc += tl.dot(grad_scores.to(keys.dtype), keys, input_precision=PRECISION)
    tl.store(grad_q + (row_base + i)[:, None] * D + rd[None, :], acc * scale, mask=tile_q)


@triton.jit
def _chunk_dkdv(q, k, v, grad_out, lse, delta, grad_k, grad_v, C, m, D, rounds, scale, self_value, group_lo,
                 group_hi, round_lo, round_hi, positions, p_sn, p_sc, p_si, valid, v_sn, v_sc, v_si, groups, g_sn,
                 g_sc, g_si, locations, l_sn, l_sc, l_si, l_sr,
                 BEFORE: tl.constexpr, AFTER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_ROUNDS: tl.constexpr,
                 SELF_PENALTY: tl.constexpr, PRECISION: tl.constexpr):
    i_n, c_key, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j = i_n * BN + tl.arange(0, BN)
    rd = tl.arange(0, BD)
    key_base = (n.to(tl.int64) * C + c_key) * m
    tile_k = (j[:, None] < m) & (rd[None, :] < D)
    keys = tl.load(k + (key_base + j)[:, None] * D + rd[None, :], mask=tile_k, other=0.0)
    values = tl.load(v + (key_base + j)[:, None] * D + rd[None, :], mask=tile_k, other=0.0)
    acc_k = tl.zeros([BN, BD], dtype=tl.float32)
    acc_v = tl.zeros([BN, BD], dtype=tl.float32)
    # the key chunk is block `block` of query chunk c_key - (block - BEFORE)'s window
    for block in tl.static_range(BEFORE + 1 + AFTER):
        c = c_key - (block - BEFORE)
        if (c >= 0) & (c < C):
            row_base = (n.to(tl.int64) * C + c) * m
            for i_m in range(tl.cdiv(m, BM)):
                i = i_m * BM + tl.arange(0, BM)
                rows = i < m
                tile_q = rows[:, None] & (rd[None, :] < D)
                queries = tl.load(q + (row_base + i)[:, None] * D + rd[None, :], mask=tile_q, other=0.0)
                grads = tl.load(grad_out + (row_base + i)[:, None] * D + rd[None, :], mask=tile_q, other=0.0)
                row_lse = tl.load(lse + row_base + i, mask=rows, other=float("inf"))
                row_delta = tl.load(delta + row_base + i, mask=rows, other=0.0)
                probs, grad_scores = _score_gradients(
                    queries, keys, values, grads, row_lse, row_delta, n, c, c_key, i, j, m, rounds, scale,
                    self_value, group_lo, group_hi, round_lo, round_hi, positions, p_sn, p_sc, p_si, valid, v_sn,
                    v_sc, v_si, groups, g_sn, g_sc, g_si, locations, l_sn, l_sc, l_si, l_sr, CAUSAL, HAS_GROUPS,
                    HAS_ROUNDS, SELF_PENALTY, PRECISION)
                acc_v += tl.dot(tl.trans(probs.to(grads.dtype)), grads, input_precision=PRECISION)
                acc_k += tl.dot(tl.trans(grad_scores.to(queries.dtype)), queries, input_precision=PRECISION)
    tl.store(grad_k + (key_base + j)[:, None] * D + rd[None, :], acc_k * scale, mask=tile_k)
    tl.store(grad_v + (key_base + j)[:, None] * D + rd[None, :], acc_v, mask=tile_k)


def _metadata(mask: ChunkMask) -> tuple[list, dict]:
    """The mask's per-position tensors with their strides (no copies of broadcast metadata), and its flags."""
    positions = mask.positions
    valid = mask.valid.view(torch.uint8) if mask.valid.dtype == torch.bool else mask.valid
    groups = mask.groups if mask.groups is not None else positions
    rounds = mask.round_locations.shape[-1] if mask.round_locations is not None else 1
    locations = mask.round_locations if rounds > 1 else positions.unsqueeze(-1)
    group_lo, group_hi = mask.group_band
    round_lo, round_hi = mask.round_band
    args = [rounds, group_lo, group_hi, round_lo, round_hi, positions, *positions.stride(), valid, *valid.stride(),
            groups, *groups.stride(), locations, *locations.stride()]
    flags = dict(BEFORE=mask.before, AFTER=mask.after, CAUSAL=mask.causal, HAS_GROUPS=mask.groups is not None,
                 HAS_ROUNDS=rounds > 1, SELF_PENALTY=mask.self_penalty)
    return args, flags


def _tiles(m: int, d: int) -> dict:
    return dict(BM=feature_block(m), BN=feature_block(m), BD=feature_block(d, largest=256))


class TritonChunkedAttention(torch.autograd.Function):
    """(q, k, v [N, C, m, d], mask, scale) -> (out [N, C, m, d], lse [N, C, m]), both in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, mask: ChunkMask, scale: float):
        rows, chunks, m, d = q.shape
        q, k, v = (x.contiguous() for x in (q, k, v))
        floor, self_value = mask_values(q.dtype)
        metadata, flags = _metadata(mask)
        tiles = _tiles(m, d)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        rounds, *rest = metadata
        _chunk_forward[(triton.cdiv(m, tiles["BM"]), chunks, rows)](
            q, k, v, out, lse, chunks, m, d, rounds, scale, floor, self_value, *rest, **flags, **tiles,
            PRECISION=dot_precision(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out, lse.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale = ctx.mask, ctx.scale
        rows, chunks, m, d = q.shape
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(q.dtype).contiguous()
        # rowsum(dO ⊙ O) - dlse: the softmax backward with the log-sum-exp's own gradient
        delta = (grad_out.float() * out.float()).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse.float()
        _, self_value = mask_values(q.dtype)
        metadata, flags = _metadata(mask)
        tiles = _tiles(m, d)
        rounds, *rest = metadata
        common = dict(**flags, **tiles, PRECISION=dot_precision(q.dtype))
        grad_q = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        grad_k = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        grad_v = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        _chunk_dq[(triton.cdiv(m, tiles["BM"]), chunks, rows)](
            q, k, v, grad_out, lse, delta.contiguous(), grad_q, chunks, m, d, rounds, scale, self_value, *rest,
            **common)
        _chunk_dkdv[(triton.cdiv(m, tiles["BN"]), chunks, rows)](
            q, k, v, grad_out, lse, delta.contiguous(), grad_k, grad_v, chunks, m, d, rounds, scale, self_value,
            *rest, **common)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None
