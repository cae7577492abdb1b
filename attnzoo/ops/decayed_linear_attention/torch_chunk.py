"""Decayed causal linear attention in PyTorch, chunked and vectorised (the CPU path), and its one-step recurrent
form for decoding.

    out_t = Σ_{s<=t} a_ts v_s / Σ_{s<=t} a_ts,   a_ts = (φq_t · φk_s) exp(M_s - M_t)

with M the running maximum of the key log-features (nondecreasing, detached). Every factor is at most 1, so nothing
overflows (docs/kernels.md). The denominator rides along as one extra value column of ones, so every state below is
[r, e + 1]: its last column is the key sum z.

Chunks of T positions: the state after chunk j, relative to its last running maximum E_j, is
S_j = Σ_{s in chunks <= j} exp(M_s - E_j) φk_s v_sᵀ. A query t of chunk j reads exp(E_{j-1} - M_t) φq_tᵀ S_{j-1} plus
its own chunk's keys through the [T, T] decayed scores. The states of all chunks come from `decayed_cumsum`, a
vectorised decayed prefix sum (no loop over chunks): memory O(N·T + (N/T)·r·e).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Positions per block of `decayed_cumsum`: each level is a [G, G] decay-matrix product over blocks of G entries,
#: and the G-fold shorter sequence of block totals is summed the same way (a level per factor G of the length).
SCAN_BLOCK = 32


def decay_matrix(levels: torch.Tensor) -> torch.Tensor:
    """[..., L] nondecreasing levels E -> [..., L, L] lower-triangular D[j, i] = exp(E_i - E_j) for i <= j (each
    at most 1), 0 above the diagonal (set to -inf before the exponential, so nothing there can overflow)."""
    length = levels.shape[-1]
    later = torch.ones(length, length, dtype=torch.bool, device=levels.device).triu(1)
    return (levels[..., None, :] - levels[..., :, None]).masked_fill_(later, float("-inf")).exp_()


def decayed_cumsum(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Y_j = Σ_{i<=j} exp(E_i - E_j) X_i along dim -2 of x [..., L, F], for nondecreasing levels E [..., L].

    Exact and overflow-free without logarithms: blocks of `SCAN_BLOCK` entries are summed by a [G, G] decay-matrix
    product (all factors <= 1), each block's total (relative to its last level) is carried into the later blocks
    by the same sum over the block totals, one level shorter, and decayed by exp(E_end(b-1) - E_j) <= 1. Work
    O(L·G·F), a few batched matmuls per level; autograd differentiates it (the decays are constants)."""
    length = x.shape[-2]
    if length <= SCAN_BLOCK:
        return decay_matrix(levels) @ x
    pad = (-length) % SCAN_BLOCK
    if pad:  # repeat the last level (decay 1) and add zeros: the padded entries change nothing before them
        levels = torch.cat([levels, levels[..., -1:].expand(*levels.shape[:-1], pad)], dim=-1)
        x = F.pad(x, (0, 0, 0, pad))
    blocks = levels.unflatten(-1, (-1, SCAN_BLOCK))  # [..., nb, G]
    within = decay_matrix(blocks) @ x.unflatten(-2, (-1, SCAN_BLOCK))  # [..., nb, G, F]
    ends = blocks[..., -1]
    totals = decayed_cumsum(within[..., -1, :], ends)  # [..., nb, F]: everything up to each block's end
    carry = (ends[..., :-1, None] - blocks[..., 1:, :]).exp_().unsqueeze(-1) * totals[..., :-1, None, :]
    out = torch.cat([within[..., :1, :, :], within[..., 1:, :, :] + carry], dim=-3)
    return out.flatten(-3, -2)[..., :length, :]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _ratio(num_and_den: torch.Tensor) -> torch.Tensor:
    """[..., e + 1] (numerator, denominator) -> numerator / denominator; a row that sees no key (denominator 0)
    outputs 0, not NaN (as `random_features._ratio` does)."""
    den = num_and_den[..., -1:]
    return num_and_den[..., :-1] / den.clamp_min(torch.finfo(den.dtype).tiny)


