"""Randomized Attention with an exact window inside every layer ("ra_window"): each query attends exactly, with
softmax weights, to its window and sinks (`window_size`, `num_sink_tokens`, as the "window" attention), and through
Randomized Attention (RA) to every earlier key outside them (the "far" keys), under ONE normalisation.

RA ("Linear Complexity Randomized Self-attention Mechanism", Zheng, Wang and Kong, ICML 2022, arXiv 2204.04667, §3;
written out in docs/random_feature_attention.md, section 3) rests on the identity, for ξ(x, ω) = exp(ω·x − ‖x‖²/2)
and pre-scaled q̂ = d^(-1/4) q, k̂ = d^(-1/4) k (so s_nm = q̂_n·k̂_m = q_n·k_m / √d):

    ξ(q̂_n, ω) ξ(k̂_m, ω) N(ω; 0, I) = exp(s_nm) N(ω; q̂_n + k̂_m, I).

Restricted to the far keys F(n), with Z_n = Σ_{m∈F(n)} exp(s_nm), π_nm = exp(s_nm) / Z_n and the mixture
p_n(ω) = Σ_{m∈F(n)} π_nm N(ω; q̂_n + k̂_m, I), summing the identity over F(n) gives, for EVERY ω,

    Σ_{m∈F(n)} ξ(q̂_n, ω) ξ(k̂_m, ω) N(ω; 0, I) / p_n(ω) = Z_n,

so RA's density-ratio estimate of the far normaliser is exact, and its numerator is Z_n f_n(ω) with
f_n(ω) = Σ_{m∈F(n)} softmax_m(ω·k̂_m − ‖k̂_m‖²/2) v_m, whose expectation under p_n is Σ_F exp(s_nm) v_m / Z_n
(unbiased with σ = 1 noise). The layer is

    out_n = (Σ_{m∈near(n)} exp(s_nm) v_m + Z_n · mean_s f_n(ω_ns)) / (Σ_{m∈near(n)} exp(s_nm) + Z_n),
    ω_ns ~ p_n (RA's "unbiased" variant) or ω_ns = q̂_n + Σ_F π_nm k̂_m (+ noise; RA's "biased" variant, Eq. 31),

computed by the one normalisation every windowed layer shares (`window.combine`): the near keys' scores and a far
part of mass Z_n (log Z_n, a log-sum-exp over the far keys) and value mean_s f_n(ω_ns). Only the far values are
estimated: the split of the attention mass between the
window and the far keys is exact, the layer is exact softmax wherever the window reaches (a query with no far key
has no far part), and it is the window-plus-global layer of LoLCATs (arXiv 2410.10254, §3.2) with RA as the global
part and StreamingLLM's sinks ("Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453).

Positions count real tokens (left padding leaves a row's outputs unchanged). RA is quadratic already, so the near
and far sets are dense [query, key] masks over those positions, with no blocking. Draws are RA's own: evaluation
indices come from `index_uniform` (counter-based uniforms of the positions, so cached decoding equals the full
forward), noise only in training. Causal (decoder) layers only. Decoding uses RA's KV cache (a transformers
`DynamicLayer` with every real and padded token's key and value, as exact softmax keeps them); the window adds no
state, since near and far follow from the positions of the cached keys.
"""

from __future__ import annotations

import torch

from attnzoo.modeling.attention.base import register_attention
from attnzoo.modeling.attention.randomized import RandomizedAttention, randomized_aggregate
from attnzoo.modeling.attention.window import WindowInsideLayer, beyond_window, combine


def real_positions(key_mask: torch.Tensor | None, batch: int, keys: int, device) -> torch.Tensor:
    """[B|1, keys] position of each key counted in real tokens (-1 before a row's first real token)."""
    if key_mask is None:
        return torch.arange(keys, device=device)[None]
    return key_mask.long().cumsum(-1) - 1


def near_and_far_keys(allowed: torch.Tensor, key_mask: torch.Tensor | None, window: int, sinks: int):
    """(near, far), bool [B, 1, queries, keys], for a causal `allowed` mask [B|1, 1, queries, keys] (from
    `allowed_keys`; the queries are the last ones of the keys): an allowed key is near when it is within the window
    (pos_query − pos_key < window) or one of the first `sinks` real tokens, far otherwise. Every query has a near key
    (itself), so the near softmax is never empty."""
    batch, _, queries, keys = allowed.shape
    positions = real_positions(key_mask, batch, keys, allowed.device)
    far = allowed & beyond_window(positions[:, -queries:, None], positions[:, None, :], window, sinks)[:, None]
    return allowed & ~far, far


def keys_to_sample(far: torch.Tensor) -> torch.Tensor:
    """The keys RA's mixture and f run over: the far keys, or every key for a query that has none. Such a query's far
    part gets the weight exp(−inf) = 0, but its draws must stay finite (an empty softmax is NaN, and 0 · NaN is NaN
    in both the output and the gradient)."""
    return far | ~far.any(-1, keepdim=True)


