"""Causal LARA with an exact window inside every layer ("lara_window"): each query attends exactly, with softmax
weights, to its window and sinks (`window_size`, `num_sink_tokens`, as the "window" attention), and through causal
LARA's proposals to every earlier key outside them, with ONE normalisation over both parts:

    out_i = (Σ_{j∈near(i)} exp(s_ij) v_j + Σ_{j∈far(i)} κ_ij v_j) / (Σ_{j∈near(i)} exp(s_ij) + Σ_{j∈far(i)} κ_ij),
    κ_ij = Σ_p a_ip ξ(k̂_j, ω_p),   a_ip = α_ip ξ(q̂_i, ω_p) / q̃_p(ω_p),   s_ij = q_i·k_j / √d = q̂_i·k̂_j,

with ξ(x̂, ω) = exp(ω·x̂ − ‖x̂‖²/2) and q̃_p(ω) = N(ω; μ_p, I) / N(ω; 0, I). κ is the multiple-importance-sampling
estimate of exp(s_ij) against N(ω; 0, I) ("Linear Complexity Randomized Self-attention Mechanism", arXiv
2204.04667, §4): with ω_p ~ N(μ_p, I) and weights α_ip summing to 1 over the proposals available to query i, its
mean is E_{N(0,I)}[ξ(q̂, ω) ξ(k̂, ω)] = exp(q̂·k̂), the same scale as the window's exact weights, so no mixing factor
is needed (evaluation takes ω_p = μ_p, as LARA does: deterministic, on the same scale). The proposals, weights and
their availability are causal LARA's (`lara_causal.CausalLARA`, docs/random_feature_attention.md, section 5: a
proposal per completed chunk of `lara_chunk_size` real tokens plus the prior μ_0 = 0, α −∞ for a proposal not yet
available), with all of LARA's settings (landmark transform, weighting, sample noise). This is the
window-plus-linear layer of LoLCATs ("LoLCATs: On Low-Rank Linearizing of Large Language Models", arXiv 2410.10254,
§3.2) with LARA as the linear part.

The parallel form is `window_linear.blocked_far_part` with a = log a_ip and b = log ξ(k̂_j, ω_p) (blocks of
`window_size` tokens, per-feature running key maxima folded into the query side, exact and causal). Cost: the
window's O(L·(W + S)), causal LARA's O(L·P) features (P = 1 + L / chunk) and O((L / W)·P·d) block sums.

Decoding keeps what causal LARA's own decoding keeps (`LaraStateLayer`): every real key and value (with
`num_key_value_heads` heads), because a proposal that appears when a chunk completes needs its sums over all earlier
far keys, the proposals and the running landmark sums of the unfinished chunk. Its per-proposal sums cover only the
keys that have left the window and are not sinks (positions S .. t − W for the token at position t), each with its
own running maximum; the window part reads the sinks and the last `window_size` tokens from the stored keys, so the
window adds no store of its own. As in causal LARA, tokens fed after a prefill are taken as real (generate() extends
the mask with ones): chunk completions are counted on the host.
"""

from __future__ import annotations

import math

import torch

from attnzoo.modeling.attention.base import check_attention_mask, register_attention
from attnzoo.modeling.attention.lara_causal import CausalLARA, LaraStateLayer
from attnzoo.modeling.attention.random_features import log_features_at
from attnzoo.modeling.attention.window import (
    WindowInsideLayer,
    beyond_window,
    combine,
    dense_near_and_far,
    gather_tokens,
    left_align,
    outside_window,
    restore_order,
    window_scores,
)
from attnzoo.modeling.attention.window_linear import (
    WindowedLinearForward,
    add_far_key,
    blocked_far_part,
    far_key_mask,
    far_sums,
    keys_far_from,
    read_far,
)
from attnzoo.ops.chunked_attention import mask_values


