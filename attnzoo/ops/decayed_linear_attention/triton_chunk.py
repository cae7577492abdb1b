"""Decayed causal linear attention as Triton kernels (CUDA; verified on the CPU with Triton's interpreter).

Notation as in `torch_chunk`: chunks of BT positions, E_j the running max at the end of chunk j, and the state
entering chunk j, h_j = Σ_{s in chunks < j} exp(M_s - E_{j-1}) φk_s v_sᵀ (r × e) with its key sum hz_j (r), relative
to E_{j-1} (to M0 for chunk 0 when an initial state is given). Grids put B·H on their last axis and tile the feature
dims r and e by BK and BV (<= 64, masked at the edges), so r and e up to 256 and any N (the tail chunk is masked).

Forward (2 kernels):
  _states_forward   grid (r/BK, e/BV, B·H): walks the chunks in order with the state tile in registers, writes
                    every h_j (float32, [B·H, C, r, e]) and the final state:
                    S <- exp(E_{j-1} - E_j) S + (φk ⊙ exp(M - E_j))ᵀ v.
  _output_forward   grid (e/BV, C, B·H): per chunk, exp(E_{j-1} - M_t) φq_t h_j plus the [BT, BT] decayed causal
                    scores of the chunk; writes out = num / den (float32) and den (kept for the backward).
Backward (3 kernels): with dnum = dO / den and dden = -(dO · out) / den (a_ts enters num and den linearly),
  _states_forward   again, to recompute h_j: the states are not kept from the forward, which would hold C·r·e floats
                    per head from the forward to the backward of every layer; recomputing them is one more pass of
                    2·N·r·e multiply-adds, cheaper than the rest of the backward.
  _states_backward  grid (r/BK, e/BV, B·H): walks the chunks backwards; dh_j = Σ_{t in chunks > j} exp(E_j - M_t)
                    φq_t dnum_tᵀ (and dz_j with dden), starting from the final state's gradient, ending with the
                    initial state's.
  _chunk_backward   grid (C, B·H): per chunk, the scores A and dP = (dnum vᵀ + dden) ⊙ decay, then
                    dv = Aᵀ dnum + exp(M_s - E_j) φk dh_j, dφq = dP φk + exp(E_{j-1} - M_t)(dnum h_jᵀ + dden hz_j),
                    dφk = dPᵀ φq + exp(M_s - E_j)(v dh_jᵀ + dz_j). Each program owns its chunk's rows: no atomics.
Dot operands are in the inputs' dtype (float32 accumulation); float32 inputs use TF32 only when PyTorch's
`torch.backends.cuda.matmul.allow_tf32` is on.
"""

from __future__ import annotations

import torch

try:  # optional: callers import this module only where Triton can run (inside `try`, so remote code needs no Triton)
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError("the fused kernels need Triton (pip install triton); the PyTorch path needs nothing") from err

from attnzoo.ops.triton_utils import dot_precision, feature_block

TINY = torch.finfo(torch.float32).tiny


@triton.jit
def _chunk_start(m, m0, j, BT: tl.constexpr, HAS_INITIAL: tl.constexpr):
    """The level the state entering chunk j is expressed against: E_{j-1}, or M0 (initial state) / M_0 for j = 0."""
    previous = tl.load(m + tl.maximum(j * BT - 1, 0))
    if HAS_INITIAL:
        previous = tl.where(j == 0, tl.load(m0), previous)
    return previous


@triton.jit
def _states_forward(k, v, m, h, hz, s0, z0, m0, s_last, z_last, N, R, E, NUM_CHUNKS,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL: tl.constexpr,
                    PRECISION: tl.constexpr):
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rk = i_k * BK + tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    tile = (rk[:, None] < R) & (rv[None, :] < E)
    tile_offsets = rk[:, None] * E + rv[None, :]
    k += i_bh * N * R
    v += i_bh * N * E
    m += i_bh * N
    h += i_bh * NUM_CHUNKS * R * E
    hz += i_bh * NUM_CHUNKS * R
    state = tl.zeros([BK, BV], dtype=tl.float32)
    key_sum = tl.zeros([BK], dtype=tl.float32)
    if HAS_INITIAL:
        state = tl.load(s0 + i_bh * R * E + tile_offsets, mask=tile, other=0.0)
        key_sum = tl.load(z0 + i_bh * R + rk, mask=rk < R, other=0.0)
    for j in range(NUM_CHUNKS):
        tl.store(h + j * R * E + tile_offsets, state, mask=tile)
        if i_v == 0:
            tl.store(hz + j * R + rk, key_sum, mask=rk < R)
        t = j * BT + tl.arange(0, BT)
        rows = t < N
        level = tl.load(m + tl.minimum(t, N - 1))
        end = tl.load(m + tl.minimum(j * BT + BT - 1, N - 1))
        start = _chunk_start(m, m0 + i_bh, j, BT, HAS_INITIAL)
        keys = tl.load(k + t[:, None] * R + rk[None, :], mask=rows[:, None] & (rk[None, :] < R), other=0.0)
        values = tl.load(v + t[:, None] * E + rv[None, :], mask=rows[:, None] & (rv[None, :] < E), other=0.0)
        keys = keys.to(tl.float32) * tl.exp(level - end)[:, None]  # relative to the chunk's end: <= 1
        decay = tl.exp(start - end)
        state = state * decay + tl.dot(tl.trans(keys.to(values.dtype)), values, input_precision=PRECISION)
        key_sum = key_sum * decay + tl.sum(keys, axis=0)
    tl.store(s_last + i_bh * R * E + tile_offsets, state, mask=tile)
    if i_v == 0:
        tl.store(z_last + i_bh * R + rk, key_sum, mask=rk < R)