@register_attention("ra_window")
class WindowedRandomizedAttention(WindowInsideLayer, RandomizedAttention):
    """Exact window and sinks plus RA over the far keys, one softmax normalisation; see the module docstring."""

    plain_kind = "ra"

    def forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        q_hat, k_hat, v, allowed, key_mask = self._inputs(hidden_states, attention_mask, cache, position_ids)
        near, far = near_and_far_keys(allowed, key_mask, self.window_size, self.sinks)
        sampled = keys_to_sample(far)
        far_value = randomized_aggregate(self.sample_omega(q_hat, k_hat, sampled, key_mask), k_hat, v, sampled)
        scores = q_hat @ k_hat.transpose(-1, -2)
        # log Z_n over the far keys; −inf (no far part) for a query without any
        log_far_mass = torch.where(far.any(-1), scores.masked_fill(~sampled, float("-inf")).logsumexp(-1),
                                   float("-inf"))
        # the one normalisation: the near keys' exact weights and the far part, mass Z_n = exp(log Z_n), value f
        out = combine(scores.masked_fill(~near, float("-inf")), v, far_value, torch.ones_like(log_far_mass),
                      log_far_mass)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))

    def reference_forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        """Dense kernels in the compute dtype, no stabilisation, the same draws: exp(s_nm) on the near keys; on the
        far keys RA's importance weights ξ(q̂_n, ω) ξ(k̂_m, ω) N(ω; 0, I) / p_n(ω) with the mixture density p_n
        written out, averaged over the draws; out = (near numerator + far numerator) / (near sum + far sum)."""
        q_hat, k_hat, v, allowed, key_mask = self._inputs(hidden_states, attention_mask, cache, position_ids)
        batch, heads, queries, dim = q_hat.shape
        keys = k_hat.shape[2]
        # the masks, spelled out from the definition: positions in real tokens, causal by index
        positions = real_positions(key_mask, batch, keys, q_hat.device)
        query_positions = positions[:, keys - queries:]
        query_index = torch.arange(keys - queries, keys, device=q_hat.device)
        key_index = torch.arange(keys, device=q_hat.device)
        real_key = key_mask if key_mask is not None else torch.ones(1, keys, dtype=torch.bool, device=q_hat.device)
        earlier_real = (key_index[None, None, :] <= query_index[None, :, None]) & real_key[:, None, :]
        far = earlier_real & beyond_window(query_positions[:, :, None], positions[:, None, :], self.window_size,
                                           self.sinks)
        own = key_index[None, None, :] == query_index[None, :, None]
        near = (earlier_real & ~far) | (own & ~real_key[:, keys - queries:, None])
        near, far = near[:, None], far[:, None]  # [B, 1, N, M]
        omega = self.sample_omega(q_hat, k_hat, keys_to_sample(far), key_mask)  # [B, H, N, S, d]

        kernel = torch.exp(q_hat @ k_hat.transpose(-1, -2))  # exp(s_nm)
        has_far = far.any(-1)  # [B, 1, N]
        far_mass = (kernel * far).sum(-1)  # Z_n
        mixture_weight = kernel * far / torch.where(has_far, far_mass, 1.0).unsqueeze(-1)  # π_nm

        def standard_normal_density(x):  # N(x; 0, I) over the last axis
            return torch.exp(-0.5 * (x * x).sum(-1)) / (2 * torch.pi) ** (dim / 2)

        def xi(x, w):  # ξ(x, ω) = exp(ω·x − ‖x‖²/2)
            return torch.exp((w * x).sum(-1) - 0.5 * (x * x).sum(-1))

        omega_m = omega.unsqueeze(4)  # [B, H, N, S, 1, d] against keys [B, H, 1, 1, M, d]
        k_m = k_hat[:, :, None, None]
        component = standard_normal_density(omega_m - q_hat[:, :, :, None, None] - k_m)  # N(ω; q̂_n + k̂_m, I)
        density = (mixture_weight.unsqueeze(3) * component).sum(-1)  # p_n(ω) [B, H, N, S]
        integrand = (xi(q_hat[:, :, :, None, None], omega_m) * xi(k_m, omega_m)
                     * standard_normal_density(omega).unsqueeze(-1) * far.unsqueeze(3))
        importance = integrand / torch.where(has_far.unsqueeze(-1), density, 1.0).unsqueeze(-1)  # [B, H, N, S, M]
        far_numerator = (importance @ v.unsqueeze(2)).mean(3)
        far_denominator = importance.sum(-1).mean(3)
        near_kernel = kernel * near
        out = (near_kernel @ v + far_numerator) / (near_kernel.sum(-1) + far_denominator).unsqueeze(-1)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))
