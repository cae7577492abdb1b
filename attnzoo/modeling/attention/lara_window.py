"""Causal LARA as the far part of a windowed layer ("lara_window"): each query attends exactly, with softmax weights,
to its window and sinks (`window_size`, `num_sink_tokens`, as the "window" attention), and through causal LARA's
proposals to every earlier key outside them, with ONE normalisation over both parts (`windowed.WindowedAttention`):

    out_i = (Σ_{j∈near(i)} exp(s_ij) v_j + Σ_{j∈far(i)} κ_ij v_j) / (Σ_{j∈near(i)} exp(s_ij) + Σ_{j∈far(i)} κ_ij),
    κ_ij = Σ_p a_ip ξ(k̂_j, ω_p),   a_ip = α_ip ξ(q̂_i, ω_p) / q̃_p(ω_p),   s_ij = q_i·k_j / √d = q̂_i·k̂_j,

with ξ(x̂, ω) = exp(ω·x̂ − ‖x̂‖²/2) and q̃_p(ω) = N(ω; μ_p, I) / N(ω; 0, I). κ is the multiple-importance-sampling
estimate of exp(s_ij) against N(ω; 0, I) ("Linear Complexity Randomized Self-attention Mechanism", arXiv
2204.04667, §4): with ω_p ~ N(μ_p, I) and weights α_ip summing to 1 over the proposals available to query i, its
mean is E_{N(0,I)}[ξ(q̂, ω) ξ(k̂, ω)] = exp(q̂·k̂), the same scale as the window's exact weights, so no mixing factor
is needed (evaluation takes ω_p = μ_p, as LARA does: deterministic, on the same scale). The proposals, weights and
their availability are causal LARA's (`lara_causal.CausalLARA`, docs/random_feature_attention.md, section 5: a
proposal per completed chunk of `lara_chunk_size` real tokens plus the prior μ_0 = 0, α −∞ for a proposal not yet
available), with all of LARA's settings (landmark transform, weighting, sample noise): `lara_causal.CausalLARATerms`
over `lara_base.LARASettings`, whose landmark transforms are kept on the layer under the "lara" attention's names.
This is the window-plus-linear layer of LoLCATs ("LoLCATs: On Low-Rank Linearizing of Large Language Models", arXiv
2410.10254, §3.2) with LARA as the linear part.

The parallel form is `window_linear.feature_far_parallel` with a = log a_ip and b = log ξ(k̂_j, ω_p) (blocks of
`window_size` tokens, per-feature running key maxima folded into the query side, exact and causal). Cost: the
window's O(L·(W + S)), causal LARA's O(L·P) features (P = 1 + L / chunk) and O((L / W)·P·d) block sums.

Decoding keeps, beside the window's ring, what causal LARA's own decoding keeps (`lara_causal.LaraStateLayer`): every
real key and value (with `num_key_value_heads` heads), because a proposal that appears when a chunk completes needs
its sums over all earlier far keys, the proposals and the running landmark sums of the unfinished chunk. Its
per-proposal sums cover only the keys that have left the window and are not sinks (positions S .. t − W for the
token at position t), each with its own running maximum. Chunk completions are counted on the device, from each
token's real position (a padded token completes nothing), and a chunk's proposal is computed only when a row
completes one.
"""

from __future__ import annotations

import torch

from attnzoo.modeling.attention.lara_base import LARASettings
from attnzoo.modeling.attention.lara_causal import CausalLARATerms
from attnzoo.modeling.attention.random_features import log_features_at
from attnzoo.modeling.attention.window import gather_tokens, left_align, restore_order
from attnzoo.modeling.attention.window_linear import (
    add_far_key,
    dense_feature_far,
    far_sums,
    feature_far_parallel,
    keys_far_from,
    read_far,
)
from attnzoo.modeling.attention.windowed import FarInputs, FarOutput, FarPart, register_far_part
from attnzoo.modeling.cache import with_spare_tokens, write_at_rows


