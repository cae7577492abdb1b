"""Linear Randomized Attention (LARA; Zheng et al., ICML 2022 = seed 002 §4; spec §4, and §8.3 for causal LARA).

Bidirectional LARA estimates softmax attention by self-normalised multiple importance sampling with C Gaussian
proposals N(μ_c, I) shared by all queries, one sample per proposal (or `lara_samples_per_proposal`):
    out_n = Σ_c w_nc f(ω_c),  w_n = softmax_c(log α_nc + ℓ(q̂_n, ω_c) + LSE_m ℓ(k̂_m, ω_c) − log q̃_c(ω_c)).
Proposal means come from landmarks, segment means of queries and keys (contiguous 1-D segments; 2-D pooling for
image grids), optionally through a Linear+LayerNorm shared across heads: Eq. 34 μ_c = q̄̂_c + k̄̂_c, or Eq. 35
μ_c = q̄̂_c + Σ_c' softmax_c'(k̄̂_c·k̄̂_c') k̄̂_c'. Weights α: the balance heuristic, or Eq. 38's decoupled
query-specific weights. Samples are redrawn every training forward; evaluation uses ω_c = μ_c (deterministic).
Time and memory are O(C·N).

Padding differs from the official code on purpose: padded tokens are left out of the landmarks (the official code
averages them in as zeros), so a padded sequence gets the same output as the sequence alone.

Causal LARA is this project's extension; no published implementation exists (the paper and the official code use
LARA only in encoders). It is the chunk-causal design B of spec §8.3: the sequence is cut into chunks of
`lara_chunk_size`; the proposal built from chunk b (its landmarks, Eq. 34) becomes available to queries in later
chunks, next to a prior proposal μ_0 = 0 that is always available; the balance heuristic and the query-specific
weights run over the available proposals only (normalised over proposals), and f sums over keys m ≤ n. Written as
linear attention whose features are the proposals, it runs in the chunked causal form (training) and, for
decoding, from a recurrent state (per-proposal prefix sums). Cost: O(N · N/chunk) time and memory, so a chunk of
64 makes it ~64× cheaper than softmax attention, but not linear.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from attnzoo.configuration.base import check_int
from attnzoo.modeling.attention.base import ZooAttention, check_attention_mask, register_attention
from attnzoo.modeling.attention.random_features import (
    linear_attention_causal,
    log_features_at,
    sample_noise_std,
    snis_attention,
)
from attnzoo.modeling.attention.randomized import check_noise_setting
from attnzoo.modeling.cache import RecurrentStateLayer

PROPOSAL_MEANS = ("q+k", "q+mixed_k")  # Eq. 34, Eq. 35
WEIGHTINGS = ("balance", "query_specific")  # Eq. 36, Eq. 38
LANDMARKS = ("auto", "1d", "2d")
R_AXES = ("queries", "proposals")
ALPHA_FLOOR = 1e-8  # the official code's clamp: the query-specific correction can make α negative


def segment_assignment(key_mask: torch.Tensor | None, batch: int, length: int, segments: int,
                       device) -> torch.Tensor:
    """[B, C, N] 0/1: which segment each real token belongs to (1-D landmarks, spec §4.2).

    Real tokens, in order, form min(C, n) contiguous segments: with n = qC + r, the first C − r hold q tokens and
    the last r hold q + 1; n <= C gives one token per segment. Padded tokens belong to none.
    """
    if key_mask is None:
        key_mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    rank = key_mask.long().cumsum(-1) - 1
    n = key_mask.sum(-1, keepdim=True)
    used = n.clamp(max=segments).clamp(min=1)
    base = (n // used).clamp(min=1)
    small = used - n % used  # segments of `base` tokens; the rest hold base + 1
    boundary = small * base
    seg = torch.where(rank < boundary, rank // base, small + (rank - boundary) // (base + 1))
    seg = torch.where(key_mask, seg, torch.full_like(seg, -1))
    return (seg.unsqueeze(1) == torch.arange(segments, device=device)[None, :, None]).to(torch.get_default_dtype())


@register_attention("lara")
class LinearRandomizedAttention(ZooAttention):
    family_config = "ZooLARAConfig"
    required_config_fields = ("lara_num_samples", "lara_samples_per_proposal", "lara_landmarks",
                              "lara_proposal_mean", "lara_landmark_transform", "lara_weighting",
                              "lara_alpha_coeff", "lara_r_normalize", "lara_chunk_size", "sample_noise_std")

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.build_projections()
        self.num_proposals = config.lara_num_samples
        self.samples_per_proposal = config.lara_samples_per_proposal
        self.landmarks = config.lara_landmarks
        self.proposal_mean = config.lara_proposal_mean
        self.weighting = config.lara_weighting
        self.alpha_coeff = config.lara_alpha_coeff
        self.r_normalize = config.lara_r_normalize
        self.chunk_size = config.lara_chunk_size
        self.noise_std = sample_noise_std(config.sample_noise_std, self.head_dim)
        if config.lara_landmark_transform:  # "light" mode: one Linear+LayerNorm on the head dimension, all heads
            self.landmark_q = nn.Sequential(nn.Linear(self.head_dim, self.head_dim), nn.LayerNorm(self.head_dim))
            self.landmark_k = nn.Sequential(nn.Linear(self.head_dim, self.head_dim), nn.LayerNorm(self.head_dim))
        else:
            self.landmark_q = self.landmark_k = None
        self._segment_cache = {}
        if causal and self.samples_per_proposal != 1:
            raise ValueError("causal LARA draws one sample per proposal; set lara_samples_per_proposal=1.")

    @classmethod
    def check_config(cls, config) -> None:
        choices = {"lara_proposal_mean": PROPOSAL_MEANS, "lara_weighting": WEIGHTINGS, "lara_landmarks": LANDMARKS,
                   "lara_r_normalize": R_AXES}
        for name, allowed in choices.items():
            if getattr(config, name) not in allowed:
                raise ValueError(f"{name}={getattr(config, name)!r} is invalid: use one of {allowed}.")
        for name in ("lara_num_samples", "lara_samples_per_proposal", "lara_chunk_size"):
            check_int(config, name, 1, "set a positive integer.")
        if config.lara_landmarks == "2d" and math.isqrt(config.lara_num_samples) ** 2 != config.lara_num_samples:
            raise ValueError(f"lara_num_samples={config.lara_num_samples} is invalid for 2-D landmarks: it must be a "
                             "perfect square (e.g. 49 = 7x7 pooled cells).")
        check_noise_setting(config)

    def check_image_layout(self, grid_size, class_token: bool) -> None:
        two_d = self.landmarks == "2d" or (self.landmarks == "auto" and not class_token)
        if not two_d:
            return
        if class_token:
            raise ValueError("lara_landmarks='2d' needs the tokens to be exactly the patch grid, but this image model "
                             "has a class token (pooling='cls'); use pooling='mean' or lara_landmarks='1d'.")
        side = math.isqrt(self.num_proposals)
        if side * side != self.num_proposals:
            raise ValueError(f"lara_num_samples={self.num_proposals} is invalid for this image model: its tokens are "
                             f"a {grid_size[0]}x{grid_size[1]} patch grid, so landmarks are pooled grid cells "
                             f"(lara_landmarks={self.landmarks!r}) and the count must be a perfect square (e.g. "
                             f"{max(1, side) ** 2} or {(side + 1) ** 2}), or set lara_landmarks='1d'.")

    # -- shared pieces ----------------------------------------------------------------------------------------
    def _inputs(self, hidden_states):
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        return (self.split_heads(p(hidden_states)).to(compute) for p in (self.q_proj, self.k_proj, self.v_proj))

    def _transform(self, module, x):
        return x if module is None else module(x.to(module[0].weight.dtype)).to(x.dtype)

    def _landmarks(self, q, k, key_mask, grid_size):
        """(q̄, k̄ [B, H, C, d] unscaled, valid [B, C] bool, or None when every proposal has tokens)."""
        batch, _, length, _ = q.shape
        is_grid = grid_size is not None and grid_size[0] * grid_size[1] == length
        # "auto": 2-D when the tokens are exactly the patch grid; with a class token, 1-D segments.
        two_d = self.landmarks == "2d" or (self.landmarks == "auto" and is_grid)
        if two_d:
            side = math.isqrt(self.num_proposals)
            if side * side != self.num_proposals:
                raise ValueError(f"lara_num_samples={self.num_proposals} must be a perfect square for 2-D landmarks.")
            if not is_grid:
                raise ValueError(f"2-D landmarks need the tokens to be exactly a patch grid ({length} tokens, grid "
                                 f"{grid_size}); use pooling='mean' (no class token) or lara_landmarks='1d'.")

            def pool(x):  # pool the grid to side x side cells, then the landmark transform (official order)
                grid = x.reshape(batch * self.num_heads, *grid_size, -1).permute(0, 3, 1, 2)
                pooled = nn.functional.adaptive_avg_pool2d(grid, side).flatten(2).transpose(1, 2)
                return pooled.reshape(batch, self.num_heads, self.num_proposals, -1)

            return self._transform(self.landmark_q, pool(q)), self._transform(self.landmark_k, pool(k)), None
        if key_mask is None and length >= self.num_proposals:
            mean, valid = self._unpadded_segment_means(length, q.device, q.dtype), None  # every proposal exists
        else:
            assign = segment_assignment(key_mask, batch, length, self.num_proposals, q.device).to(q.dtype)
            counts = assign.sum(-1)
            mean, valid = assign / counts.clamp(min=1).unsqueeze(-1), counts > 0
        if torch.is_grad_enabled() and self.landmark_q is not None:
            # Recompute the per-token Linear+LayerNorm in the backward pass instead of storing [N, d] activations.
            q_bar, k_bar = checkpoint(self._segment_landmarks, q, k, mean, use_reentrant=False)
        else:
            q_bar, k_bar = self._segment_landmarks(q, k, mean)
        return q_bar, k_bar, valid

    def _segment_landmarks(self, q, k, mean):
        """Segment means of the transformed tokens (1-D order: Linear+LayerNorm on every token, then the mean)."""
        equation = "cn,bhnd->bhcd" if mean.dim() == 2 else "bcn,bhnd->bhcd"
        return (torch.einsum(equation, mean, self._transform(self.landmark_q, q)),
                torch.einsum(equation, mean, self._transform(self.landmark_k, k)))

    def _unpadded_segment_means(self, length, device, dtype):
        key = (length, device, dtype)
        if key not in self._segment_cache:  # the same for every unpadded batch of this length
            assign = segment_assignment(None, 1, length, self.num_proposals, device)[0].to(dtype)
            self._segment_cache = {key: assign / assign.sum(-1, keepdim=True)}
        return self._segment_cache[key]

    def _proposal_means(self, q_bar_hat, k_bar_hat, valid):
        if self.proposal_mean == "q+k":
            return q_bar_hat + k_bar_hat
        logits = k_bar_hat @ k_bar_hat.transpose(-1, -2)
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        return q_bar_hat + logits.softmax(-1) @ k_bar_hat

    def _draw(self, mu):
        if self.training and self.noise_std:
            # randn(shape), not randn_like: the draws must not depend on the tensor's memory layout.
            return mu + self.noise_std * torch.randn(mu.shape, device=mu.device, dtype=mu.dtype)
        return mu

    # -- bidirectional ------------------------------------------------------------------------------------
    def _bidirectional_terms(self, hidden_states, attention_mask, grid_size):
        q, k, v = self._inputs(hidden_states)
        key_mask = check_attention_mask(attention_mask, q.shape[0], q.shape[2])
        return self.bidirectional_terms(q, k, v, key_mask, grid_size)

    def bidirectional_terms(self, q, k, v, key_mask=None, grid_size=None):
        """The inputs of `snis_attention` for per-head q, k, v [B, H, N, d] (unscaled): it can also be applied to
        another model's projections (the approximation-quality benchmark does)."""
        scale = self.head_dim ** -0.25
        q_bar, k_bar, valid = self._landmarks(q, k, key_mask, grid_size)
        q_hat, k_hat, q_bar_hat = q * scale, k * scale, q_bar * scale
        mu = self._proposal_means(q_bar_hat, k_bar * scale, valid)
        per = self.samples_per_proposal
        omega = self._draw(mu.repeat_interleave(per, dim=2) if per > 1 else mu)  # sample j: proposal j // per
        log_q = log_features_at(q_hat, omega)
        log_k = log_features_at(k_hat, omega)
        if key_mask is not None:
            log_k = log_k.masked_fill(~key_mask[:, None, :, None], float("-inf"))
        # G[j, c] = log q̃_c(ω_j): every proposal's density at every sample, relative to N(0, I).
        log_density = log_features_at(mu, omega).transpose(-1, -2)
        if valid is not None:
            log_density = log_density.masked_fill(~valid[:, None, None, :], float("-inf"))
        own = torch.arange(omega.shape[2], device=q.device) // per
        if per == 1:
            log_proposal = torch.diagonal(log_density, dim1=-2, dim2=-1)  # [B, H, C]
        else:
            log_proposal = log_density[..., torch.arange(omega.shape[2], device=q.device), own]  # [B, H, CS]
        log_balance = log_proposal - torch.logsumexp(log_density, dim=-1)
        if self.weighting == "balance":
            log_alpha = log_balance.unsqueeze(2)
        else:
            log_alpha = self._query_specific(q_hat, q_bar_hat, valid, key_mask, log_balance, own, per)
        if valid is not None:
            sample_valid = valid.repeat_interleave(per, dim=1)
            log_alpha = log_alpha.masked_fill(~sample_valid[:, None, None, :], float("-inf"))
            # A proposal from an empty segment (fewer real tokens than proposals) has weight −inf already; a finite
            # density keeps −inf − (−inf) = NaN out of its log-weight.
            log_proposal = log_proposal.masked_fill(~sample_valid[:, None, :], 0.0)
        return log_q, log_k, v, log_alpha, log_proposal.unsqueeze(2)

    def _query_specific(self, q_hat, q_bar_hat, valid, key_mask, log_balance, own, per):
        """Eq. 38: α_nc = β_c + λ (r_nc − mean_c r_nc), r = normalised query-landmark similarity."""
        logits = q_hat @ q_bar_hat.transpose(-1, -2)
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        if self.r_normalize == "queries":  # the official code: softmax over the sequence axis
            if key_mask is not None:
                logits = logits.masked_fill(~key_mask[:, None, :, None], float("-inf"))
                r = torch.nan_to_num(logits.softmax(dim=2), nan=0.0)  # an empty proposal column
            else:
                r = logits.softmax(dim=2)
        else:
            r = logits.softmax(dim=-1)
        count = valid.sum(-1).clamp(min=1)[:, None, None, None] if valid is not None else r.shape[-1]
        centred = r - r.sum(-1, keepdim=True) / count
        if per > 1:
            centred = centred[..., own]
        alpha = log_balance.exp().unsqueeze(2) + self.alpha_coeff * centred
        return alpha.clamp(min=ALPHA_FLOOR).log()

    # -- causal (this project's extension) ------------------------------------------------------------------
    def _causal_terms(self, q, k, v, n_real):
        """Features of the chunk-causal form for left-aligned q, k, v [B, H, N, d] with n_real real tokens per row:
        log query weights log a [B, H, N, P] and log key features [B, H, N, P] over P = 1 + chunks proposals,
        with the proposals themselves (ω, μ, query landmarks), as a dict."""
        batch, heads, length, dim = q.shape
        chunk = self.chunk_size
        chunks = -(-length // chunk)
        pad = chunks * chunk - length
        scale = dim ** -0.25
        token_valid = torch.arange(length, device=q.device)[None, :] < n_real[:, None]
        weights = nn.functional.pad(token_valid.to(q.dtype), (0, pad)).view(batch, 1, chunks, chunk, 1)
        count = weights.sum(3).clamp(min=1)

        def chunk_mean(x):
            x = nn.functional.pad(x, (0, 0, 0, pad)).view(batch, heads, chunks, chunk, dim)
            return (x * weights).sum(3) / count

        q_bar = chunk_mean(self._transform(self.landmark_q, q)) * scale
        k_bar = chunk_mean(self._transform(self.landmark_k, k)) * scale
        zeros = q.new_zeros(batch, heads, 1, dim)  # the prior proposal μ_0 = 0 (and its query landmark)
        mu = torch.cat([zeros, q_bar + k_bar], dim=2)
        q_bar = torch.cat([zeros, q_bar], dim=2)
        omega = self._draw(mu)
        q_hat, k_hat = q * scale, k * scale
        log_q = log_features_at(q_hat, omega)
        log_k = log_features_at(k_hat, omega).masked_fill(~token_valid[:, None, :, None], float("-inf"))
        log_density = log_features_at(mu, omega).transpose(-1, -2)  # G[p, p'] = log q̃_p'(ω_p)
        own = torch.diagonal(log_density, dim1=-2, dim2=-1)  # [B, H, P]
        query_chunk = torch.arange(length, device=q.device) // chunk  # proposals 0..j are available in chunk j
        available = torch.arange(chunks + 1, device=q.device)[None, :] <= query_chunk[:, None]  # [N, P]
        # Balance heuristic over the available proposals: a running log-sum-exp over p' ≤ j.
        running = torch.logcumsumexp(log_density, dim=-1)  # [B, H, P(sample), P(prefix end)]
        log_balance = own.unsqueeze(-2) - running.transpose(-1, -2)[:, :, query_chunk]  # [B, H, N, P]
        # Mask before exp: an unavailable proposal's value can overflow, and inf would turn its zero gradient NaN.
        alpha = log_balance.masked_fill(~available, float("-inf")).exp()
        if self.weighting == "query_specific":
            logits = (q_hat @ q_bar.transpose(-1, -2)).masked_fill(~available, float("-inf"))
            r = logits.softmax(-1)
            alpha = alpha + self.alpha_coeff * (r - 1.0 / (query_chunk[:, None] + 1))
        log_alpha = alpha.clamp(min=ALPHA_FLOOR).log().masked_fill(~available, float("-inf"))
        return {"log_a": log_alpha + log_q - own.unsqueeze(-2), "log_k": log_k, "omega": omega, "mu": mu,
                "q_bar": q_bar, "token_valid": token_valid}

    def _weights(self, q_hat, omega, mu, q_bar, available):
        """log a [B, H, T, P] for queries q̂ [B, H, T, d] given the proposals available to each (bool [B, T, P])."""
        log_q = log_features_at(q_hat, omega)
        log_density = log_features_at(mu, omega).transpose(-1, -2).unsqueeze(2)  # [B, H, 1, P, P]
        log_density = log_density.masked_fill(~available[:, None, :, None, :], float("-inf"))
        own = torch.diagonal(log_features_at(mu, omega), dim1=-2, dim2=-1).unsqueeze(2)  # [B, H, 1, P]
        alpha = (own - torch.logsumexp(log_density, dim=-1)).masked_fill(~available[:, None], float("-inf")).exp()
        if self.weighting == "query_specific":
            logits = (q_hat @ q_bar.transpose(-1, -2)).masked_fill(~available[:, None], float("-inf"))
            count = available.sum(-1)[:, None, :, None]
            alpha = alpha + self.alpha_coeff * (logits.softmax(-1) - 1.0 / count)
        log_alpha = alpha.clamp(min=ALPHA_FLOOR).log().masked_fill(~available[:, None], float("-inf"))
        return log_alpha + log_q - own

    def _causal(self, hidden_states, attention_mask, layer=None):
        q, k, v = self._inputs(hidden_states)
        batch, _, length, _ = q.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        order = None
        if key_mask is not None:  # left-align the real tokens, so chunks count real tokens in every row
            order = torch.argsort((~key_mask).to(torch.int8), dim=-1, stable=True)
            gather = order[:, None, :, None]
            q, k, v = (torch.gather(t, 2, gather.expand_as(t)) for t in (q, k, v))
            n_real = key_mask.sum(-1)
        else:
            n_real = torch.full((batch,), length, device=q.device)
        terms = self._causal_terms(q, k, v, n_real)
        log_a, log_k = terms["log_a"], terms["log_k"]
        # Per-proposal key constants (detached) move to the query side, where they cancel in each query's ratio.
        key_max = log_k.amax(dim=2, keepdim=True).detach()
        key_max = torch.where(torch.isfinite(key_max), key_max, torch.zeros_like(key_max))
        log_phi_q = log_a + key_max
        phi_q = torch.exp(log_phi_q - log_phi_q.amax(-1, keepdim=True).detach())
        phi_k = torch.exp(log_k - key_max)
        out = linear_attention_causal(phi_q, phi_k, v, self.chunk_size)
        if layer is not None:
            self._start_state(layer, q, k, v, n_real, terms, phi_k, key_max)
        if order is not None:
            out = torch.empty_like(out).scatter_(2, order[:, None, :, None].expand_as(out), out)
        return out

    # -- entry points -----------------------------------------------------------------------------------------
    def forward(self, hidden_states, attention_mask=None, past_key_values=None, replay=None, grid_size=None):
        if self.causal:
            if past_key_values is not None:
                out = self._decode(hidden_states, attention_mask, past_key_values.layers[self.layer_idx])
            else:
                out = self._causal(hidden_states, attention_mask)
        else:
            out = snis_attention(*self._bidirectional_terms(hidden_states, attention_mask, grid_size))
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))

    def reference_forward(self, hidden_states, attention_mask=None, past_key_values=None, replay=None,
                          grid_size=None):
        """The linear-attention form of the same estimator, without any stabilisation (spec §4.1):
        out_n = Σ_c a_nc S_c / Σ_c a_nc z_c, a_nc = α_nc ξ(q̂_n, ω_c) / q̃_c(ω_c), S_c = Σ_m ξ(k̂_m, ω_c) v_m,
        z_c = Σ_m ξ(k̂_m, ω_c); the causal form sums over m <= n with a quadratic mask."""
        if self.causal:
            q, k, v = self._inputs(hidden_states)
            key_mask = check_attention_mask(attention_mask, q.shape[0], q.shape[2])
            if key_mask is not None:
                raise ValueError("the causal reference handles unpadded input only")
            terms = self._causal_terms(q, k, v, torch.full((q.shape[0],), q.shape[2], device=q.device))
            log_a, log_k = terms["log_a"], terms["log_k"]
            scores = (log_a.exp() @ log_k.exp().transpose(-1, -2)).tril()
            out = scores @ v / scores.sum(-1, keepdim=True)
        else:
            log_q, log_k, v, log_alpha, log_proposal = self._bidirectional_terms(hidden_states, attention_mask,
                                                                                 grid_size)
            a = torch.exp(log_alpha + log_q - log_proposal)
            xi_k = log_k.exp()
            out = (a @ (xi_k.transpose(-1, -2) @ v)) / (a @ xi_k.sum(-2).unsqueeze(-1))
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))

    # -- decoding from a recurrent state ----------------------------------------------------------------------
    def new_cache_layer(self):
        return LaraStateLayer()

    def _start_state(self, layer, q, k, v, n_real, terms, phi_k, key_max):
        """The state after a prefill: real keys/values (left-aligned), the proposals of completed chunks and their
        prefix sums over all real keys, and the running landmark sums of the unfinished chunk."""
        chunk, scale = self.chunk_size, self.head_dim ** -0.25
        counts = n_real.tolist()  # one host copy per prefill; decoding steps then never wait for the device
        token_valid = terms["token_valid"]
        in_partial = token_valid & (torch.arange(q.shape[2], device=q.device)[None, :] >= (n_real // chunk *
                                                                                            chunk)[:, None])
        partial = in_partial[:, None, :, None].to(q.dtype)
        layer.start(counts, q.shape[2], k_hat=k * scale, v=v, omega=terms["omega"], mu=terms["mu"],
                    q_bar=terms["q_bar"],
                    s=torch.einsum("bhnp,bhne->bhpe", phi_k, v), z=phi_k.sum(2), c=key_max.squeeze(2),
                    q_sum=(self._transform(self.landmark_q, q) * partial).sum(2),
                    k_sum=(self._transform(self.landmark_k, k) * partial).sum(2))

    def _decode(self, hidden_states, attention_mask, layer):
        if not layer.state:
            return self._causal(hidden_states, attention_mask, layer)
        # A continuation after the prefill; generate() feeds one token at a time, so this loop is not a hot path.
        return torch.cat([self._step(hidden_states[:, t:t + 1], layer) for t in range(hidden_states.shape[1])], 2)

    def _step(self, hidden_states, layer):
        """One new (real) token per row: update every available proposal's prefix sums, weight the proposals,
        and when a row completes a chunk, add that chunk's proposal with prefix sums over all its keys."""
        q, k, v = self._inputs(hidden_states)
        chunk, scale = self.chunk_size, self.head_dim ** -0.25
        q_hat, k_hat = q * scale, k * scale
        state, counts = layer.state, layer.counts
        device = q.device
        position = torch.tensor(counts, device=device)
        proposals = state["omega"].shape[2]
        available = torch.arange(proposals, device=device)[None, :] <= (position // chunk)[:, None]  # [B, P]
        # Prefix sums with a running max per proposal (the state is rescaled when the max grows).
        log_k = log_features_at(k_hat, state["omega"]).squeeze(2)  # [B, H, P]
        c = torch.maximum(state["c"], log_k)
        rescale = torch.exp(state["c"] - c)
        s = state["s"] * rescale.unsqueeze(-1) + torch.exp(log_k - c).unsqueeze(-1) * v
        z = state["z"] * rescale + torch.exp(log_k - c)
        log_a = self._weights(q_hat, state["omega"], state["mu"], state["q_bar"], available[:, None, :]).squeeze(2)
        logits = (log_a + c + torch.log(z)).masked_fill(~available[:, None, :], float("-inf"))
        out = (logits.softmax(-1).unsqueeze(-1) * (s / z.unsqueeze(-1))).sum(2, keepdim=True)
        q_sum = state["q_sum"] + self._transform(self.landmark_q, q).squeeze(2)
        k_sum = state["k_sum"] + self._transform(self.landmark_k, k).squeeze(2)
        layer.append_token(k_hat, v, s=s, z=z, c=c, q_sum=q_sum, k_sum=k_sum)
        finished = [row for row, n in enumerate(layer.counts) if n % chunk == 0]
        if finished:
            self._add_proposals(layer, finished)
        return out

    def _add_proposals(self, layer, rows):
        """Proposals for rows that just completed a chunk: Eq. 34 from the chunk's landmarks, with prefix sums over
        every real key so far (O(n·d) once per chunk, from the stored keys)."""
        chunk, scale = self.chunk_size, self.head_dim ** -0.25
        state = layer.state
        rows_t = torch.tensor(rows, device=state["s"].device)
        q_bar = state["q_sum"][rows_t] / chunk * scale
        mu = q_bar + state["k_sum"][rows_t] / chunk * scale
        omega = self._draw(mu)
        keys, values = state["k_hat"][rows_t], state["v"][rows_t]
        length = torch.tensor([layer.counts[r] for r in rows], device=keys.device)
        valid = torch.arange(keys.shape[2], device=keys.device)[None, :] < length[:, None]
        log_k = log_features_at(keys, omega.unsqueeze(2)).squeeze(-1).masked_fill(~valid[:, None], float("-inf"))
        c = log_k.amax(-1)
        weights = torch.exp(log_k - c.unsqueeze(-1))
        slots = [layer.counts[r] // chunk for r in rows]
        layer.set_proposals(rows, slots, omega=omega, mu=mu, q_bar=q_bar,
                            s=torch.einsum("bhn,bhne->bhe", weights, values), z=weights.sum(-1), c=c)
        for name in ("q_sum", "k_sum"):
            state[name][rows_t] = 0.0


class LaraStateLayer(RecurrentStateLayer):
    """Causal LARA's decoding state (see `_start_state`), with host-side counts of real tokens per row so that
    chunk completions are known without waiting for the device. Keys and values are kept with spare capacity
    (doubling), so appending a token does not copy the whole store."""

    def __init__(self):
        super().__init__()
        self.counts: list[int] = []

    def start(self, counts, positions: int, **tensors):
        """`counts`: real tokens per row; `positions`: the prefill's length, padding included (what the attention
        mask of the next step covers before the new token)."""
        self.counts = list(counts)
        self.store(positions, **tensors)

    def append_token(self, k_hat, v, **tensors):
        keys, values = self.state["k_hat"], self.state["v"]
        needed = max(self.counts) + 1
        if needed > keys.shape[2]:
            grow = max(needed, 2 * keys.shape[2]) - keys.shape[2]
            keys = torch.nn.functional.pad(keys, (0, 0, 0, grow))
            values = torch.nn.functional.pad(values, (0, 0, 0, grow))
        index = torch.tensor(self.counts, device=keys.device)[:, None, None, None]
        keys = keys.scatter(2, index.expand(-1, keys.shape[1], 1, keys.shape[3]), k_hat)
        values = values.scatter(2, index.expand(-1, values.shape[1], 1, values.shape[3]), v)
        self.counts = [n + 1 for n in self.counts]
        self.store(1, k_hat=keys, v=values, **tensors)

    def set_proposals(self, rows, slots, **tensors):
        needed = max(slots) + 1
        for name, value in tensors.items():
            current = self.state[name]
            if needed > current.shape[2]:
                pad = [0, 0] * (current.dim() - 3) + [0, needed - current.shape[2]]
                current = torch.nn.functional.pad(current, pad)
            current = current.clone()
            current[rows, :, slots] = value
            self.state[name] = current

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.counts = [self.counts[i] for i in beam_idx.tolist()]

    def batch_repeat_interleave(self, repeats):
        super().batch_repeat_interleave(repeats)
        self.counts = [n for n in self.counts for _ in range(repeats)]

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self.counts = [self.counts[i] for i in indices.tolist()]

    def reset(self):
        super().reset()
        self.counts = []
