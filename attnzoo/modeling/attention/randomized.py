"""Randomized Attention (RA; "Linear Complexity Randomized Self-attention Mechanism", Zheng, Wang and Kong, ICML
2022, arXiv 2204.04667, §3; the estimator is written out in docs/random_feature_attention.md).

Softmax attention is the expectation of f_n(ω) = Σ_m softmax_m(ω·k̂_m − ‖k̂_m‖²/2) v_m under the Gaussian mixture
p_n(ω) = Σ_m π_nm N(ω; q̂_n + k̂_m, I). RA samples ω from p_n exactly (a categorical index without gradient, then a
reparameterised Gaussian) and averages f over `ra_num_samples` draws: unbiased with σ = 1 ("paper" noise).
The biased variant (Eq. 31) replaces the index by its mean, ω_n = q̂_n + Σ_m π_nm k̂_m (+ noise), so gradients flow
through π. At evaluation the noise is dropped; the unbiased variant still samples the index (as the official code
does), from uniforms that are a function of the seed `eval_seed` and the positions (so evaluation is deterministic
and cached decoding equals the full forward); the biased one is deterministic. Causal and padding masks restrict both
π and f (the official code ignores padding). Cost is quadratic, like softmax; decoding uses a KV cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

from attnzoo.modeling.attention.base import (
    ZooAttention,
    allowed_keys,
    check_attention_mask,
    register_attention,
    static_allowed_keys,
    static_key_mask,
)
from attnzoo.modeling.attention.counter_random import counter_uniform
from attnzoo.modeling.attention.random_features import sample_noise_std
from attnzoo.transformers_compat import static_written_length


def sample_index(scores: torch.Tensor, num_samples: int, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """[..., num_samples] indices drawn from softmax(scores) over the last axis (Gumbel-max; no gradient), from
    `uniform` [..., num_samples, keys] when given, else from the global RNG."""
    with torch.no_grad():
        if uniform is None:
            uniform = torch.rand(*scores.shape[:-1], num_samples, scores.shape[-1], device=scores.device,
                                 dtype=scores.dtype)
        gumbel = -torch.log(-torch.log(uniform))
        return (scores.unsqueeze(-2) + gumbel.to(scores.dtype)).argmax(-1)


def sample_omega(q_hat, k_hat, allowed, variant: str, num_samples: int, noise_std: float,
                 index_uniform: torch.Tensor | None = None) -> torch.Tensor:
    """ω [B, H, N, S, d] for pre-scaled q̂, k̂ [B, H, N|M, d]: exact draws from p_n (unbiased: q̂_n + k̂_m* with
    m* ~ π_n, then noise) or from its moment-matched Gaussian (biased: q̂_n + Σ_m π_nm k̂_m, then noise).
    `index_uniform` [B|1, H, N, S, M]: the uniforms of the index draw (default: the global RNG)."""
    scores = q_hat @ k_hat.transpose(-1, -2)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if variant == "unbiased":
        index = sample_index(scores, num_samples, index_uniform)  # no gradient through the index, as in the paper
        batch, heads, queries, samples = index.shape
        # Gather along the key axis with a flat index: O(N·S·d), never an [N, M, d] expansion (nor its gradient).
        flat = index.reshape(batch, heads, queries * samples, 1).expand(-1, -1, -1, k_hat.shape[-1])
        chosen = torch.gather(k_hat, 2, flat).view(batch, heads, queries, samples, -1)
        mean = q_hat.unsqueeze(3) + chosen
    else:
        mean = (q_hat + scores.softmax(-1) @ k_hat).unsqueeze(3).expand(-1, -1, -1, num_samples, -1)
    if not noise_std:
        return mean
    # randn(shape), not randn_like: the draws must not depend on the tensor's memory layout.
    return mean + noise_std * torch.randn(mean.shape, device=mean.device, dtype=mean.dtype)


def randomized_aggregate(omega, k_hat, v, allowed) -> torch.Tensor:
    """Mean over samples of f(ω) = Σ_m softmax_m(ω·k̂_m − ‖k̂_m‖²/2) v_m (the query factor of p_n cancels)."""
    batch, heads, queries, samples, dim = omega.shape
    # Samples folded into the query axis: a plain [N·S, d] x [d, M] product (broadcasting keys over [N, S] would
    # make matmul copy them N times).
    logits = (omega.reshape(batch, heads, queries * samples, dim) @ k_hat.transpose(-1, -2)
              - 0.5 * (k_hat * k_hat).sum(-1).unsqueeze(-2)).view(batch, heads, queries, samples, -1)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.unsqueeze(3), float("-inf"))
    weights = logits.softmax(-1).view(batch, heads, queries * samples, -1)
    return (weights @ v).view(batch, heads, queries, samples, -1).mean(3)


def position_uniforms(seed: int, num_heads: int, num_samples: int, query_positions: torch.Tensor,
                      key_positions: torch.Tensor) -> torch.Tensor:
    """[B, H, N, S, M] uniforms of the sampled index that are a function of (seed, head, query position, sample,
    key position) only, for query positions [B, N] and key positions [B|1, M] counted in real tokens: RA's
    evaluation draws, the same whatever the call, the batch, the padding or the cache."""
    device = query_positions.device
    heads = torch.arange(num_heads, device=device)[None, :, None, None, None]
    samples = torch.arange(num_samples, device=device)[None, None, None, :, None]
    return counter_uniform(seed, heads, query_positions[:, None, :, None, None], samples,
                           key_positions[:, None, None, None, :])


@register_attention("ra")
class RandomizedAttention(ZooAttention):
    family_config = "ZooRASettings"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.build_projections()
        self.variant = config.ra_variant
        self.num_samples = config.ra_num_samples
        self.noise_std = sample_noise_std(config.sample_noise_std, self.head_dim)
        self.eval_seed = config.eval_seed

    def new_cache_layer(self):
        return DynamicLayer()

    def new_static_cache_layer(self, max_cache_len: int):
        return StaticLayer(max_cache_len)  # keys beyond those written are masked (`static_allowed_keys`)

    def _inputs(self, hidden_states, attention_mask, cache, position_ids):
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        q, k, v = (self.split_heads(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.rotary is not None:
            past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            rotation = self.rotation(position_ids, past, q.shape[2], q.device, q.dtype)
            q, k = self.rotate(q, rotation), self.rotate(k, rotation)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        k, v = self.expand_kv(k), self.expand_kv(v)
        written = static_written_length(self.cache_slot(cache))
        if written is not None:  # preallocated keys, of which `written` are filled
            key_mask = static_key_mask(attention_mask, q.shape[0], k.shape[2]) if attention_mask is not None else None
            allowed = static_allowed_keys(key_mask, written, q.shape[2], k.shape[2], self.causal, q.device)
        else:
            key_mask = check_attention_mask(attention_mask, q.shape[0], k.shape[2])
            allowed = allowed_keys(key_mask, q.shape[2], k.shape[2], self.causal, q.device)
        scale = self.head_dim ** -0.25
        return q.to(compute) * scale, k.to(compute) * scale, v.to(compute), allowed, key_mask

    def index_uniform(self, key_mask, batch: int, queries: int, keys: int, device, cache=None) -> torch.Tensor | None:
        """Evaluation draws of the sampled index: uniforms that are a function of (eval_seed, layer, head, query
        position, sample, key position), positions counting real tokens only, so outputs do not depend on the call,
        the batch, left padding or a cache (cached decoding equals the full forward). None in training or with
        `eval_seed=None` (the global RNG)."""
        if self.training or self.eval_seed is None or self.variant != "unbiased":
            return None
        if key_mask is None:
            positions = torch.arange(keys, device=device)[None]
        else:
            positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
        written = static_written_length(self.cache_slot(cache)) if cache is not None else None
        # The queries are the last of the keys written (a static slot's keys continue past them, unwritten).
        query_columns = (keys if written is None else written) - queries + torch.arange(queries, device=device)
        query_positions = positions.expand(batch, -1).gather(1, query_columns[None].expand(batch, -1))
        return position_uniforms(self.eval_seed + self.layer_idx, self.num_heads, self.num_samples, query_positions,
                                 positions)

    def sample_omega(self, q_hat, k_hat, allowed, key_mask, cache=None) -> torch.Tensor:
        uniform = self.index_uniform(key_mask, q_hat.shape[0], q_hat.shape[2], k_hat.shape[2], q_hat.device, cache)
        return sample_omega(q_hat, k_hat, allowed, self.variant, self.num_samples,
                            self.noise_std if self.training else 0.0, uniform)

    def forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        q_hat, k_hat, v, allowed, key_mask = self._inputs(hidden_states, attention_mask, cache, position_ids)
        out = randomized_aggregate(self.sample_omega(q_hat, k_hat, allowed, key_mask, cache), k_hat, v, allowed)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))

    def reference_forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        """The same draws, with f written as the ratio of the mixture's densities, query factor included:
        f_n(ω) = Σ_m ξ(q̂_n, ω) ξ(k̂_m, ω) v_m / Σ_m ξ(q̂_n, ω) ξ(k̂_m, ω), ξ(x, ω) = exp(ω·x − ‖x‖²/2)."""
        q_hat, k_hat, v, allowed, key_mask = self._inputs(hidden_states, attention_mask, cache, position_ids)
        omega = self.sample_omega(q_hat, k_hat, allowed, key_mask, cache)
        xi_q = torch.exp((omega * q_hat.unsqueeze(3)).sum(-1) - 0.5 * (q_hat * q_hat).sum(-1, keepdim=True))
        xi_k = torch.exp(torch.einsum("bhnsd,bhmd->bhnsm", omega, k_hat) - 0.5 * (k_hat * k_hat).sum(-1)[:, :, None,
                                                                                                         None])
        weights = xi_q.unsqueeze(-1) * xi_k
        if allowed is not None:
            weights = weights * allowed.unsqueeze(3)
        out = (weights @ v.unsqueeze(2) / weights.sum(-1, keepdim=True)).mean(3)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))