@triton.jit
def _output_forward(q, k, v, m, m0, h, hz, out, den, N, R, E, NUM_CHUNKS, TINY_VALUE,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL: tl.constexpr,
                    PRECISION: tl.constexpr):
    i_v, j, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rv = i_v * BV + tl.arange(0, BV)
    t = j * BT + tl.arange(0, BT)
    rows = t < N
    q += i_bh * N * R
    k += i_bh * N * R
    v += i_bh * N * E
    m += i_bh * N
    h += (i_bh * NUM_CHUNKS + j) * R * E
    hz += (i_bh * NUM_CHUNKS + j) * R
    level = tl.load(m + tl.minimum(t, N - 1))
    start = _chunk_start(m, m0 + i_bh, j, BT, HAS_INITIAL)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    num = tl.zeros([BT, BV], dtype=tl.float32)
    total = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(R, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        cols = rows[:, None] & (rk[None, :] < R)
        queries = tl.load(q + t[:, None] * R + rk[None, :], mask=cols, other=0.0)
        keys = tl.load(k + t[:, None] * R + rk[None, :], mask=cols, other=0.0)
        scores += tl.dot(queries, tl.trans(keys), input_precision=PRECISION)
        state = tl.load(h + rk[:, None] * E + rv[None, :], mask=(rk[:, None] < R) & (rv[None, :] < E), other=0.0)
        num += tl.dot(queries, state.to(queries.dtype), input_precision=PRECISION)
        key_sum = tl.load(hz + rk, mask=rk < R, other=0.0)
        total += tl.sum(queries.to(tl.float32) * key_sum[None, :], axis=1)
    reading = tl.exp(start - level)  # the earlier chunks' state decayed to each query: <= 1
    num *= reading[:, None]
    total *= reading
    earlier = tl.arange(0, BT)[None, :] <= tl.arange(0, BT)[:, None]
    scores *= tl.exp(tl.where(earlier, level[None, :] - level[:, None], float("-inf")))
    values = tl.load(v + t[:, None] * E + rv[None, :], mask=rows[:, None] & (rv[None, :] < E), other=0.0)
    num += tl.dot(scores.to(values.dtype), values, input_precision=PRECISION)
    total += tl.sum(scores, axis=1)
    result = num / tl.maximum(total, TINY_VALUE)[:, None]
    tl.store(out + i_bh * N * E + t[:, None] * E + rv[None, :], result, mask=rows[:, None] & (rv[None, :] < E))
    if i_v == 0:
        tl.store(den + i_bh * N + t, total, mask=rows)


@triton.jit
def _states_backward(q, dnum, dden, m, m0, dh, dhz, ds_last, dz_last, ds0, dz0, N, R, E, NUM_CHUNKS,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL: tl.constexpr,
                     HAS_FINAL_GRAD: tl.constexpr, PRECISION: tl.constexpr):
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rk = i_k * BK + tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    tile = (rk[:, None] < R) & (rv[None, :] < E)
    tile_offsets = rk[:, None] * E + rv[None, :]
    q += i_bh * N * R
    dnum += i_bh * N * E
    dden += i_bh * N
    m += i_bh * N
    dh += i_bh * NUM_CHUNKS * R * E
    dhz += i_bh * NUM_CHUNKS * R
    grad_state = tl.zeros([BK, BV], dtype=tl.float32)
    grad_key_sum = tl.zeros([BK], dtype=tl.float32)
    if HAS_FINAL_GRAD:  # the final state is read by a virtual query right after the last position
        grad_state = tl.load(ds_last + i_bh * R * E + tile_offsets, mask=tile, other=0.0)
        grad_key_sum = tl.load(dz_last + i_bh * R + rk, mask=rk < R, other=0.0)
    for step in range(NUM_CHUNKS):
        j = NUM_CHUNKS - 1 - step
        tl.store(dh + j * R * E + tile_offsets, grad_state, mask=tile)
        if i_v == 0:
            tl.store(dhz + j * R + rk, grad_key_sum, mask=rk < R)
        t = j * BT + tl.arange(0, BT)
        rows = t < N
        level = tl.load(m + tl.minimum(t, N - 1))
        end = tl.load(m + tl.minimum(j * BT + BT - 1, N - 1))
        start = _chunk_start(m, m0 + i_bh, j, BT, HAS_INITIAL)
        queries = tl.load(q + t[:, None] * R + rk[None, :], mask=rows[:, None] & (rk[None, :] < R), other=0.0)
        grads = tl.load(dnum + t[:, None] * E + rv[None, :], mask=rows[:, None] & (rv[None, :] < E), other=0.0)
        grad_den = tl.load(dden + t, mask=rows, other=0.0)
        queries = queries.to(tl.float32) * tl.exp(start - level)[:, None]  # relative to the chunk's start: <= 1
        decay = tl.exp(start - end)
        grad_state = grad_state * decay + tl.dot(tl.trans(queries.to(q.dtype.element_ty)),
                                                 grads.to(q.dtype.element_ty), input_precision=PRECISION)
        grad_key_sum = grad_key_sum * decay + tl.sum(queries * grad_den[:, None], axis=0)
    if HAS_INITIAL:
        tl.store(ds0 + i_bh * R * E + tile_offsets, grad_state, mask=tile)
        if i_v == 0:
            tl.store(dz0 + i_bh * R + rk, grad_key_sum, mask=rk < R)


@triton.jit
def _chunk_backward(q, k, v, m, m0, h, hz, dh, dhz, dnum, dden, dq, dk, dv, N, R, E, NUM_CHUNKS,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL: tl.constexpr,
                    PRECISION: tl.constexpr):
    j, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    t = j * BT + tl.arange(0, BT)
    rows = t < N
    q += i_bh * N * R
    k += i_bh * N * R
    dq += i_bh * N * R
    dk += i_bh * N * R
    v += i_bh * N * E
    dv += i_bh * N * E
    dnum += i_bh * N * E
    m += i_bh * N
    h += (i_bh * NUM_CHUNKS + j) * R * E
    dh += (i_bh * NUM_CHUNKS + j) * R * E
    hz += (i_bh * NUM_CHUNKS + j) * R
    dhz += (i_bh * NUM_CHUNKS + j) * R
    dtype = q.dtype.element_ty
    level = tl.load(m + tl.minimum(t, N - 1))
    start = _chunk_start(m, m0 + i_bh, j, BT, HAS_INITIAL)
    end = tl.load(m + tl.minimum(j * BT + BT - 1, N - 1))
    query_decay = tl.exp(start - level)  # <= 1
    key_decay = tl.exp(level - end)  # <= 1
    grad_den = tl.load(dden + i_bh * N + t, mask=rows, other=0.0)

    scores = tl.zeros([BT, BT], dtype=tl.float32)
    grad_scores = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(R, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        cols = rows[:, None] & (rk[None, :] < R)
        queries = tl.load(q + t[:, None] * R + rk[None, :], mask=cols, other=0.0)
        keys = tl.load(k + t[:, None] * R + rk[None, :], mask=cols, other=0.0)
        scores += tl.dot(queries, tl.trans(keys), input_precision=PRECISION)
    for i_v in range(tl.cdiv(E, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        cols = rows[:, None] & (rv[None, :] < E)
        grads = tl.load(dnum + t[:, None] * E + rv[None, :], mask=cols, other=0.0)
        values = tl.load(v + t[:, None] * E + rv[None, :], mask=cols, other=0.0)
        grad_scores += tl.dot(grads.to(dtype), tl.trans(values), input_precision=PRECISION)
    earlier = tl.arange(0, BT)[None, :] <= tl.arange(0, BT)[:, None]
    decay = tl.exp(tl.where(earlier, level[None, :] - level[:, None], float("-inf")))
    scores = (scores * decay).to(dtype)  # A_ts
    grad_scores = ((grad_scores + grad_den[:, None]) * decay).to(dtype)  # dA_ts ⊙ decay

    for i_v in range(tl.cdiv(E, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        cols = rows[:, None] & (rv[None, :] < E)
        grads = tl.load(dnum + t[:, None] * E + rv[None, :], mask=cols, other=0.0)
        grad_values = tl.dot(tl.trans(scores), grads.to(dtype), input_precision=PRECISION)
        later = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(R, BK)):
            rk = i_k * BK + tl.arange(0, BK)
            keys = tl.load(k + t[:, None] * R + rk[None, :], mask=rows[:, None] & (rk[None, :] < R), other=0.0)
            grad_state = tl.load(dh + rk[:, None] * E + rv[None, :], mask=(rk[:, None] < R) & (rv[None, :] < E),
                                 other=0.0)
            later += tl.dot(keys, grad_state.to(dtype), input_precision=PRECISION)
        grad_values += key_decay[:, None] * later
        tl.store(dv + t[:, None] * E + rv[None, :], grad_values, mask=cols)

    for i_k in range(tl.cdiv(R, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        cols = rows[:, None] & (rk[None, :] < R)
        queries = tl.load(q + t[:, None] * R + rk[None, :], mask=cols, other=0.0)
        keys = tl.load(k + t[:, None] * R + rk[None, :], mask=cols, other=0.0)
        grad_queries = tl.dot(grad_scores, keys, input_precision=PRECISION)
        grad_keys = tl.dot(tl.trans(grad_scores), queries, input_precision=PRECISION)
        from_state = tl.zeros([BT, BK], dtype=tl.float32)
        from_later = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(E, BV)):
            rv = i_v * BV + tl.arange(0, BV)
            value_cols = rows[:, None] & (rv[None, :] < E)
            grads = tl.load(dnum + t[:, None] * E + rv[None, :], mask=value_cols, other=0.0)
            values = tl.load(v + t[:, None] * E + rv[None, :], mask=value_cols, other=0.0)
            tile = (rk[:, None] < R) & (rv[None, :] < E)
            state = tl.load(h + rk[:, None] * E + rv[None, :], mask=tile, other=0.0)
            grad_state = tl.load(dh + rk[:, None] * E + rv[None, :], mask=tile, other=0.0)
            from_state += tl.dot(grads.to(dtype), tl.trans(state.to(dtype)), input_precision=PRECISION)
            from_later += tl.dot(values, tl.trans(grad_state.to(dtype)), input_precision=PRECISION)
        key_sum = tl.load(hz + rk, mask=rk < R, other=0.0)
        grad_key_sum = tl.load(dhz + rk, mask=rk < R, other=0.0)
        grad_queries += query_decay[:, None] * (from_state + grad_den[:, None] * key_sum[None, :])
        grad_keys += key_decay[:, None] * (from_later + grad_key_sum[None, :])
        tl.store(dq + t[:, None] * R + rk[None, :], grad_queries, mask=cols)
        tl.store(dk + t[:, None] * R + rk[None, :], grad_keys, mask=cols)


class _Launch:
    """Shapes, tiles and flags shared by the launches of one call."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, chunk_size: int, has_initial: bool):
        self.bh, self.n, self.r = q.shape
        self.e = v.shape[-1]
        self.bt = chunk_size
        self.chunks = triton.cdiv(self.n, chunk_size)
        self.bk, self.bv = feature_block(self.r), feature_block(self.e)
        self.has_initial = has_initial
        self.precision = dot_precision(q.dtype)

    def meta(self):
        return dict(BT=self.bt, BK=self.bk, BV=self.bv, HAS_INITIAL=self.has_initial, PRECISION=self.precision)

    def state_grid(self):
        return (triton.cdiv(self.r, self.bk), triton.cdiv(self.e, self.bv), self.bh)

    def states(self, k, v, m, s0, z0, m0):
        """(h [B·H, C, r, e], hz [B·H, C, r], final S, final z), all float32."""
        h = k.new_empty(self.bh, self.chunks, self.r, self.e, dtype=torch.float32)
        hz = k.new_empty(self.bh, self.chunks, self.r, dtype=torch.float32)
        s_last = k.new_empty(self.bh, self.r, self.e, dtype=torch.float32)
        z_last = k.new_empty(self.bh, self.r, dtype=torch.float32)
        _states_forward[self.state_grid()](k, v, m, h, hz, s0, z0, m0, s_last, z_last, self.n, self.r, self.e,
                                           self.chunks, **self.meta())
        return h, hz, s_last, z_last


def _flat(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:]).to(dtype).contiguous()


class TritonDecayedLinearAttention(torch.autograd.Function):
    """(φq, φk, v [B, H, N, ·], running_max [B, H, N], S0, z0, M0 or None, chunk_size) -> (out [B, H, N, e] float32,
    final S [B, H, r, e], final z [B, H, r]), differentiable in φq, φk, v, S0, z0 (and through the final state)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, running_max, s0, z0, m0, chunk_size):
        batch, heads, length, _ = phi_q.shape
        dtype = phi_q.dtype
        q, k, vv = _flat(phi_q, dtype), _flat(phi_k, dtype), _flat(v, dtype)
        m = _flat(running_max.detach(), torch.float32)
        has_initial = s0 is not None
        ctx.dtypes = (phi_q.dtype, phi_k.dtype, v.dtype, s0.dtype if has_initial else None,
                      z0.dtype if has_initial else None)
        if has_initial:
            s0, z0, m0 = _flat(s0, torch.float32), _flat(z0, torch.float32), _flat(m0.detach(), torch.float32)
        else:  # never read (HAS_INITIAL is off); any float32 tensor will do as the pointer
            s0 = z0 = m0 = m
        launch = _Launch(q, vv, chunk_size, has_initial)
        h, hz, s_last, z_last = launch.states(k, vv, m, s0, z0, m0)
        out = q.new_empty(launch.bh, length, launch.e, dtype=torch.float32)
        den = q.new_empty(launch.bh, length, dtype=torch.float32)
        _output_forward[(triton.cdiv(launch.e, launch.bv), launch.chunks, launch.bh)](
            q, k, vv, m, m0, h, hz, out, den, length, launch.r, launch.e, launch.chunks, TINY, **launch.meta())
        del h, hz
        ctx.save_for_backward(q, k, vv, m, s0, z0, m0, out, den)
        ctx.launch, ctx.shape = launch, (batch, heads)
        out = out.view(batch, heads, length, launch.e)
        return out, s_last.view(batch, heads, launch.r, launch.e), z_last.view(batch, heads, launch.r)

    @staticmethod
    def backward(ctx, grad_out, grad_s_last, grad_z_last):
        q, k, vv, m, s0, z0, m0, out, den = ctx.saved_tensors
        launch = ctx.launch
        batch, heads = ctx.shape
        # out = num / den with den clamped as in the forward: the gradients autograd would give that formula.
        den = den.clamp_min(TINY)
        grad_out = grad_out.reshape(out.shape).float() if grad_out is not None else torch.zeros_like(out)
        dnum = (grad_out / den[..., None]).contiguous()
        dden = (-(grad_out * out).sum(-1) / den).contiguous()
        has_final_grad = grad_s_last is not None or grad_z_last is not None
        ds_last = _flat(grad_s_last, torch.float32) if grad_s_last is not None else None
        dz_last = _flat(grad_z_last, torch.float32) if grad_z_last is not None else None
        if has_final_grad:
            ds_last = ds_last if ds_last is not None else q.new_zeros(launch.bh, launch.r, launch.e,
                                                                      dtype=torch.float32)
            dz_last = dz_last if dz_last is not None else q.new_zeros(launch.bh, launch.r, dtype=torch.float32)
        else:
            ds_last = dz_last = dnum  # pointers never read
        h, hz, _, _ = launch.states(k, vv, m, s0, z0, m0)
        dh = torch.empty_like(h)
        dhz = torch.empty_like(hz)
        ds0 = torch.empty_like(s0) if launch.has_initial else dnum
        dz0 = torch.empty_like(z0) if launch.has_initial else dnum
        _states_backward[launch.state_grid()](q, dnum, dden, m, m0, dh, dhz, ds_last, dz_last, ds0, dz0, launch.n,
                                              launch.r, launch.e, launch.chunks, HAS_FINAL_GRAD=has_final_grad,
                                              **launch.meta())
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.empty(vv.shape, dtype=torch.float32, device=q.device)
        _chunk_backward[(launch.chunks, launch.bh)](q, k, vv, m, m0, h, hz, dh, dhz, dnum, dden, dq, dk, dv,
                                                    launch.n, launch.r, launch.e, launch.chunks, **launch.meta())
        shape = (batch, heads, launch.n)
        q_dtype, k_dtype, v_dtype, s0_dtype, z0_dtype = ctx.dtypes
        grads = [dq.view(*shape, launch.r).to(q_dtype), dk.view(*shape, launch.r).to(k_dtype),
                 dv.view(*shape, launch.e).to(v_dtype), None]
        if launch.has_initial:
            grads += [ds0.view(batch, heads, launch.r, launch.e).to(s0_dtype),
                      dz0.view(batch, heads, launch.r).to(z0_dtype), None]
        else:
            grads += [None, None, None]
        return (*grads, None)