@register_attention("lara_window")
class WindowedLARA(WindowInsideLayer, WindowedLinearForward, CausalLARA):
    """Exact window and sinks plus causal LARA beyond them, one softmax normalisation; see the module docstring."""

    plain_kind = "lara"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def new_cache_layer(self):
        return LaraStateLayer()

    # -- the parallel form ----------------------------------------------------------------------------------
    def _parallel(self, q, k, v, valid, context=None, layer=None):
        batch, heads, length, dim = q.shape
        order = left_align(valid)  # chunks and windows count real tokens in every row
        q, k_grouped, v_grouped = (gather_tokens(x, order) for x in (q, k, v))
        k, v = self.expand_kv(k_grouped), self.expand_kv(v_grouped)
        n_real = valid.sum(-1)
        scores, values = window_scores(q, k, v, n_real, self.window_size, self.sinks, True, self.scale)  # [B,H,C,w,K]
        terms = self._causal_terms(q, k, v, n_real)
        far = blocked_far_part(terms["log_a"], terms["log_k"], v, far_key_mask(n_real, self.sinks, length),
                               self.window_size)
        out = combine(scores, values, *far).reshape(batch, heads, -1, dim)[:, :, :length]
        if layer is not None:
            self._start_state(layer, q, k, k_grouped, v_grouped, v, n_real, terms)
        return restore_order(out, order)

    # -- decoding -------------------------------------------------------------------------------------------
    def _start_state(self, layer, q, k, k_grouped, v_grouped, v, n_real, terms):
        """The state after a prefill of left-aligned tokens: the real keys (scaled, k̂) and values with their
        key/value heads, the proposals of completed chunks, their per-proposal sums over the far keys of the last
        token (positions sinks .. n_real - window - 1), and the running landmark sums of the unfinished chunk."""
        chunk, length = self.chunk_size, q.shape[2]
        position = torch.arange(length, device=q.device)[None, :]
        gone = keys_far_from(n_real - 1, length, self.window_size, self.sinks)
        in_partial = terms["token_valid"] & (position >= (n_real // chunk * chunk)[:, None])
        partial = in_partial[:, None, :, None].to(q.dtype)
        layer.start(n_real, length, k_hat=k_grouped * self.head_dim ** -0.25, v=v_grouped, omega=terms["omega"],
                    mu=terms["mu"], q_bar=terms["q_bar"], **far_sums(terms["log_k"], v, gone),
                    q_sum=(self._transform(self.landmark_q, q) * partial).sum(2),
                    k_sum=(self._transform(self.landmark_k, k) * partial).sum(2))

    def _step(self, q, k, v, real, layer, context=None):
        """One new (real) token per row, q [B, H, 1, d] and k, v [B, kv_heads, 1, d]: the key leaving the window
        joins the far sums, the token joins the store and the landmark sums, the output reads the window from the
        store and the far part from the sums of the available proposals; a row that completes a chunk then gets that
        chunk's proposal."""
        state, chunk = layer.state, self.chunk_size
        key_scale = self.head_dim ** -0.25
        position = torch.tensor(layer.counts, device=q.device)  # [B]: this token's position
        # the key at position - window leaves the window; it joins the far sums unless it is a sink or not there
        leaving = position - self.window_size
        joins = beyond_window(position, leaving, self.window_size, self.sinks)  # never a position before the start
        leaving_k = self._stored(state["k_hat"], leaving.clamp(min=0)[:, None])
        leaving_v = self._stored(state["v"], leaving.clamp(min=0)[:, None])
        log_k = log_features_at(self.expand_kv(leaving_k), state["omega"]).squeeze(2)  # [B, H, P]
        far = add_far_key(state["kv_sum"], state["key_sum"], state["key_level"], log_k,
                          self.expand_kv(leaving_v).squeeze(2), joins)
        q_sum = state["q_sum"] + self._transform(self.landmark_q, q).squeeze(2)
        k_sum = state["k_sum"] + self._transform(self.landmark_k, self.expand_kv(k)).squeeze(2)
        layer.append_token(k * key_scale, v, **far, q_sum=q_sum, k_sum=k_sum)
        # the window part: sinks outside the window, then positions position - window + 1 .. position
        sink_index = torch.arange(self.sinks, device=q.device)[None, :].expand(len(layer.counts), -1)
        window_index = leaving[:, None] + 1 + torch.arange(self.window_size, device=q.device)[None, :]
        allowed = torch.cat([outside_window(position[:, None], sink_index, self.window_size), window_index >= 0],
                            dim=1)  # [B, S + W]
        index = torch.cat([sink_index, window_index.clamp(min=0)], dim=1)
        keys = self.expand_kv(self._stored(layer.state["k_hat"], index))
        values = self.expand_kv(self._stored(layer.state["v"], index))
        scores = (q * key_scale) @ keys.transpose(-1, -2)  # q̂·k̂ = q·k / √d
        scores = scores.masked_fill(~allowed[:, None, None, :], mask_values(scores.dtype)[0])
        # the far part over the proposals available to this token (proposals 0 .. position // chunk)
        available = torch.arange(state["omega"].shape[2], device=q.device)[None, :] <= (position // chunk)[:, None]
        log_a = self._weights(q * key_scale, state["omega"], state["mu"], state["q_bar"], available[:, None, :])
        out = combine(scores, values, *read_far(log_a, far["kv_sum"], far["key_sum"], far["key_level"]))
        finished = [row for row, n in enumerate(layer.counts) if n % chunk == 0]
        if finished:
            self._add_proposals(layer, finished)
        return out

    @staticmethod
    def _stored(store, index):
        """store [B, kv_heads, N, d] at positions index [B, T] -> [B, kv_heads, T, d]."""
        return store.gather(2, index[:, None, :, None].expand(-1, store.shape[1], -1, store.shape[3]))

    def _add_proposals(self, layer, rows):
        """Proposals for rows that just completed a chunk: Eq. 34 from the chunk's landmarks, with per-proposal sums
        over the stored keys that have left the window and are not sinks (O(n·d) once per chunk)."""
        chunk, key_scale = self.chunk_size, self.head_dim ** -0.25
        state = layer.state
        rows_t = torch.tensor(rows, device=state["k_hat"].device)
        q_bar = state["q_sum"][rows_t] / chunk * key_scale
        mu = q_bar + state["k_sum"][rows_t] / chunk * key_scale
        omega = self._draw(mu)
        keys, values = self.expand_kv(state["k_hat"][rows_t]), self.expand_kv(state["v"][rows_t])
        count = torch.tensor([layer.counts[r] for r in rows], device=keys.device)
        gone = keys_far_from(count - 1, keys.shape[2], self.window_size, self.sinks)
        log_k = log_features_at(keys, omega.unsqueeze(2))  # [rows, H, N, 1]
        far = {name: value.squeeze(2) for name, value in far_sums(log_k, values, gone).items()}
        layer.set_proposals(rows, [layer.counts[r] // chunk for r in rows], omega=omega, mu=mu, q_bar=q_bar, **far)
        for name in ("q_sum", "k_sum"):
            state[name] = state[name].index_fill(0, rows_t, 0.0)

    # -- reference --------------------------------------------------------------------------------------------
    def reference_kernel(self, hidden_states, attention_mask=None, position_ids=None):
        """(kernel [B, H, L, L], values [B, H, L, d]) of the dense reference, in the tokens' own order: exp(s_ij) on
        the window and sinks, κ_ij = Σ_p exp(log a_ip + log ξ(k̂_j, ω_p)) on the other real keys before the query,
        0 elsewhere; a padded query sees itself. Causal LARA's terms are computed on left-aligned rows (its
        chunks count real tokens) and the kernel is moved back."""
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool,
                                                                 device=hidden_states.device)
        q, k, v = self._inputs(hidden_states, position_ids)  # key/value heads repeated for their groups
        order = left_align(valid)
        aligned_q, aligned_k, aligned_v = (gather_tokens(x, order) for x in (q, k, v))
        terms = self._causal_terms(aligned_q, aligned_k, aligned_v, valid.sum(-1))
        log_a, log_k = (restore_order(terms[name], order) for name in ("log_a", "log_k"))
        near, far = dense_near_and_far(valid, self.window_size, self.sinks)
        exact = torch.exp((q @ k.transpose(-1, -2)) * self.scale)
        estimate = torch.exp(log_a[:, :, :, None, :] + log_k[:, :, None, :, :]).sum(-1)
        kernel = exact * near[:, None] + estimate * far[:, None]
        padded_query = torch.eye(length, dtype=torch.bool, device=q.device)[None] & ~valid[:, :, None]
        return kernel + padded_query[:, None].to(kernel.dtype), v

    def reference_forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        """The dense form, no stabilisation: out = K v / K 1 with `reference_kernel`'s K."""
        kernel, v = self.reference_kernel(hidden_states, attention_mask, position_ids)
        out = kernel @ v / kernel.sum(-1, keepdim=True)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))
