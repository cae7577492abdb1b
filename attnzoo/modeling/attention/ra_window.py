"""Randomized Attention as the far part of a windowed layer ("ra_window"): each query attends exactly, with softmax
weights, to its window and sinks (`window_size`, `num_sink_tokens`, as the "window" attention), and through
Randomized Attention (RA) to every earlier key outside them (the "far" keys), under ONE normalisation
(`windowed.WindowedAttention`).

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

computed by the one normalisation every windowed layer shares (`merge_far`): the near keys' scores and a far
part of mass Z_n (log Z_n, a log-sum-exp over the far keys) and value mean_s f_n(ω_ns), given as (value, 1,
log Z_n). Only the far values are
estimated: the split of the attention mass between the
window and the far keys is exact, the layer is exact softmax wherever the window reaches (a query with no far key
has no far part), and it is the window-plus-global layer of LoLCATs (arXiv 2410.10254, §3.2) with RA as the global
part and StreamingLLM's sinks ("Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453).

Positions count real tokens (left padding leaves a row's outputs unchanged). RA is quadratic already, so its far
set is a dense [query, key] mask over the left-aligned positions, with no blocking. Draws are RA's own: evaluation
indices come from `randomized.position_uniforms` (counter-based uniforms of the positions, so cached decoding
equals the full forward), noise only in training. Causal (decoder) layers only. Decoding keeps, beside the
window's ring, every real token's key and value (with `num_key_value_heads` heads, at its position), as a KV cache
does: a new token's far keys are the stored ones at positions S .. t − W.
"""

from __future__ import annotations

import math

import torch

from attnzoo.modeling.attention.random_features import sample_noise_std
from attnzoo.modeling.attention.randomized import position_uniforms, randomized_aggregate, sample_omega
from attnzoo.modeling.attention.window import beyond_window, gather_tokens, left_align, restore_order
from attnzoo.modeling.attention.windowed import FarInputs, FarOutput, FarPart, log_far_mass, register_far_part
from attnzoo.modeling.cache import with_spare_tokens, write_at_rows


def keys_to_sample(far: torch.Tensor) -> torch.Tensor:
    """The keys RA's mixture and f run over: the far keys, or every key for a query that has none. Such a query's far
    part gets the weight exp(−inf) = 0, but its draws must stay finite (an empty softmax is NaN, and 0 · NaN is NaN
    in both the output and the gradient)."""
    return far | ~far.any(-1, keepdim=True)


