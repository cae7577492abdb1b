"""Estimators and diagnostics of the approximation-quality benchmark (`approximation_quality.py`).

Each estimator takes one softmax model's per-head q, k, v [B, H, N, d] (unscaled, as the attention modules take
them) and returns an `Approximation`: its output, the weights it gives its samples per query, and the weight its
implied attention matrix puts on each query's own position.

Performer, LARA and the paper-code Performer all have the form out_n = Σ_c w_nc f(ω_c) with
f(ω_c) = Σ_m P_cm v_m, P_cm = softmax_m(ω_c·k̂_m − ‖k̂_m‖²/2) (the zoo's `snis_attention`; Performer is the case of
proposals N(0, I), see "Linear Complexity Randomized Self-attention Mechanism", arXiv 2204.04667, §3). So:
- the effective sample size of query n is 1 / Σ_c w_nc² (between 1 and the number of samples): how many of the
  samples actually carry its estimate;
- the implied attention is A_nm = Σ_c w_nc P_cm, and its diagonal A_nn is the "self weight". RA averages
  f(ω_ns) over S draws per query with equal weights, so its ESS is S by construction and A = mean_s P(ω_ns).

The paper-code Performer is not a model option: it re-creates the authors' Performer (`favorp_projection` and
`linear_attention` of the official efficient-attention code, used for the paper's Figure 1), which adds 1e-4 to
every feature after the max shift and clamps the denominator at 1e-2. Both make it biased; the zoo's Performer adds
nothing, so its only bias is self-normalisation, which vanishes as features grow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnzoo import ZooLARAConfig
from attnzoo.modeling.attention import LinearRandomizedAttention
from attnzoo.modeling.attention.random_features import (
    gaussian_projection,
    linear_attention_bidirectional,
    log_positive_features,
    snis_attention,
    stabilised_key_features,
    stabilised_query_features,
)
from attnzoo.modeling.attention.randomized import sample_omega

PAPER_CODE_FEATURE_EPS = 1e-4  # added to every feature by the official favorp_projection
PAPER_CODE_DENOMINATOR_FLOOR = 1e-2  # the official linear_attention's clamp
RA_CHUNK_ELEMENTS = 2**23  # bound on the [B, H, queries, S, M] logits RA holds at once


@dataclass
class Approximation:
    output: torch.Tensor  # [B, H, N, d_v]
    weights: torch.Tensor | None  # [B, H, N, C]: each query's normalised sample weights (None: equal weights)
    self_weight: torch.Tensor  # [B, H, N]: A_nn of the implied attention matrix
    samples: int  # samples per query (C, or RA's S)
    row_mass: torch.Tensor | None = None  # [B, H, N]: Σ_m A_nm where it is not 1 (the paper-code Performer's floor)

    def effective_sample_size(self) -> torch.Tensor:
        """[B, H, N]: 1 / Σ_c w_nc² per query (the number of samples when all weights are equal)."""
        if self.weights is None:
            return torch.full_like(self.self_weight, float(self.samples))
        return effective_sample_size(self.weights)


def effective_sample_size(weights: torch.Tensor) -> torch.Tensor:
    """1 / Σ w² over the last axis of weights that sum to one over it."""
    total = weights.sum(-1)
    if not torch.allclose(total, torch.ones_like(total), atol=1e-6):
        raise ValueError("effective_sample_size needs weights normalised over the last axis (each row sums to 1).")
    return 1.0 / (weights * weights).sum(-1)


def softmax_self_weight(q, k) -> torch.Tensor:
    """[B, H, N]: the diagonal of exact softmax attention softmax(q kᵀ/√d)."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.diagonal(logits.softmax(-1), dim1=-2, dim2=-1)


def snis_diagnostics(log_weights, log_feat_k, v, samples: int) -> Approximation:
    """The SNIS form out_n = Σ_c w_nc f(ω_c) from unnormalised log sample weights [B, H, N, C] and key
    log-features ℓ(k̂_m, ω_c) [B, H, M, C] (M = N: self-attention)."""
    weights = log_weights.softmax(-1)
    key_probs = log_feat_k.softmax(-2)  # P_cm, stored [B, H, M, C]
    output = weights @ (key_probs.transpose(-1, -2) @ v)
    return Approximation(output, weights, (weights * key_probs).sum(-1), samples)


# -- Performer ------------------------------------------------------------------------------------------------
def performer_projection(heads: int, features: int, dim: int, device, dtype) -> torch.Tensor:
    """Orthogonal random features with χ lengths (the zoo's default and the official evaluation matrix)."""
    return gaussian_projection((heads, features), dim, orthogonal=True, device=device, dtype=dtype)


def performer(q, k, v, projection) -> Approximation:
    """The zoo's unbiased-feature Performer (its output from the zoo's own functions) and its SNIS weights
    w_nc = softmax_c(ℓ(q̂_n, w_c) + LSE_m ℓ(k̂_m, w_c)): importance sampling from N(0, I)."""
    log_q, log_k = log_positive_features(q, projection), log_positive_features(k, projection)
    phi_k, _ = stabilised_key_features(log_k, None)
    output = linear_attention_bidirectional(stabilised_query_features(log_q), phi_k, v)
    diagnostics = snis_diagnostics(log_q + torch.logsumexp(log_k, dim=-2, keepdim=True), log_k, v, projection.shape[1])
    return Approximation(output, diagnostics.weights, diagnostics.self_weight, diagnostics.samples)