@register_far_part("lara")
class LARAFarPart(CausalLARATerms, LARASettings, FarPart):
    """Causal LARA beyond the window; see the module docstring."""

    family_config = "ZooLARASettings"
    plain_kind = "lara"

    def __init__(self, layer, config):
        super().__init__(layer, config)
        self.add_lara_settings(config, True, layer)

    @property
    def landmark_q(self):
        return self.layer.landmark_q

    @property
    def landmark_k(self):
        return self.layer.landmark_k

    # -- the parallel form ------------------------------------------------------------------------------------------
    def parallel(self, x: FarInputs) -> FarOutput:
        q, k, v = x.q, self.expand_kv(x.k), self.expand_kv(x.v)
        n_real = x.n_real
        terms = self._causal_terms(q, k, v, n_real)  # chunks count real tokens: the rows are left-aligned
        out = feature_far_parallel(terms["log_a"], terms["log_k"], v, n_real, self.window_size, self.sinks)
        return FarOutput(*out, self._start_state(q, k, x.k, x.v, v, n_real, terms) if x.keep_state else None)

    # -- decoding ---------------------------------------------------------------------------------------------------
    def _start_state(self, q, k, k_grouped, v_grouped, v, n_real, terms):
        """The state after a prefill of left-aligned tokens: the real keys (scaled, k̂) and values with their
        key/value heads, the proposals of completed chunks, their per-proposal sums over the far keys of the last
        token (positions sinks .. n_real - window - 1), and the running landmark sums of the unfinished chunk."""
        chunk, length = self.chunk_size, q.shape[2]
        position = torch.arange(length, device=q.device)[None, :]
        gone = keys_far_from(n_real - 1, length, self.window_size, self.sinks)
        in_partial = terms["token_valid"] & (position >= (n_real // chunk * chunk)[:, None])
        partial = in_partial[:, None, :, None].to(q.dtype)
        return dict(k_hat=with_spare_tokens(k_grouped * self.head_dim ** -0.25), v=with_spare_tokens(v_grouped),
                    omega=terms["omega"], mu=terms["mu"], q_bar=terms["q_bar"], **far_sums(terms["log_k"], v, gone),
                    q_sum=(self._transform(self.landmark_q, q) * partial).sum(2),
                    k_sum=(self._transform(self.landmark_k, k) * partial).sum(2))

    def step(self, x: FarInputs) -> FarOutput:
        """One new token per row: the key leaving the window joins the far sums, a real token joins the store and
        the landmark sums, the output reads the far part from the sums of the available proposals; a row whose
        token completes a chunk then gets that chunk's proposal (`torch.cond`: computed only at a chunk's end,
        counted on the device from the token's real position)."""
        sums, chunk = x.state, self.chunk_size
        key_scale = self.head_dim ** -0.25
        position, real = x.position[:, 0], x.valid[:, 0]
        leaving_k, leaving_v, joins = x.leaving
        log_k = log_features_at(self.expand_kv(leaving_k) * key_scale, sums["omega"]).squeeze(2)  # [B, H, P]
        far = add_far_key(sums["kv_sum"], sums["key_sum"], sums["key_level"], log_k,
                          self.expand_kv(leaving_v).squeeze(2), joins)
        gate = real[:, None, None].to(x.q.dtype)
        q_sum = sums["q_sum"] + self._transform(self.landmark_q, x.q).squeeze(2) * gate
        k_sum = sums["k_sum"] + self._transform(self.landmark_k, self.expand_kv(x.k)).squeeze(2) * gate
        # the token's key at its position (a padded token's is overwritten by the next real one)
        k_hat = write_at_rows(sums["k_hat"], position, x.k * key_scale, x.seen + 1)
        v = write_at_rows(sums["v"], position, x.v, x.seen + 1)
        # the proposals available to this token: 0 .. position // chunk
        available = torch.arange(sums["omega"].shape[2], device=x.q.device)[None, :] <= (position // chunk)[:, None]
        log_a = self._weights(x.q * key_scale, sums["omega"], sums["mu"], sums["q_bar"], available[:, None, :])
        out = read_far(log_a, far["kv_sum"], far["key_sum"], far["key_level"])
        proposals = {"omega": sums["omega"], "mu": sums["mu"], "q_bar": sums["q_bar"], **far}
        finished = real & ((position + 1) % chunk == 0)  # [B]
        new = torch.cond(finished.any(), self._chunk_proposal, _no_proposal, (position, k_hat, v, q_sum, k_sum))
        slot = (position + 1) // chunk  # the next proposal slot of a row that finished (unused otherwise)
        batch, heads = q_sum.shape[:2]
        needed = (x.seen + 1) // chunk + 1  # a slot for every chunk the tokens so far can have completed
        for name, fresh in zip(("omega", "mu", "q_bar", "kv_sum", "key_sum", "key_level"), new, strict=True):
            current = proposals[name]
            if current.shape[2] < needed:  # once per chunk: exactly the slots causal LARA's state holds
                pad = [0, 0] * (current.dim() - 3) + [0, needed - current.shape[2]]
                current = torch.nn.functional.pad(current, pad)
            index = slot.view(batch, 1, 1, *([1] * (current.dim() - 3))).expand(batch, heads, 1, *current.shape[3:])
            fresh = fresh.view(batch, heads, 1, *current.shape[3:])
            kept = torch.where(finished.view(batch, *([1] * (current.dim() - 1))), fresh,
                               current.gather(2, index))
            proposals[name] = current.scatter(2, index, kept)
        keep = ~finished[:, None, None]
        return FarOutput(*out, dict(proposals, k_hat=k_hat, v=v, q_sum=q_sum * keep, k_sum=k_sum * keep))

    def _chunk_proposal(self, position, keys, values, q_sum, k_sum):
        """For every row, the proposal of the chunk its last `chunk_size` real tokens form (Eq. 34 from their landmark
        sums) with its sums over the stored keys that are far from the token at `position` [B] (O(n·d), once per
        chunk): (ω, μ, q̄ [B, H, d], kv_sum [B, H, e], key_sum, key_level [B, H]). The step keeps it for the rows
        that just completed a chunk."""
        omega, mu, q_bar = self._landmark_proposal(q_sum, k_sum)
        gone = keys_far_from(position, keys.shape[2], self.window_size, self.sinks)
        log_k = log_features_at(self.expand_kv(keys), omega.unsqueeze(2))  # [B, H, N, 1]
        far = far_sums(log_k, self.expand_kv(values), gone)
        # flat, as `_no_proposal`'s (the step restores the shapes): `cond` wants both branches' outputs dense, and
        # once dynamo has traced layers of several head counts, the heads `expand_kv` gives are a size it cannot prove
        # to be at least 1, whose contiguous stride (8 * Max(1, heads)) torch 2.11's `cond` rejects as not dense; a
        # 1-D tensor's stride is 1 whatever its size (cloned: no output may alias another)
        return tuple(t.reshape(-1).clone() for t in (
            omega, mu, q_bar, far["kv_sum"].squeeze(2), far["key_sum"].squeeze(2), far["key_level"].squeeze(2)))

    # -- reference --------------------------------------------------------------------------------------------------
    def reference_terms(self, q, k, v, valid):
        """(log a, log ξ(k̂, ω)) [B, H, L, P] in the tokens' own order: causal LARA's terms are computed on
        left-aligned rows (its chunks count real tokens) and moved back."""
        order = left_align(valid)
        terms = self._causal_terms(*(gather_tokens(x, order) for x in (q, k, v)), valid.sum(-1))
        return tuple(restore_order(terms[name], order) for name in ("log_a", "log_k"))

    def reference(self, x: FarInputs) -> FarOutput:
        """The dense form, no stabilisation: κ_ij = Σ_p exp(log a_ip + log ξ(k̂_j, ω_p)) on the far keys."""
        k, v = self.expand_kv(x.k), self.expand_kv(x.v)
        return FarOutput(*dense_feature_far(*self.reference_terms(x.q, k, v, x.valid), v, x.far))


def _no_proposal(position, keys, values, q_sum, k_sum):
    """The branch of the step's `torch.cond` where no row completed a chunk: placeholders of the proposal's sizes,
    flat as `_chunk_proposal`'s, never kept."""
    batch, heads, dim = q_sum.shape
    return (q_sum.new_zeros(batch * heads * dim), q_sum.new_zeros(batch * heads * dim),
            q_sum.new_zeros(batch * heads * dim), values.new_zeros(batch * heads * values.shape[-1]),
            q_sum.new_zeros(batch * heads), q_sum.new_zeros(batch * heads))
