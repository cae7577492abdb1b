"""The decoding cache: a transformers `Cache` whose per-layer slots are chosen by each layer's attention.

Softmax layers hold keys and values (`DynamicLayer`); other attentions bring their own `CacheLayerMixin` (recurrent
state, buckets, ...). Because every slot is a real cache layer, `generate()`, beam-search reordering and
`get_seq_length()` work for any mix of attention kinds.
"""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache


class ZooCache(Cache):
    """One slot per decoder layer, created by `attention.new_cache_layer()`."""

    def __init__(self, layers):
        super().__init__(layers=list(layers))

    @classmethod
    def for_transformer(cls, transformer) -> ZooCache:
        return cls(transformer.new_cache_layers())


def new_encoder_decoder_cache(decoder) -> EncoderDecoderCache:
    """Self-attention slots from the decoder's attentions; cross-attention keys/values in a `DynamicCache`."""
    return EncoderDecoderCache(ZooCache.for_transformer(decoder), DynamicCache())