def paper_code_features(x, projection, is_query: bool, eps: float = PAPER_CODE_FEATURE_EPS) -> torch.Tensor:
    """The official favorp_projection: m^-1/2 exp(ℓ − max of the projections w·x̂) + eps, the max per query over
    features, or over all keys and features of a sequence for keys."""
    x_hat = x * x.shape[-1] ** -0.25
    projected = torch.einsum("bhnd,hmd->bhnm", x_hat, projection.to(x.dtype))
    log_phi = projected - 0.5 * (x_hat * x_hat).sum(-1, keepdim=True)
    stabiliser = projected.amax(dim=-1 if is_query else (-2, -1), keepdim=True)
    return projection.shape[1] ** -0.5 * torch.exp(log_phi - stabiliser) + eps


def paper_code_performer(q, k, v, projection, eps: float = PAPER_CODE_FEATURE_EPS,
                         denominator_floor: float = PAPER_CODE_DENOMINATOR_FLOOR) -> Approximation:
    """The official Performer: features with +eps, out = φ_Q (Φ_Kᵀ V) / max(φ_Q·Σ_m φ_K, floor)."""
    phi_q = paper_code_features(q, projection, True, eps)
    phi_k = paper_code_features(k, projection, False, eps)
    key_sum = phi_k.sum(-2)  # [B, H, C]
    denominator = (phi_q @ key_sum.unsqueeze(-1)).squeeze(-1)
    output = (phi_q @ (phi_k.transpose(-1, -2) @ v)) / denominator.clamp(min=denominator_floor).unsqueeze(-1)
    # Written as Σ_c w_nc f_c: w_nc ∝ φ_Q,nc Σ_m φ_K,mc, f_c the φ_K-weighted mean of the values. The floor only
    # rescales a row (it is not a weight); it is left out of w and kept in the self weight.
    mass = phi_q * key_sum.unsqueeze(-2)
    weights = mass / mass.sum(-1, keepdim=True)
    floored = denominator.clamp(min=denominator_floor)
    row_mass = denominator / floored  # < 1 where the floor binds: the output shrinks towards zero
    return Approximation(output, weights, (phi_q * phi_k).sum(-1) / floored, projection.shape[1], row_mass)


# -- LARA ------------------------------------------------------------------------------------------------------
def lara_module(heads: int, head_dim: int, proposals: int, per_proposal: int, noise, training: bool,
                device, dtype) -> LinearRandomizedAttention:
    """Parameter-free LARA as the benchmark applies it to a softmax model: 2-D pooled landmarks (no Linear +
    LayerNorm: a softmax model has none), Eq. 35 means, Eq. 38 weights with λ = 2 (the paper's vision settings)."""
    config = ZooLARAConfig(hidden_size=heads * head_dim, num_attention_heads=heads, lara_num_samples=proposals,
                           lara_samples_per_proposal=per_proposal, lara_landmarks="2d",
                           lara_proposal_mean="q+mixed_k", lara_landmark_transform=False, lara_alpha_coeff=2.0,
                           sample_noise_std=noise)
    return LinearRandomizedAttention(config, 0, causal=False).to(device=device, dtype=dtype).train(training)


def lara(module: LinearRandomizedAttention, q, k, v, grid_size) -> Approximation:
    """LARA's output (the zoo's `snis_attention` on the module's own terms) and its sample weights."""
    log_q, log_k, v, log_alpha, log_proposal = module.bidirectional_terms(q, k, v, None, grid_size)
    output = snis_attention(log_q, log_k, v, log_alpha, log_proposal)
    log_weights = log_alpha + log_q + (torch.logsumexp(log_k, dim=-2, keepdim=True) - log_proposal)
    diagnostics = snis_diagnostics(log_weights, log_k, v, log_q.shape[-1])
    return Approximation(output, diagnostics.weights, diagnostics.self_weight, diagnostics.samples)


# -- RA --------------------------------------------------------------------------------------------------------
def ra(q, k, v, samples: int, compute_dtype=torch.float32) -> Approximation:
    """Unbiased RA (σ = 1): the mean of f(ω_ns) over `samples` exact draws ω_ns ~ p_n per query, in query chunks
    that bound the [B, H, queries, S, M] logits. Computed in `compute_dtype` (float32: ~5x faster than float64 on a
    CPU, and RA's errors, above 1e-5 at 196 draws, are far above float32 rounding), returned in q's dtype."""
    out_dtype = q.dtype
    q, k, v = (x.to(compute_dtype) for x in (q, k, v))
    batch, heads, length, dim = q.shape
    scale = dim ** -0.25
    q_hat, k_hat = q * scale, k * scale
    half_norm = 0.5 * (k_hat * k_hat).sum(-1)  # [B, H, M]
    chunk = max(1, RA_CHUNK_ELEMENTS // (batch * heads * samples * length))
    outputs, self_weights = [], []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        omega = sample_omega(q_hat[:, :, start:stop], k_hat, None, "unbiased", samples, 1.0)  # [B, H, n, S, d]
        queries = stop - start
        # Samples folded into the query axis: plain [n·S, d] x [d, M] products, no copy of keys or values per query.
        logits = omega.reshape(batch, heads, queries * samples, dim) @ k_hat.transpose(-1, -2) - half_norm[:, :, None]
        probs = logits.softmax(-1)
        outputs.append((probs @ v).view(batch, heads, queries, samples, -1).mean(3))
        probs = probs.view(batch, heads, queries, samples, length)
        own = torch.arange(start, stop, device=q.device)[None, None, :, None, None]
        self_weights.append(torch.gather(probs, -1, own.expand(batch, heads, -1, samples, 1)).mean((3, 4)))
    return Approximation(torch.cat(outputs, 2).to(out_dtype), None, torch.cat(self_weights, 2).to(out_dtype),
                         samples)
