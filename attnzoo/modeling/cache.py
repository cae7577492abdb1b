"""The decoding cache: a transformers `Cache` whose per-layer slots are chosen by each layer's attention.

Softmax layers hold keys and values (`DynamicLayer`); other attentions bring their own `CacheLayerMixin` (recurrent
state, buckets, ...). Because every slot is a real cache layer, `generate()`, beam-search reordering and
`get_seq_length()` work for any mix of attention kinds.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache


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


class SelfManagedCacheLayer(CacheLayerMixin):
    """A cache slot that its attention module fills itself (prefill/decode methods of its own) instead of through
    `update(keys, values)`. It counts the positions it has seen, padding included, so `get_seq_length()` and the
    attention mask's length agree and generate() can use it."""

    def __init__(self):
        super().__init__()
        self.length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is filled by its attention module, not by update().")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class RecurrentStateLayer(SelfManagedCacheLayer):
    """A cache slot for attentions that decode from a fixed-size state instead of stored keys and values
    (linear attention's S and z, say). `state` holds tensors with a leading batch dimension, which beam search
    reorders; `shared` holds per-sequence constants without one (e.g. the random projection used at prefill, so a
    whole generation uses one projection). It counts tokens, so `get_seq_length()` works and generate() can use it.
    """

    is_croppable = False

    def __init__(self):
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}
        self.shared: dict[str, torch.Tensor] = {}

    def store(self, new_tokens: int, **tensors: torch.Tensor) -> None:
        self.state.update(tensors)
        self.length += new_tokens
        self.is_initialized = True

    def reset(self) -> None:
        self.state, self.shared, self.length = {}, {}, 0

    def _map(self, fn) -> None:
        self.state = {name: fn(t) for name, t in self.state.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        pass
