"""Linear Randomized Attention (LARA; "Linear Complexity Randomized Self-attention Mechanism", Zheng, Wang and Kong,
ICML 2022, arXiv 2204.04667, §4; equation numbers are the paper's, the estimator is written out in
docs/random_feature_attention.md).

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

In causal (decoder) layers the module is this project's causal LARA (`lara_causal.py`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from attnzoo.modeling.attention.base import check_attention_mask, register_attention
from attnzoo.modeling.attention.lara_base import LARABase
from attnzoo.modeling.attention.lara_causal import ALPHA_FLOOR, CausalLARA
from attnzoo.modeling.attention.random_features import log_features_at, snis_attention


def segment_assignment(key_mask: torch.Tensor | None, batch: int, length: int, segments: int,
                       device) -> torch.Tensor:
    """[B, C, N] 0/1: which segment each real token belongs to (1-D landmarks).

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


class BidirectionalLARA(LARABase):
    """The paper's bidirectional estimator (module docstring), over `LARABase`'s settings, landmark transforms, draws
    and image-grid check, which `lara_causal.CausalLARA` shares."""

    def _landmarks(self, q, k, key_mask, grid_size):
        """(q̄, k̄ [B, H, C, d] unscaled, valid [B, C] bool, or None when every proposal has tokens)."""
        batch, _, length, _ = q.shape
        is_grid = grid_size is not None and grid_size[0] * grid_size[1] == length
        # "auto": 2-D when the tokens are exactly the patch grid; with a class token, 1-D segments.
        two_d = self.landmarks == "2d" or (self.landmarks == "auto" and is_grid)
        if two_d:
            side = math.isqrt(self.num_proposals)  # a perfect square: checked by the config or set_image_layout
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

    # -- bidirectional ------------------------------------------------------------------------------------
    def _bidirectional_terms(self, hidden_states, attention_mask, position_ids=None):
        q, k, v = self._inputs(hidden_states, position_ids)
        key_mask = check_attention_mask(attention_mask, q.shape[0], q.shape[2])
        return self.bidirectional_terms(q, k, v, key_mask)

    def bidirectional_terms(self, q, k, v, key_mask=None, grid_size=None):
        """The inputs of `snis_attention` for per-head q, k, v [B, H, N, d] (unscaled): it can also be applied to
        another model's projections (the approximation-quality benchmark does). `grid_size` (rows, cols) of the
        tokens' image grid defaults to the one an image encoder declared (`set_image_layout`)."""
        grid_size = grid_size if grid_size is not None else self.image_grid
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


@register_attention("lara")
class LinearRandomizedAttention(BidirectionalLARA, CausalLARA):
    """LARA: the paper's bidirectional estimator in encoder layers, this project's causal one in decoder layers. The
    two forms share `LARABase` and define disjoint methods; this class picks one by the layer's causality."""

    # only decoders decode, with causal LARA's state
    def new_cache_layer(self):
        return CausalLARA.new_cache_layer(self)

    def new_static_cache_layer(self, max_cache_len: int):
        return CausalLARA.new_static_cache_layer(self, max_cache_len)

    def forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        if self.causal:
            out = self.causal_forward(hidden_states, attention_mask, self.cache_slot(cache), position_ids)
        else:
            out = snis_attention(*self._bidirectional_terms(hidden_states, attention_mask, position_ids))
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))

    def reference_forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        """The linear-attention form of the same estimator, without any stabilisation:
        out_n = Σ_c a_nc S_c / Σ_c a_nc z_c, a_nc = α_nc ξ(q̂_n, ω_c) / q̃_c(ω_c), S_c = Σ_m ξ(k̂_m, ω_c) v_m,
        z_c = Σ_m ξ(k̂_m, ω_c); the causal form sums over m <= n with a quadratic mask."""
        if self.causal:
            out = self.causal_reference(hidden_states, attention_mask, position_ids)
        else:
            log_q, log_k, v, log_alpha, log_proposal = self._bidirectional_terms(hidden_states, attention_mask,
                                                                                 position_ids)
            a = torch.exp(log_alpha + log_q - log_proposal)
            xi_k = log_k.exp()
            out = (a @ (xi_k.transpose(-1, -2) @ v)) / (a @ xi_k.sum(-2).unsqueeze(-1))
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))
