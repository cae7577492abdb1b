"""FAVOR+ with an exact window inside every layer ("favor_window"): each query attends exactly, with softmax
weights, to its window and sinks (`window_size`, `num_sink_tokens`, as the "window" attention), and through
FAVOR+'s random features to every earlier key outside them, with ONE normalisation over both parts:

    out_i = (Σ_{j∈near(i)} exp(s_ij) v_j + Σ_{j∈far(i)} φ(q_i)·φ(k_j) v_j)
            / (Σ_{j∈near(i)} exp(s_ij)     + Σ_{j∈far(i)} φ(q_i)·φ(k_j)),      s_ij = q_i·k_j / √d.

FAVOR+'s positive features estimate exp(s_ij) without bias, so both parts weigh keys on the same scale and no mixing
factor is needed: the layer is exact softmax attention where the window reaches, and FAVOR+ beyond it. This is the
window-plus-linear layer of LoLCATs (arXiv 2410.10254, §3.2: 64-token windows with a learned feature map) and
Liger (arXiv 2503.01496), with Performer's unbiased features ("Rethinking Attention with Performers", arXiv
2009.14794) as the linear part. With `feature_redraw="learned"` the projection is trained (attention transfer).

The blocked parallel form, its stabilisation (per-feature running key maxima folded into the query side) and the
decoding sums are `window_linear`'s, shared with "lara_window". Causal decoders only; decoding keeps the window state
of the "window" attention plus FAVOR+'s per-feature sums over the keys that left the window: bounded memory.
"""

from __future__ import annotations

import math

import torch

from attnzoo.modeling.attention.base import check_attention_mask, register_attention
from attnzoo.modeling.attention.favor import FavorAttention
from attnzoo.modeling.attention.random_features import log_positive_features
from attnzoo.modeling.attention.window import (
    WindowInsideLayer,
    WindowStateLayer,
    beyond_window,
    combine,
    dense_near_and_far,
    gather_tokens,
    left_align,
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


@register_attention("favor_window")
class WindowedFavorAttention(WindowInsideLayer, WindowedLinearForward, FavorAttention):
    """Exact window and sinks plus FAVOR+ beyond them, one softmax normalisation; see the module docstring."""

    plain_kind = "favor"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def new_cache_layer(self):
        return WindowStateLayer(self.window_size, self.sinks)

    def far_context(self, layer):
        return self.projection(layer)  # the evaluation projection, or this forward's draw

    def _log_features(self, x, projection):
        return log_positive_features(x, projection, self.hyperbolic)

    # -- the parallel form ----------------------------------------------------------------------------------
    def _parallel(self, q, k, v, valid, projection, layer=None):
        batch, heads, length, dim = q.shape
        order = left_align(valid)
        q, k_grouped, v_grouped = (gather_tokens(x, order) for x in (q, k, v))
        k, v = self.expand_kv(k_grouped), self.expand_kv(v_grouped)
        n_real = valid.sum(-1)
        scores, values = window_scores(q, k, v, n_real, self.window_size, self.sinks, True, self.scale)  # [B,H,C,w,K]
        log_q, log_k = self._log_features(q, projection), self._log_features(k, projection)
        # (1/m) Σ_r exp(ℓ_r(q) + ℓ_r(k)): the 1/m goes into the query log-features
        far = blocked_far_part(log_q - math.log(log_q.shape[-1]), log_k, v, far_key_mask(n_real, self.sinks, length),
                               self.window_size)
        out = combine(scores, values, *far).reshape(batch, heads, -1, dim)[:, :, :length]
        if layer is not None:
            self._start_state(layer, k_grouped, v_grouped, n_real, log_k, v)
        return restore_order(out, order)

    # -- decoding -------------------------------------------------------------------------------------------
    def _start_state(self, layer, k, v, n_real, log_k, v_expanded):
        """The window state (sinks and the last `window_size` tokens with their key/value heads, as the "window"
        attention keeps them) and FAVOR+'s per-feature sums over the far keys of the last token, per query head:
        positions sinks .. n_real - window - 1."""
        layer.start(k, v, n_real)
        gone = keys_far_from(n_real - 1, k.shape[2], self.window_size, self.sinks)
        layer.state.update(far_sums(log_k, v_expanded, gone))

    def _step(self, q, k, v, real, layer, projection):
        state = layer.state
        position = state["count"]
        # the token leaving the window (position - w) joins the far sums unless it is a sink or not there
        leaving_k, leaving_v = state["window_k"][:, :, :1], state["window_v"][:, :, :1]
        leaving_pos = state["window_pos"][:, 0]
        joins = real & (leaving_pos == position - self.window_size) & beyond_window(position, leaving_pos,
                                                                                    self.window_size, self.sinks)
        log_k = self._log_features(self.expand_kv(leaving_k), projection).squeeze(2)  # [B, H, m]
        state.update(add_far_key(state["kv_sum"], state["key_sum"], state["key_level"], log_k,
                                 self.expand_kv(leaving_v).squeeze(2), joins))
        # the window part, as the "window" attention keeps and reads it
        layer.append(k, v, real)
        keys, values, allowed = layer.visible(position)
        keys, values = self.expand_kv(keys), self.expand_kv(values)
        scores = (q @ keys.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~allowed[:, None, None, :], mask_values(scores.dtype)[0])
        log_q = self._log_features(q, projection)  # [B, H, 1, m]
        far = read_far(log_q - math.log(log_q.shape[-1]), state["kv_sum"], state["key_sum"], state["key_level"])
        return combine(scores, values, *far)

    # -- reference --------------------------------------------------------------------------------------------
    def reference_forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        """Dense [L, L] kernels in the compute dtype, no stabilisation: exp(s_ij) on the window and sinks (as the
        "window" attention's reference allows them), (1/m) Σ_r exp(ℓ_r(q_i) + ℓ_r(k_j)) on the other real keys
        before the query; out = Σ κ v / Σ κ."""
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool,
                                                                 device=hidden_states.device)
        q, k, v = self._heads(hidden_states, position_ids)  # key/value heads repeated for their groups
        projection = self.projection(None)
        near, far = dense_near_and_far(valid, self.window_size, self.sinks)
        exact = torch.exp((q @ k.transpose(-1, -2)) * self.scale)
        log_q, log_k = self._log_features(q, projection), self._log_features(k, projection)
        estimate = torch.exp(log_q[:, :, :, None, :] + log_k[:, :, None, :, :]).mean(-1)
        kernel = exact * near[:, None] + estimate * far[:, None]
        own = torch.eye(length, device=q.device, dtype=q.dtype)[None, None]
        kernel = kernel + own * (~valid)[:, None, :, None]  # padded queries: themselves
        out = kernel @ v / kernel.sum(-1, keepdim=True)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))