def chunked_decayed_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                                     running_max: torch.Tensor, chunk_size: int = 64,
                                     initial_state: tuple | None = None, return_state: bool = False):
    """The chunked PyTorch form; see the module docstring and `decayed_linear_attention` for the contract.

    Computes in float32 (float64 when an input is float64) and returns that dtype; with `return_state`, also the
    state (S [B, H, r, e], z [B, H, r], M [B, H]) after the last position."""
    batch, heads, length, features = phi_q.shape
    dtype = _compute_dtype(phi_q, phi_k, v)
    q, k = phi_q.to(dtype), phi_k.to(dtype)
    values = torch.cat([v.to(dtype), v.new_ones(*v.shape[:-1], 1, dtype=dtype)], dim=-1)  # [.., N, e + 1]
    levels = running_max.detach().to(dtype)
    pad = (-length) % chunk_size
    if pad:  # zero keys, queries and values; the running max keeps its last value
        q, k, values = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, values))
        levels = torch.cat([levels, levels[..., -1:].expand(batch, heads, pad)], dim=-1)
    q, k, values = (t.unflatten(-2, (-1, chunk_size)) for t in (q, k, values))  # [B, H, C, T, .]
    levels = levels.unflatten(-1, (-1, chunk_size))  # [B, H, C, T]
    ends = levels[..., -1]  # E_j: the running max at the end of each chunk

    # Keys of the query's own chunk: (φq φkᵀ) ⊙ exp(M_s - M_t), lower triangle.
    num = ((q @ k.transpose(-1, -2)) * decay_matrix(levels)) @ values
    chunks = q.shape[2]
    states = None
    if chunks > 1 or return_state:
        # Each chunk's keys relative to its end, then all chunks' states at once.
        local = (k * (levels - ends[..., None]).exp().unsqueeze(-1)).transpose(-1, -2) @ values  # [.., C, r, e+1]
        states = decayed_cumsum(local.flatten(-2), ends).unflatten(-1, local.shape[-2:])
    if chunks > 1:
        # Query t of chunk j >= 1 reads the state after chunk j - 1, decayed by exp(E_{j-1} - M_t) <= 1.
        reading = q[:, :, 1:] * (ends[..., :-1, None] - levels[:, :, 1:]).exp().unsqueeze(-1)
        num = torch.cat([num[:, :, :1], num[:, :, 1:] + reading @ states[:, :, :-1]], dim=2)
    if initial_state is not None:
        # Keys before this call, as a state relative to their running max M0: decayed by exp(M0 - M_t) <= 1.
        s0, z0, m0 = initial_state
        before = torch.cat([s0.to(dtype), z0.to(dtype).unsqueeze(-1)], dim=-1)  # [B, H, r, e + 1]
        start = m0.detach().to(dtype)[..., None, None]
        num = num + (q * (start - levels).exp().unsqueeze(-1)) @ before.unsqueeze(2)
    out = _ratio(num).flatten(2, 3)[:, :, :length]
    if not return_state:
        return out
    final = states[:, :, -1]  # relative to the last running max
    if initial_state is not None:
        final = final + (start[..., 0] - ends[..., -1:]).exp().unsqueeze(-1) * before
    return out, (final[..., :-1], final[..., -1], running_max[..., -1].detach())


def decayed_linear_attention_step(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                                  running_max: torch.Tensor, state: tuple | None):
    """One decoding step: S <- exp(M_old - M_t) S + φk_t v_tᵀ, z likewise, out = φq_tᵀ S / φq_tᵀ z.

    phi_q, phi_k [B, H, 1, r] (φk_t scaled by exp(-M_t)), v [B, H, 1, e], running_max [B, H, 1] (M_t >= M_old keeps
    every factor <= 1), state (S [B, H, r, e], z [B, H, r], M_old [B, H]) or None before the first token. Several
    new tokens at once go through the chunked form. Returns (out [B, H, 1, e], new state)."""
    if phi_q.shape[2] != 1:
        return chunked_decayed_linear_attention(phi_q, phi_k, v, running_max, initial_state=state,
                                                return_state=True)
    dtype = _compute_dtype(phi_q, phi_k, v)
    q, k, value = phi_q[:, :, 0].to(dtype), phi_k[:, :, 0].to(dtype), v[:, :, 0].to(dtype)
    level = running_max[..., 0].detach()
    if state is None:
        s, z = k[..., :, None] * value[..., None, :], k
    else:
        s_old, z_old, m_old = state
        decay = (m_old.detach() - level).exp().to(dtype)
        s = s_old.to(dtype) * decay[..., None, None] + k[..., :, None] * value[..., None, :]
        z = z_old.to(dtype) * decay[..., None] + k
    num = torch.cat([(q[..., None, :] @ s)[..., 0, :], (q * z).sum(-1, keepdim=True)], dim=-1)
    return _ratio(num).unsqueeze(2), (s, z, level)
