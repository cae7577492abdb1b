"""Exact softmax attention through PyTorch's scaled_dot_product_attention, with a KV cache; cross-attention.

This is the reference every efficient attention is compared against (`softmax_attention_reference` is the same
math written out in full).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer, StaticLayer

from attnzoo.modeling.attention.base import (
    ZooAttention,
    allowed_keys,
    check_attention_mask,
    register_attention,
    static_allowed_keys,
    static_key_mask,
)
from attnzoo.transformers_compat import static_written_length


def softmax_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q kᵀ / √d) v over [batch, heads, length, head_dim] tensors; `allowed` is a bool mask or None."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v


def _sdpa(q, k, v, allowed, causal_without_mask: bool, dropout: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, dropout_p=dropout, is_causal=causal_without_mask and allowed is None
    )


@register_attention("full")
class SoftmaxAttention(ZooAttention):
    """Multi-head exact attention; causal or bidirectional; padded keys excluded; KV cache for decoding. With
    `far_positions="none"` for its layer it is a global layer without positions (its queries and keys are not
    rotated, its queries scaled as `far_query_scale` says)."""

    position_free_far_part = True

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.build_projections()
        self.dropout = config.attention_probs_dropout_prob

    def new_cache_layer(self):
        return DynamicLayer()

    def new_static_cache_layer(self, max_cache_len: int):
        # preallocated keys and values, masked by what was written (`static_allowed_keys`); a caller's StaticCache
        # holds the same slots
        return StaticLayer(max_cache_len)

    def _project(self, hidden_states, cache, position_ids):
        q = self.split_heads(self.q_proj(hidden_states))
        k = self.split_heads(self.k_proj(hidden_states))
        v = self.split_heads(self.v_proj(hidden_states))
        if self.rotary is not None:
            past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            rotation = self.rotation(position_ids, past, q.shape[2], q.device, q.dtype)
            q, k = self.far_view(q, k, self.rotate(q, rotation), self.rotate(k, rotation), position_ids, past)
        if cache is not None:  # the cache keeps the key/value heads before they are repeated for their groups
            k, v = cache.update(k, v, self.layer_idx)
        return q, self.expand_kv(k), self.expand_kv(v)

    def forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        q, k, v = self._project(hidden_states, cache, position_ids)
        query_len, key_len = q.shape[2], k.shape[2]
        written = static_written_length(self.cache_slot(cache))
        if written is not None:
            key_mask = static_key_mask(attention_mask, q.shape[0], key_len) if attention_mask is not None else None
            allowed = static_allowed_keys(key_mask, written, query_len, key_len, self.causal, q.device)
            out = _sdpa(q, k, v, allowed, False, self.dropout if self.training else 0.0)
            return self.o_proj(self.merge_heads(out))
        key_mask = check_attention_mask(attention_mask, q.shape[0], key_len)
        # Without padding and with no cached prefix, SDPA's is_causal path needs no mask tensor at all.
        needs_mask = key_mask is not None or (self.causal and query_len != key_len and query_len > 1)
        allowed = allowed_keys(key_mask, query_len, key_len, self.causal, q.device) if needs_mask else None
        causal_flag = self.causal and query_len == key_len
        out = _sdpa(q, k, v, allowed, causal_flag, self.dropout if self.training else 0.0)
        return self.o_proj(self.merge_heads(out))

    def reference_forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        q, k, v = self._project(hidden_states, cache, position_ids)
        written = static_written_length(self.cache_slot(cache))
        if written is not None:
            key_mask = static_key_mask(attention_mask, q.shape[0], k.shape[2]) if attention_mask is not None else None
            allowed = static_allowed_keys(key_mask, written, q.shape[2], k.shape[2], self.causal, q.device)
            return self.o_proj(self.merge_heads(softmax_attention_reference(q, k, v, allowed)))
        key_mask = check_attention_mask(attention_mask, q.shape[0], k.shape[2])
        allowed = allowed_keys(key_mask, q.shape[2], k.shape[2], self.causal, q.device)
        return self.o_proj(self.merge_heads(softmax_attention_reference(q, k, v, allowed)))


class SoftmaxCrossAttention(nn.Module):
    """Decoder-to-encoder exact attention. Keys and values of the encoder output are computed once per generation
    and kept in the cross-attention half of an `EncoderDecoderCache`."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        bias = config.attention_bias
        # The encoder output is `stack_output_size` wide (2 * hidden_size with concatenated reversible streams).
        context_size = config.stack_output_size
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=bias)
        self.k_proj = nn.Linear(context_size, self.hidden_size, bias=bias)
        self.v_proj = nn.Linear(context_size, self.hidden_size, bias=bias)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=bias)
        self.dropout = config.attention_probs_dropout_prob

    def _heads(self, x):
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None, cache=None):
        q = self._heads(self.q_proj(hidden_states))
        if cache is not None and cache.is_updated.get(self.layer_idx, False):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            k, v = layer.keys, layer.values
        else:
            k = self._heads(self.k_proj(encoder_hidden_states))
            v = self._heads(self.v_proj(encoder_hidden_states))
            if cache is not None:
                k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        key_mask = check_attention_mask(encoder_attention_mask, q.shape[0], k.shape[2])
        allowed = None if key_mask is None else key_mask[:, None, None, :]
        out = _sdpa(q, k, v, allowed, False, self.dropout if self.training else 0.0)
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.hidden_size))
