"""The base of the Reformer's two attentions (local and LSH): heads of `reformer_head_size`, a sequence cut into
chunks of consecutive positions (of the sequence, or of the hash-sorted order) that each attend to a few neighbouring
chunks through `attnzoo.ops.chunked_attention`, attention dropout, and a `TokenBufferLayer` for decoding."""

from __future__ import annotations

import torch
from torch import nn

from attnzoo.modeling.attention.base import UsesRecomputation, ZooAttention, continues_cache
from attnzoo.modeling.cache import StaticTokenBufferLayer, TokenBufferLayer


def head_projection(attn: ZooAttention, into_heads: bool = True, key_value: bool = False) -> nn.Linear:
    """A Reformer-style projection of `attn` (its config, widths and heads): hidden_size -> heads x head_dim
    (`key_value`: the `num_key_value_heads` heads of keys and values), or back, for the output projection."""
    config = attn.config
    if not into_heads:
        bias = getattr(config, "attention_output_bias", None)
        return nn.Linear(attn.num_heads * attn.head_dim, attn.hidden_size,
                         bias=config.attention_bias if bias is None else bias)
    heads = attn.num_kv_heads if key_value else attn.num_heads
    return nn.Linear(attn.hidden_size, heads * attn.head_dim, bias=config.attention_bias)


class ChunkedAttention(UsesRecomputation, ZooAttention):
    family_config = "ZooReformerSettings"
    projection_names = ("query", "key", "value", "query_key", "output")

    def __init__(self, config, layer_idx: int, causal: bool, *, chunk_length: int, chunks_before: int,
                 chunks_after: int, dropout: float | None):
        super().__init__(config, layer_idx, causal, head_dim=config.reformer_head_size)
        self.inner_size = self.num_heads * self.head_dim
        self.chunk_length, self.chunks_before = chunk_length, chunks_before
        self.chunks_after = 0 if causal else chunks_after  # a causal query has nothing to see ahead
        self.dropout = config.attention_probs_dropout_prob if dropout is None else dropout

    def projection(self, into_heads: bool = True, key_value: bool = False) -> nn.Linear:
        """hidden_size -> heads x head_dim (`key_value`: the `num_key_value_heads` heads of keys and values), or
        back, for the output projection."""
        return head_projection(self, into_heads, key_value)

    @property
    def dropout_rate(self) -> float:
        return self.dropout if self.training else 0.0

    def cached_inputs(self, hidden_states, attention_mask, cache):
        """(this layer's slot of `cache` or None, the number of cached tokens (a 0-d tensor for a static slot),
        whether the forward continues from cached tokens (decoding) rather than starting one (a prefill, or no
        cache), the bool mask of the new tokens or None)."""
        batch, length, _ = hidden_states.shape
        slot = self.cache_slot(cache)
        past, _, new_mask = self.key_masks(attention_mask, slot, batch, length)
        return slot, past, continues_cache(slot, past), new_mask

    @staticmethod
    def all_real(key_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
        return key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool, device=device)

    def new_cache_layer(self):
        return TokenBufferLayer()

    def new_static_cache_layer(self, max_cache_len: int):
        return StaticTokenBufferLayer(max_cache_len)
