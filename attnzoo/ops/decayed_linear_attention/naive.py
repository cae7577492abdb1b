"""Reference forms of decayed causal linear attention: the quadratic masked form and the final recurrent state,
written out in plain PyTorch (any dtype, float64 included) so that they are obviously right. Tests only: they build
[N, N] tensors."""

from __future__ import annotations

import torch


def causal_decay(running_max: torch.Tensor) -> torch.Tensor:
    """[..., N, N] weights exp(M_s - M_t) for keys s <= t, 0 above the diagonal (never exponentiated there)."""
    n = running_max.shape[-1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=running_max.device).tril()
    gap = running_max[..., None, :] - running_max[..., :, None]  # [.., t, s] = M_s - M_t
    return gap.masked_fill(~earlier, float("-inf")).exp()


def naive_decayed_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                                   running_max: torch.Tensor) -> torch.Tensor:
    """out_t = Σ_{s<=t} a_ts v_s / Σ_{s<=t} a_ts with a_ts = (φq_t · φk_s) exp(M_s - M_t); a row whose weights are
    all 0 outputs 0. Computed in the inputs' dtype (pass float64 for a reference)."""
    scores = (phi_q @ phi_k.transpose(-1, -2)) * causal_decay(running_max.to(phi_q.dtype))
    den = scores.sum(-1)
    return (scores @ v) / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)


def naive_final_state(phi_k: torch.Tensor, v: torch.Tensor, running_max: torch.Tensor):
    """(S, z, M) after the last position: S = Σ_s exp(M_s - M_last) φk_s v_sᵀ, z = Σ_s exp(M_s - M_last) φk_s,
    M = M_last, the state a decoder continues from."""
    last = running_max[..., -1:]
    weights = (running_max - last).exp().to(phi_k.dtype).unsqueeze(-1)  # [B, H, N, 1]
    decayed = phi_k * weights
    return decayed.transpose(-1, -2) @ v, decayed.sum(-2), last.squeeze(-1)
