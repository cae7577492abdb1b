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

Decoding keeps, beside the window's ring, what causal LARA's own decoding keeps (`LaraStateLayer`): every real key
and value (with `num_key_value_heads` heads), because a proposal that appears when a chunk completes needs its sums
over all earlier far keys, the proposals and the running landmark sums of the unfinished chunk. Its per-proposal
sums cover only the keys that have left the window and are not sinks (positions S .. t − W for the token at position
t), each with its own running maximum. As in causal LARA, tokens fed after a prefill are taken as real (generate()
extends the mask with ones): chunk completions are counted on the host.
"""

from __future__ import annotations

import torch

from attnzoo.modeling.attention.lara_base import LARASettings
from attnzoo.modeling.attention.lara_causal import CausalLARATerms, LaraStateLayer
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
from attnzoo.modeling.attention.windowed import FarPart, register_far_part


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

    def new_cache_layer(self):
        return LaraStateLayer()

    # -- the parallel form ------------------------------------------------------------------------------------------
    def parallel(self, q, k_grouped, v_grouped, n_real, recompute=None, state=None):
        k, v = self.layer.expand_kv(k_grouped), self.layer.expand_kv(v_grouped)
        terms = self._causal_terms(q, k, v, n_real)  # chunks count real tokens: the rows are left-aligned
        if state is not None:
            self._start_state(state, q, k, k_grouped, v_grouped, v, n_real, terms)
        return feature_far_parallel(terms["log_a"], terms["log_k"], v, n_real, self.layer.window_size,
                                    self.layer.sinks)

    # -- decoding ---------------------------------------------------------------------------------------------------
    def _start_state(self, state, q, k, k_grouped, v_grouped, v, n_real, terms):
        """The state after a prefill of left-aligned tokens: the real keys (scaled, k̂) and values with their
        key/value heads, the proposals of completed chunks, their per-proposal sums over the far keys of the last
        token (positions sinks .. n_real - window - 1), and the running landmark sums of the unfinished chunk."""
        chunk, length = self.chunk_size, q.shape[2]
        position = torch.arange(length, device=q.device)[None, :]
        gone = keys_far_from(n_real - 1, length, self.layer.window_size, self.layer.sinks)
        in_partial = terms["token_valid"] & (position >= (n_real // chunk * chunk)[:, None])
        partial = in_partial[:, None, :, None].to(q.dtype)
        state.start(n_real, 0, k_hat=k_grouped * self.head_dim ** -0.25, v=v_grouped, omega=terms["omega"],
                    mu=terms["mu"], q_bar=terms["q_bar"], **far_sums(terms["log_k"], v, gone),
                    q_sum=(self._transform(self.landmark_q, q) * partial).sum(2),
                    k_sum=(self._transform(self.landmark_k, k) * partial).sum(2))

    def step(self, state, q, k, v, real, position, leaving):
        """One new (real) token per row: the key leaving the window joins the far sums, the token joins the store
        and the landmark sums, the output reads the far part from the sums of the available proposals; a row that
        completes a chunk then gets that chunk's proposal."""
        sums, chunk = state.state, self.chunk_size
        key_scale = self.head_dim ** -0.25
        leaving_k, leaving_v, joins = leaving
        log_k = log_features_at(self.layer.expand_kv(leaving_k) * key_scale, sums["omega"]).squeeze(2)  # [B, H, P]
        far = add_far_key(sums["kv_sum"], sums["key_sum"], sums["key_level"], log_k,
                          self.layer.expand_kv(leaving_v).squeeze(2), joins)
        sums.update(far, q_sum=sums["q_sum"] + self._transform(self.landmark_q, q).squeeze(2),
                    k_sum=sums["k_sum"] + self._transform(self.landmark_k, self.layer.expand_kv(k)).squeeze(2))
        state.write_token(k * key_scale, v)
        # the proposals available to this token: 0 .. position // chunk
        available = torch.arange(sums["omega"].shape[2], device=q.device)[None, :] <= (position // chunk)[:, None]
        log_a = self._weights(q * key_scale, sums["omega"], sums["mu"], sums["q_bar"], available[:, None, :])
        out = read_far(log_a, far["kv_sum"], far["key_sum"], far["key_level"])
        finished = [row for row, n in enumerate(state.counts) if n % chunk == 0]
        if finished:
            self._add_proposals(state, finished)
        return out

    def _add_proposals(self, state, rows):
        """Proposals for rows that just completed a chunk: Eq. 34 from the chunk's landmarks, with per-proposal sums
        over the stored keys that have left the window and are not sinks (O(n·d) once per chunk)."""
        sums = state.state
        rows_t = torch.tensor(rows, device=sums["k_hat"].device)
        omega, mu, q_bar = self._landmark_proposal(sums["q_sum"][rows_t], sums["k_sum"][rows_t])
        keys, values = self.layer.expand_kv(sums["k_hat"][rows_t]), self.layer.expand_kv(sums["v"][rows_t])
        count = torch.tensor([state.counts[r] for r in rows], device=keys.device)
        gone = keys_far_from(count - 1, keys.shape[2], self.layer.window_size, self.layer.sinks)
        log_k = log_features_at(keys, omega.unsqueeze(2))  # [rows, H, N, 1]
        far = {name: value.squeeze(2) for name, value in far_sums(log_k, values, gone).items()}
        state.set_proposals(rows, [state.counts[r] // self.chunk_size for r in rows], omega=omega, mu=mu, q_bar=q_bar,
                            **far)
        for name in ("q_sum", "k_sum"):
            sums[name] = sums[name].index_fill(0, rows_t, 0.0)

    # -- reference --------------------------------------------------------------------------------------------------
    def reference_terms(self, q, k, v, valid):
        """(log a, log ξ(k̂, ω)) [B, H, L, P] in the tokens' own order: causal LARA's terms are computed on
        left-aligned rows (its chunks count real tokens) and moved back."""
        order = left_align(valid)
        terms = self._causal_terms(*(gather_tokens(x, order) for x in (q, k, v)), valid.sum(-1))
        return tuple(restore_order(terms[name], order) for name in ("log_a", "log_k"))

    def reference(self, q, k, v, valid, far, recompute=None):
        """The dense form, no stabilisation: κ_ij = Σ_p exp(log a_ip + log ξ(k̂_j, ω_p)) on the far keys."""
        k, v = self.layer.expand_kv(k), self.layer.expand_kv(v)
        return dense_feature_far(*self.reference_terms(q, k, v, valid), v, far)
