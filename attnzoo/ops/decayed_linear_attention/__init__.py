"""Decayed causal linear attention: the exact, overflow-free causal form of Performer, elu+1 and causal LARA.

    out_t = Σ_{s<=t} a_ts v_s / Σ_{s<=t} a_ts,   a_ts = (φq_t · φk_s) exp(M_s - M_t),

where M_t is the running maximum of the key log-features up to t and φk_s is already scaled by exp(-M_s): the
running max replaces one maximum over the whole sequence, so no output depends on later tokens and every factor is
at most 1 (docs/kernels.md). Backends: `torch_chunk` (vectorised PyTorch chunks, the CPU path) and `triton_chunk`
(fused kernels, CUDA); `naive` holds the quadratic reference.
"""

from __future__ import annotations

import torch

from attnzoo.ops.decayed_linear_attention.torch_chunk import (
    chunked_decayed_linear_attention,
    decayed_cumsum,
    decayed_linear_attention_step,
)
from attnzoo.ops.triton_utils import resolve_backend

__all__ = ["decayed_linear_attention", "decayed_linear_attention_step", "decayed_cumsum"]

TRITON_CHUNK_SIZES = (16, 32, 64, 128)


def _check_inputs(phi_q, phi_k, v, running_max, chunk_size, initial_state) -> None:
    if phi_q.dim() != 4 or phi_k.shape != phi_q.shape:
        raise ValueError(f"phi_q and phi_k must both be [B, H, N, r]; got {tuple(phi_q.shape)} and "
                         f"{tuple(phi_k.shape)}.")
    batch, heads, length, features = phi_q.shape
    if v.dim() != 4 or v.shape[:3] != phi_q.shape[:3]:
        raise ValueError(f"v must be [B, H, N, e] with the B, H, N of phi_q {tuple(phi_q.shape[:3])}; got "
                         f"{tuple(v.shape)}.")
    if running_max.shape != phi_q.shape[:3]:
        raise ValueError(f"running_max must be [B, H, N] = {tuple(phi_q.shape[:3])}; got {tuple(running_max.shape)}.")
    if length == 0:
        raise ValueError("the sequence is empty (N = 0): pass at least one position.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: use a positive integer (64 is a good default).")
    if initial_state is not None:
        if len(initial_state) != 3:
            raise ValueError("initial_state must be (S [B, H, r, e], z [B, H, r], M [B, H]).")
        s0, z0, m0 = initial_state
        expected = ((batch, heads, features, v.shape[-1]), (batch, heads, features), (batch, heads))
        if (tuple(s0.shape), tuple(z0.shape), tuple(m0.shape)) != expected:
            raise ValueError(f"initial_state shapes must be S {expected[0]}, z {expected[1]}, M {expected[2]}; got "
                             f"{tuple(s0.shape)}, {tuple(z0.shape)}, {tuple(m0.shape)}.")


def decayed_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, running_max: torch.Tensor,
                             chunk_size: int = 64, initial_state: tuple | None = None, return_state: bool = False,
                             backend: str = "auto"):
    """Decayed causal linear attention (module docstring), differentiable in phi_q, phi_k, v and the initial state.

    Args:
        phi_q: [B, H, N, r] nonnegative query features, each row divided by its own maximum (entries <= 1).
        phi_k: [B, H, N, r] nonnegative key features, key s scaled by exp(-M_s) (entries <= 1).
        v: [B, H, N, e] values.
        running_max: [B, H, N] nondecreasing running maximum M (detached: it gets no gradient).
        chunk_size: positions per chunk (any N: the tail chunk is padded/masked). The Triton backend takes 16, 32,
            64 or 128.
        initial_state: (S [B, H, r, e], z [B, H, r], M0 [B, H]) of keys before these positions, relative to their
            running max M0 (as `return_state` gives it), to continue from a prefill. M0 <= running_max keeps every
            factor <= 1 (the result is exact either way).
        return_state: also return the state (S, z, M) after the last position.
        backend: "torch" (chunked PyTorch), "triton" (fused kernels: CUDA, or the CPU under TRITON_INTERPRET=1) or
            "auto" (Triton on CUDA when importable and the kernels take the inputs: a chunk size they have and no
            float64; else PyTorch).

    Returns out [B, H, N, e] in float32 (float64 when an input is float64, torch backend; the Triton backend always
    accumulates and returns float32), plus (S, z, M) with `return_state`. A row whose weights are all 0 (it sees no
    key) outputs 0; its gradients are those of num / den.clamp_min(tiny), as in `random_features._ratio`.
    """
    _check_inputs(phi_q, phi_k, v, running_max, chunk_size, initial_state)
    odd_chunks = (None if chunk_size in TRITON_CHUNK_SIZES else
                  f"chunk_size={chunk_size} (the Triton kernels take one of {TRITON_CHUNK_SIZES})")
    if resolve_backend(backend, phi_q, "decayed_linear_attention", odd_chunks) == "torch":
        return chunked_decayed_linear_attention(phi_q, phi_k, v, running_max, chunk_size, initial_state,
                                                return_state)
    from attnzoo.ops.decayed_linear_attention.triton_chunk import TritonDecayedLinearAttention

    s0, z0, m0 = initial_state if initial_state is not None else (None, None, None)
    out, s_last, z_last = TritonDecayedLinearAttention.apply(phi_q, phi_k, v, running_max, s0, z0, m0, chunk_size)
    if not return_state:
        return out
    return out, (s_last, z_last, running_max[..., -1].detach())
