"""Random-feature machinery shared by Performer (FAVOR+), elu+1 linear attention, RA and LARA.

Notation (docs/random_feature_attention.md): q̂ = d^{-1/4} q, so q̂·k̂ = q·k/√d.

- Projections: rows marginally N(0, I_d), i.i.d. or block-orthogonal with the QR sign fix (unbiased).
- Log-features: ℓ(x, w) = w·x̂ − ‖x̂‖²/2, so exp(ℓ) is Performer's positive map before the 1/√m factor.
- Linear attention over non-negative features φ_Q, φ_K: the bidirectional form and the masked quadratic reference
  (the causal forms, chunked and recurrent, are `attnzoo.ops.decayed_linear_attention`).

Stabilisation (docs/random_feature_attention.md, section 2): a per-query max over features is subtracted from the
query log-features; keys get one constant per sequence and head in bidirectional attention and their running
maximum in causal attention, so no output depends on a later token. The constants are detached and cancel exactly
between numerator and denominator, because no ε is added to the features. Everything is computed in float32 or
wider.
"""

from __future__ import annotations

import math

import torch


# -- projections --------------------------------------------------------------------------------------------
def gaussian_projection(shape: tuple[int, ...], dim: int, *, orthogonal: bool, norm: str = "chi",
                        generator: torch.Generator | None = None, device=None,
                        dtype=torch.float32) -> torch.Tensor:
    """[*shape, dim] rows that are each marginally N(0, I_dim).

    orthogonal=True stacks blocks of `dim` orthonormal directions (QR of a Gaussian matrix with the columns of Q
    multiplied by sign(diag R), which makes Q Haar-distributed) and gives each row a length: "chi" (the length of
    an independent Gaussian vector, so rows stay marginally Gaussian and the kernel estimate unbiased) or "sqrt_d".
    """
    *lead, rows = shape
    if not orthogonal:
        return torch.randn(*lead, rows, dim, generator=generator, device=device, dtype=dtype)
    blocks = math.ceil(rows / dim)
    gauss = torch.randn(*lead, blocks, dim, dim, generator=generator, device=device, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # the sign fix
    directions = q.transpose(-1, -2).reshape(*lead, blocks * dim, dim)[..., :rows, :]
    if norm == "chi":
        lengths = torch.randn(*lead, rows, dim, generator=generator, device=device, dtype=torch.float64).norm(dim=-1)
    elif norm == "sqrt_d":
        lengths = torch.full((*lead, rows), math.sqrt(dim), device=device, dtype=torch.float64)
    else:
        raise ValueError(f"norm={norm!r}: use 'chi' or 'sqrt_d'.")
    return (directions * lengths.unsqueeze(-1)).to(dtype)


# -- feature maps -------------------------------------------------------------------------------------------
def log_positive_features(x: torch.Tensor, projection: torch.Tensor, hyperbolic: bool = False) -> torch.Tensor:
    """ℓ(x̂, w) for x [B, H, N, d] and projection [H, m, d] -> [B, H, N, m] (2m features when hyperbolic:
    [w·x̂ − ‖x̂‖²/2, −w·x̂ − ‖x̂‖²/2], whose sum of exps is unbiased for exp(x̂·ŷ) with lower variance)."""
    x_hat = x * x.shape[-1] ** -0.25
    logits = torch.einsum("bhnd,hmd->bhnm", x_hat, projection.to(x.dtype))
    half_norm = 0.5 * (x_hat * x_hat).sum(-1, keepdim=True)
    if hyperbolic:
        logits = torch.cat([logits, -logits], dim=-1)
    return logits - half_norm


def positive_random_features(x: torch.Tensor, projection: torch.Tensor, hyperbolic: bool = False) -> torch.Tensor:
    """Performer's φ⁺(x) = exp(ℓ(x̂, w)) / √(number of features), unstabilised: E[φ⁺(q)·φ⁺(k)] = exp(q̂·k̂)."""
    log_phi = log_positive_features(x, projection, hyperbolic)
    return torch.exp(log_phi) / math.sqrt(log_phi.shape[-1])


def stabilised_query_features(log_phi_q: torch.Tensor) -> torch.Tensor:
    """exp(ℓ − max over features), per query: a per-query constant, which cancels in each query's ratio."""
    return torch.exp(log_phi_q - log_phi_q.amax(dim=-1, keepdim=True).detach())


def stabilised_key_features(log_phi_k: torch.Tensor, key_mask: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """(exp(ℓ − c) with padded keys zeroed, c): c is one detached constant per (batch, head) over real keys."""
    if key_mask is not None:
        log_phi_k = log_phi_k.masked_fill(~key_mask[:, None, :, None], float("-inf"))
    c = log_phi_k.amax(dim=(-2, -1), keepdim=True).detach()
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # a sequence with no real key at all
    return torch.exp(log_phi_k - c), c


#: running maximum of positions that have seen no real key yet (their key features are all 0): any finite value
#: works, and a very low one makes the decay from there to the first real key exactly 0.
NO_KEY_LEVEL = -1e30


def running_max_key_features(log_phi_k: torch.Tensor, key_mask: torch.Tensor | None,
                             start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal key features: (exp(ℓ_s − M_s) with padded keys zeroed, M) where M_s [B, H, N] is the running maximum of
    the log-features of the keys up to s (and of `start` [B, H], the level of keys before these, when decoding).

    Unlike one constant over the whole sequence, M_s depends on earlier keys only, so no output can depend on later
    tokens, also through rounding, and every factor stays at most 1 (docs/random_feature_attention.md, section 2).
    M is detached: it cancels between numerator and denominator."""
    if key_mask is not None:
        log_phi_k = log_phi_k.masked_fill(~key_mask[:, None, :, None], float("-inf"))
    level = log_phi_k.detach().amax(dim=-1)
    if start is not None:
        level = torch.cat([start.detach().unsqueeze(-1), level], dim=-1)
    level = torch.cummax(level, dim=-1).values[..., -log_phi_k.shape[2]:]
    level = torch.where(torch.isfinite(level), level, torch.full_like(level, NO_KEY_LEVEL))
    return torch.exp(log_phi_k - level.unsqueeze(-1)), level


def elu_features(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """elu(x) + 1 (Katharopoulos et al.): x + 1 for x > 0, 1 + α(eˣ − 1) otherwise; positive for α ≤ 1."""
    return torch.nn.functional.elu(x, alpha=alpha) + 1.0


# -- linear attention ---------------------------------------------------------------------------------------
def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    # A query that sees no key (a padded position) has den = 0; give it a zero output instead of NaN.
    return num / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)


def linear_attention_bidirectional(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """out_n = φ_Q(q_n)ᵀ S / φ_Q(q_n)ᵀ z with S = Φ_Kᵀ V, z = Φ_Kᵀ 1. Shapes [B, H, N, r] and [B, H, M, d_v]."""
    kv = torch.einsum("bhmr,bhme->bhre", phi_k, v)
    return _ratio(torch.einsum("bhnr,bhre->bhne", phi_q, kv), torch.einsum("bhnr,bhr->bhn", phi_q, phi_k.sum(2)))


def linear_attention_reference(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                               allowed: torch.Tensor | None) -> torch.Tensor:
    """The masked quadratic form: A = Φ_Q Φ_Kᵀ ⊙ allowed, out = diag(A 1)⁻¹ A V."""
    scores = phi_q @ phi_k.transpose(-1, -2)
    if allowed is not None:
        scores = scores * allowed
    return _ratio(scores @ v, scores.sum(-1))


# -- sampling noise and SNIS (RA / LARA) --------------------------------------------------------------------
def sample_noise_std(setting, head_dim: int) -> float:
    """σ of the sampling noise in pre-scaled coordinates: "paper" = 1 (exactly unbiased RA), "official" = d^(-1/4)
    (what the official code's unscaled noise amounts to), or a number."""
    if setting == "paper":
        return 1.0
    if setting == "official":
        return head_dim ** -0.25
    return float(setting)


def log_features_at(x_hat: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """ℓ(x̂_n, ω_c) = ω_c·x̂_n − ‖x̂_n‖²/2 for pre-scaled x̂ [B, H, N, d] and per-sequence samples ω [B, H, C, d]
    -> [B, H, N, C]."""
    return x_hat @ omega.transpose(-1, -2) - 0.5 * (x_hat * x_hat).sum(-1, keepdim=True)


def snis_attention(log_feat_q: torch.Tensor, log_feat_k: torch.Tensor, v: torch.Tensor, log_alpha: torch.Tensor,
                   log_proposal: torch.Tensor) -> torch.Tensor:
    """Self-normalised (multiple) importance sampling attention, the core of RA and LARA
    (docs/random_feature_attention.md, sections 3 and 4).

    For samples ω_c: out_n = Σ_c w_nc f(ω_c), f(ω_c) = Σ_m softmax_m(ℓ(k̂_m, ω_c)) v_m and
    w_n = softmax_c(log α_nc + ℓ(q̂_n, ω_c) + LSE_m ℓ(k̂_m, ω_c) − log q̃_c(ω_c)).
    Shapes: log_feat_q [B, H, N, C], log_feat_k [B, H, M, C] (−inf for excluded keys), v [B, H, M, d_v],
    log_alpha broadcastable to [B, H, N, C] (−inf for unavailable samples), log_proposal broadcastable to [B, H, 1, C].
    """
    key_lse = torch.logsumexp(log_feat_k, dim=-2)  # [B, H, C]
    f = torch.softmax(log_feat_k, dim=-2).transpose(-1, -2) @ v  # [B, H, C, d_v]
    weights = torch.softmax(log_alpha + log_feat_q + (key_lse.unsqueeze(-2) - log_proposal), dim=-1)
    return weights @ f
