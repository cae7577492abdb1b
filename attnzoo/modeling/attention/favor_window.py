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

The parallel form works on blocks of `window_size` tokens: the far keys of a query in block c are all keys of blocks
up to c - 2 (a prefix sum of block sums) and those of block c - 1 at or before its own offset (a masked product),
so memory is O(L·(window + sinks + m·d/window)). The far keys' features are scaled by one detached constant per
sequence and head (it cancels exactly in the one normalisation). Causal decoders only; decoding keeps the window
state of the "window" attention plus FAVOR+'s (S, z) over the keys that left the window, with a running maximum:
bounded memory.
"""

from __future__ import annotations

import math

import torch

from attnzoo.modeling.attention.base import check_attention_mask, register_attention
from attnzoo.modeling.attention.favor import FavorAttention
from attnzoo.modeling.attention.random_features import log_positive_features
from attnzoo.modeling.attention.window import (
    WindowStateLayer,
    gather_tokens,
    left_align,
    new_token_inputs,
    restore_order,
    window_scores,
)
from attnzoo.ops.windowed_attention import mask_values


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


@register_attention("favor_window")
class WindowedFavorAttention(FavorAttention):
    """Exact window and sinks plus FAVOR+ beyond them, one softmax normalisation; see the module docstring."""

    def __init__(self, config, layer_idx: int, causal: bool):
        if not causal:
            raise ValueError("attention 'favor_window' is for causal (decoder) layers; use 'favor' or 'window' in "
                             "encoders.")
        super().__init__(config, layer_idx, causal)
        self.window = config.window_size
        self.sinks = config.num_sink_tokens
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def new_cache_layer(self):
        return WindowStateLayer(self.window, self.sinks)

    def forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        layer, past, valid = new_token_inputs(self, hidden_states, attention_mask, cache)
        length = hidden_states.shape[1]
        q, k, v = self._grouped_heads(hidden_states, position_ids, past)
        projection = self.projection(layer)
        if layer is not None and layer.state:
            out = torch.cat([self._step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], valid[:, t], layer,
                                        projection) for t in range(length)], dim=2)
        else:
            out = self._parallel(q, k, v, valid, projection, layer)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))

    def _grouped_heads(self, hidden_states, position_ids=None, past: int = 0):
        """q [B, H, L, d] and k, v [B, kv_heads, L, d] (the decoding state keeps the unrepeated heads), rotated in
        rotary models, in float32 at least."""
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        q, k, v = (self.split_heads(p(hidden_states)).to(compute) for p in (self.q_proj, self.k_proj, self.v_proj))
        rotation = self.rotation(position_ids, past, q.shape[2], q.device, compute)
        return self.rotate(q, rotation), self.rotate(k, rotation), v

    def _log_features(self, x, projection):
        return log_positive_features(x, projection, self.hyperbolic)

    # -- the parallel form ----------------------------------------------------------------------------------
    def _parallel(self, q, k, v, valid, projection, layer=None):
        batch, heads, length, dim = q.shape
        order = left_align(valid)
        q, k_grouped, v_grouped = (gather_tokens(x, order) for x in (q, k, v))
        k, v = self.expand_kv(k_grouped), self.expand_kv(v_grouped)
        n_real = valid.sum(-1)
        w = self.window
        scores, values = window_scores(q, k, v, n_real, w, self.sinks, True, self.scale)  # [B,H,C,w,K]
        blocks = scores.shape[2]
        padded = blocks * w
        position = torch.arange(padded, device=q.device)
        far_key = (position[None, :] < n_real[:, None]) & (position[None, :] >= self.sinks)  # [B, Lp]
        log_q = self._log_features(q, projection)
        log_k = self._log_features(k, projection)
        log_q, log_k = (torch.nn.functional.pad(x, (0, 0, 0, padded - length)) for x in (log_q, log_k))
        v_pad = torch.nn.functional.pad(v, (0, 0, 0, padded - length))
        count = log_q.shape[-1]
        q_max = log_q.amax(-1, keepdim=True).detach()  # [B, H, Lp, 1]
        k_max = _finite(log_k.masked_fill(~far_key[:, None, :, None], float("-inf")).amax(
            dim=(-2, -1), keepdim=True).detach())  # [B, H, 1, 1]: one constant per sequence and head
        phi_q = torch.exp(log_q - q_max).view(batch, heads, blocks, w, count)
        phi_k = (torch.exp(log_k - k_max) * far_key[:, None, :, None]).view(batch, heads, blocks, w, count)
        v_blocks = v_pad.view(batch, heads, blocks, w, dim)
        block_kv = torch.einsum("bhcwm,bhcwd->bhcmd", phi_k, v_blocks)
        block_z = phi_k.sum(3)
        # keys of blocks <= c - 2: an inclusive prefix sum shifted by two blocks
        prefix_kv = torch.nn.functional.pad(block_kv.cumsum(2), (0, 0, 0, 0, 2, 0))[:, :, :blocks]
        prefix_z = torch.nn.functional.pad(block_z.cumsum(2), (0, 0, 2, 0))[:, :, :blocks]
        # keys of block c - 1 at offsets <= the query's own offset (position <= i - w)
        prev_k = torch.nn.functional.pad(phi_k, (0, 0, 0, 0, 1, 0))[:, :, :blocks]
        prev_v = torch.nn.functional.pad(v_blocks, (0, 0, 0, 0, 1, 0))[:, :, :blocks]
        lower = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
        cross = torch.einsum("bhcqm,bhckm->bhcqk", phi_q, prev_k) * lower
        far_num = torch.einsum("bhcqm,bhcmd->bhcqd", phi_q, prefix_kv) + cross @ prev_v
        far_den = torch.einsum("bhcqm,bhcm->bhcq", phi_q, prefix_z) + cross.sum(-1)
        # the far part's log scale: exp(q_max + k_max) / m, the features' constants
        far_scale = (q_max.view(batch, heads, blocks, w) + k_max.view(batch, heads, 1, 1) - math.log(count))
        out = self._combine(scores, values, far_num, far_den, far_scale)
        out = out.reshape(batch, heads, padded, dim)[:, :, :length]
        if layer is not None:
            self._start_state(layer, k_grouped, v_grouped, n_real, log_k[:, :, :length], v)
        return restore_order(out, order)

    @staticmethod
    def _combine(scores, values, far_num, far_den, far_scale):
        """One normalisation over the window part (scores, values) and the far part (numerator, denominator and
        their common log scale)."""
        top = torch.maximum(scores.amax(-1), far_scale).detach()
        near = torch.exp(scores - top[..., None])
        far = torch.exp(far_scale - top)
        numerator = torch.einsum("...qk,...kd->...qd", near, values) + far[..., None] * far_num
        return numerator / (near.sum(-1) + far * far_den)[..., None]

    # -- decoding -------------------------------------------------------------------------------------------
    def _start_state(self, layer, k, v, n_real, log_k, v_expanded):
        """The window state (sinks and the last `window_size` tokens with their key/value heads, as the "window"
        attention keeps them) and FAVOR+'s sums over the far keys of the next token, per query head: positions
        sinks .. n_real - window - 1."""
        layer.start(k, v, n_real)
        position = torch.arange(k.shape[2], device=k.device)
        gone = (position[None, :] >= self.sinks) & (position[None, :] < (n_real - self.window)[:, None])
        log_k = log_k.masked_fill(~gone[:, None, :, None], float("-inf"))
        k_max = _finite(log_k.amax(dim=(-2, -1)).detach())  # [B, H]
        phi_k = torch.exp(log_k - k_max[..., None, None])
        layer.state.update(kv_sum=torch.einsum("bhnm,bhnd->bhmd", phi_k, v_expanded), key_sum=phi_k.sum(2),
                           key_max=k_max)

    def _step(self, q, k, v, real, layer, projection):
        state = layer.state
        position = state["count"]
        w, s = self.window, self.sinks
        # the token leaving the window (position - w) joins the far sums unless it is a sink or not there
        leaving_k, leaving_v = state["window_k"][:, :, :1], state["window_v"][:, :, :1]
        leaving_pos = state["window_pos"][:, 0]
        joins = real & (leaving_pos >= s) & (leaving_pos == position - w)
        log_k = self._log_features(self.expand_kv(leaving_k), projection).squeeze(2)  # [B, H, m]
        log_k = log_k.masked_fill(~joins[:, None, None], float("-inf"))
        k_max = torch.maximum(state["key_max"], _finite(log_k.amax(-1)).detach())
        rescale = torch.exp(state["key_max"] - k_max)
        phi_k = torch.exp(log_k - k_max[..., None])
        kv_sum = state["kv_sum"] * rescale[..., None, None] + phi_k[..., None] * self.expand_kv(leaving_v)
        key_sum = state["key_sum"] * rescale[..., None] + phi_k
        state.update(kv_sum=kv_sum, key_sum=key_sum, key_max=k_max)
        # the window part, as the "window" attention keeps and reads it
        layer.append(k, v, real)
        keys, values, allowed = layer.visible(position)
        keys, values = self.expand_kv(keys), self.expand_kv(values)
        scores = (q @ keys.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~allowed[:, None, None, :], mask_values(scores.dtype)[0])
        log_q = self._log_features(q, projection)  # [B, H, 1, m]
        q_max = log_q.amax(-1, keepdim=True).detach()
        phi_q = torch.exp(log_q - q_max)
        far_num = torch.einsum("bhqm,bhmd->bhqd", phi_q, kv_sum)
        far_den = torch.einsum("bhqm,bhm->bhq", phi_q, key_sum)
        far_scale = q_max.squeeze(-1) + k_max[..., None] - math.log(log_q.shape[-1])
        return self._combine(scores, values, far_num, far_den, far_scale)

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
        pos = valid.long().cumsum(-1) - 1
        gap = pos[:, :, None] - pos[:, None, :]
        index_gap = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        before = (index_gap >= 0)[None] & valid[:, None, :]
        near = before & ((gap < self.window) | (pos[:, None, :] < self.sinks))
        far = before & ~near
        exact = torch.exp((q @ k.transpose(-1, -2)) * self.scale)
        log_q, log_k = self._log_features(q, projection), self._log_features(k, projection)
        estimate = torch.exp(log_q[:, :, :, None, :] + log_k[:, :, None, :, :]).mean(-1)
        kernel = exact * near[:, None] + estimate * far[:, None]
        kernel = kernel + torch.eye(length)[None, None] * (~valid)[:, None, :, None]  # padded queries: themselves
        out = kernel @ v / kernel.sum(-1, keepdim=True)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))