@register_far_part("ra")
class RAFarPart(FarPart):
    """RA over the far keys; see the module docstring."""

    family_config = "ZooRASettings"
    plain_kind = "ra"

    def __init__(self, layer, config):
        super().__init__(layer, config)
        self.variant = config.ra_variant
        self.num_samples = config.ra_num_samples
        self.noise_std = sample_noise_std(config.sample_noise_std, self.head_dim)
        self.eval_seed = config.eval_seed

    def _omega(self, q_hat, k_hat, sampled, query_positions, key_positions):
        """RA's draws ω [B, H, N, S, d] over the keys `sampled` [B, 1, N, M]: in evaluation the index comes from
        uniforms of the (real) positions [B, N] and [B|1, M], in training from the global RNG, with noise."""
        uniform = None
        if not self.training and self.eval_seed is not None and self.variant == "unbiased":
            uniform = position_uniforms(self.eval_seed + self.layer_idx, self.num_heads, self.num_samples,
                                        query_positions, key_positions)
        return sample_omega(q_hat, k_hat, sampled, self.variant, self.num_samples,
                            self.noise_std if self.training else 0.0, uniform)

    def _far(self, q, k, v, far, query_positions, key_positions):
        """(f, 1, log Z) [B, H, N, ...] of queries q [B, H, N, d] over keys k, v [B, H, M, d] and far [B, 1, N, M]."""
        scale = self.head_dim ** -0.25
        q_hat, k_hat = q * scale, k * scale
        sampled = keys_to_sample(far)
        value = randomized_aggregate(self._omega(q_hat, k_hat, sampled, query_positions, key_positions), k_hat, v,
                                     sampled)
        log_mass = log_far_mass((q_hat @ k_hat.transpose(-1, -2)).masked_fill(~far, float("-inf")))  # log Z_n
        return value, torch.ones_like(log_mass), log_mass

    def parallel(self, x: FarInputs) -> FarOutput:
        position = torch.arange(x.q.shape[2], device=x.q.device)
        far = beyond_window(position[:, None], position[None, :], self.window_size, self.sinks)
        far = far[None, None] & x.valid[:, None, None, :]
        out = self._far(x.q, self.expand_kv(x.k), self.expand_kv(x.v), far, position[None], position[None])
        # decoding keeps a KV cache of the real tokens, at their positions
        state = dict(ra_k=with_spare_tokens(x.k), ra_v=with_spare_tokens(x.v)) if x.keep_state else None
        return FarOutput(*out, state)

    def step(self, x: FarInputs) -> FarOutput:
        position, needed = x.position[:, 0], x.seen + 1  # positions never exceed the tokens seen
        stored = {"ra_k": write_at_rows(x.state["ra_k"], position, x.k, needed),
                  "ra_v": write_at_rows(x.state["ra_v"], position, x.v, needed)}
        key_position = torch.arange(stored["ra_k"].shape[2], device=x.q.device)[None]
        far = beyond_window(position[:, None], key_position, self.window_size, self.sinks)
        out = self._far(x.q, self.expand_kv(stored["ra_k"]), self.expand_kv(stored["ra_v"]), far[:, None, None, :],
                        position[:, None], key_position)
        return FarOutput(*out, stored)

    def reference(self, x: FarInputs) -> FarOutput:
        """Dense kernels in the compute dtype, the same draws: on the far keys RA's importance weights
        ξ(q̂_n, ω) ξ(k̂_m, ω) N(ω; 0, I) / p_n(ω) with the mixture density p_n written out, averaged over the draws
        -> (far numerator, far denominator, log scale). Each factor is written as its logarithm and the weights are
        exponentiated once, divided by Z_n (the log scale returned is log Z_n): ξ, N and exp(s_nm) alone overflow or
        underflow at trained scales (NaN as inf / inf or 0 / 0), while a weight over Z_n is the mixture component's
        share of p_n(ω), at most 1. Computed on left-aligned rows, as the parallel form draws there (training draws
        come from the global RNG in that order), and moved back."""
        order = left_align(x.valid)
        q, k, v = (gather_tokens(t, order) for t in (x.q, x.k, x.v))
        far = x.far.gather(1, order[:, :, None].expand_as(x.far)).gather(2, order[:, None, :].expand_as(x.far))
        scale = self.head_dim ** -0.25
        q_hat, k_hat, v = q * scale, self.expand_kv(k) * scale, self.expand_kv(v)
        dim = q_hat.shape[-1]
        positions = torch.arange(q.shape[2], device=q.device)[None]  # real positions, for the evaluation draws
        far = far[:, None]  # [B, 1, N, M]
        # A query without far keys gets the weight 0 (log scale -inf), but its mixture runs over every key, as its
        # draws do: every logarithm below stays finite, and so do the gradients.
        sampled = keys_to_sample(far)
        omega = self._omega(q_hat, k_hat, sampled, positions, positions)  # [B, H, N, S, d]
        scores = q_hat @ k_hat.transpose(-1, -2)  # s_nm
        log_mass = log_far_mass(scores.masked_fill(~far, float("-inf")))  # log Z_n
        log_pi = scores.masked_fill(~sampled, float("-inf")).log_softmax(-1)  # log π_nm

        def log_standard_normal(x):  # log N(x; 0, I) over the last axis
            return -0.5 * (x * x).sum(-1) - dim / 2 * math.log(2 * math.pi)

        def log_xi(x, w):  # log ξ(x, ω) = ω·x − ‖x‖²/2
            return (w * x).sum(-1) - 0.5 * (x * x).sum(-1)

        omega_m = omega.unsqueeze(4)  # [B, H, N, S, 1, d] against keys [B, H, 1, 1, M, d]
        k_m = k_hat[:, :, None, None]
        log_component = log_standard_normal(omega_m - q_hat[:, :, :, None, None] - k_m)  # log N(ω; q̂_n + k̂_m, I)
        log_density = (log_pi.unsqueeze(3) + log_component).logsumexp(-1)  # log p_n(ω) [B, H, N, S]
        log_integrand = (log_xi(q_hat[:, :, :, None, None], omega_m) + log_xi(k_m, omega_m)
                         + log_standard_normal(omega).unsqueeze(-1))  # log ξ(q̂_n, ω) ξ(k̂_m, ω) N(ω; 0, I)
        log_mass_or_zero = torch.where(torch.isfinite(log_mass), log_mass, 0.0)[..., None, None]
        # masked before exp: a near key's ratio can overflow, and inf * 0 is NaN
        importance = (log_integrand - log_density.unsqueeze(-1) - log_mass_or_zero).masked_fill(
            ~far.unsqueeze(3), float("-inf")).exp()
        numerator = restore_order((importance @ v.unsqueeze(2)).mean(3), order)  # [B, H, N, e], over Z_n
        denominator = restore_order(importance.sum(-1).mean(3)[..., None], order)[..., 0]
        return FarOutput(numerator, denominator, restore_order(log_mass[..., None], order)[..., 0])
