"""The contract every attention module follows, and the mask helper they share.

An attention module is built as `cls(config, layer_idx, causal)` and called as

    out = attn(hidden_states,                      # [batch, query_len, hidden_size]
               attention_mask=None,                # bool [batch, past_len + query_len], True = a real token
               past_key_values=None,               # a transformers `Cache`; this layer's slot is `layer_idx`
               replay=None,                        # dict: what a reversible backward must repeat (see below)
               grid_size=None)                     # (rows, cols) of image patches, for 2-D aware attentions

and returns the new hidden states, [batch, query_len, hidden_size]. Rules:
- `attention_mask` covers every key the query can see: cached ones first, then the current ones. Padded keys are
  never attended to; outputs at padded query positions are finite but meaningless.
- `causal` modules let a query see only keys at or before its own position.
- With a cache the module reads and extends `past_key_values.layers[layer_idx]`, which it created through
  `new_cache_layer()` (a `transformers.cache_utils.CacheLayerMixin`), so `generate()` and beam search work.
- Randomness (hash rotations, random features, samples) comes from explicit generators or the global RNG, never
  from hidden state that differs between two calls with the same seed. In a reversible stack the backward pass
  recomputes the forward after restoring the RNG state; a module whose forward state is expensive or must not
  change (e.g. LSH buckets) records it in `replay` on the first call and reads it back on the recomputation.
- Per-step decisions (e.g. redrawing random features) belong in `prepare()`, which the stack calls once per
  forward pass; a recomputation in the backward pass does not call it again.
- Each module keeps a plain, obviously-correct `reference_forward` with the same signature; tests compare the
  fast path against it and against exact softmax attention.

A new attention is one file: subclass `ZooAttention`, decorate it with `@register_attention("name")`, and import the
file from `attnzoo/modeling/attention/__init__.py`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

ATTENTION_REGISTRY: dict[str, type[ZooAttention]] = {}


def register_attention(name: str):
    """Class decorator: make an attention module available to configs as `attn_layers=[name]`."""

    def add(cls: type[ZooAttention]) -> type[ZooAttention]:
        if name in ATTENTION_REGISTRY and ATTENTION_REGISTRY[name] is not cls:
            raise ValueError(f"attention name {name!r} is already registered to {ATTENTION_REGISTRY[name].__name__}")
        cls.name = name
        ATTENTION_REGISTRY[name] = cls
        return cls

    return add


class ZooAttention(nn.Module):
    """Base class of self-attention modules. Subclasses implement `forward`, `reference_forward` and, when they
    support incremental decoding, `new_cache_layer`."""

    name: ClassVar[str] = ""
    #: config fields the module reads beyond `ZooConfig`'s; a config without them is rejected with a ValueError.
    required_config_fields: ClassVar[tuple[str, ...]] = ()
    #: the config class that carries those fields, named in that error message.
    family_config: ClassVar[str] = "ZooConfig"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.causal = causal
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size

    def build_projections(self) -> None:
        """The usual separate q, k, v and output projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`)."""
        bias = self.config.attention_bias
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(self.hidden_size, self.hidden_size, bias=bias))

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError for config values this attention cannot use. Called by the config's validation."""

    def prepare(self) -> None:
        """Called once per forward pass of the whole stack, before any block runs (never on a recomputation in
        a reversible or checkpointed backward): the place for per-step decisions such as redrawing random
        features, so that recomputations see the same state."""

    def init_buffers(self) -> None:
        """Fill the module's buffers (e.g. a saved random projection). Called from the model's `_init_weights`,
        also on the meta device, for modules whose buffers a checkpoint did not provide: use
        `transformers.initialization` functions, which leave loaded tensors alone."""

    def check_image_layout(self, grid_size: tuple[int, int], class_token: bool) -> None:
        """Called when the module is built into an image encoder whose tokens are a `grid_size` patch grid (after a
        class token when `class_token`): raise ValueError for settings that cannot work there, at construction
        rather than at the first forward."""

    def new_cache_layer(self):
        """The `CacheLayerMixin` that holds this layer's decoding state."""
        raise NotImplementedError(f"attention {self.name!r} does not support incremental decoding")

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)


def check_attention_mask(attention_mask: torch.Tensor | None, batch: int, key_len: int) -> torch.Tensor | None:
    """Validate a 2-D key mask and return it as bool. Raises ValueError with the expected shape."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] != key_len:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({batch}, {key_len}): one entry per "
            "cached and current token (1 = real token, 0 = padding)."
        )
    return attention_mask.bool()


def allowed_keys(
    key_padding_mask: torch.Tensor | None, query_len: int, key_len: int, causal: bool, device: torch.device
) -> torch.Tensor | None:
    """Bool [batch|1, 1, query_len, key_len]: which keys each query may attend to, or None when all may.

    The queries are the last `query_len` of the `key_len` positions (earlier ones are cached). A query that would
    see no key at all (a padded position) is allowed its own key, so no softmax row is empty and nothing is NaN;
    real queries always see themselves already, so their outputs do not change.
    """
    if key_padding_mask is None and not causal:
        return None
    query_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    key_pos = torch.arange(key_len, device=device)[None, :]
    allowed = torch.ones(1, 1, query_len, key_len, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (key_pos <= query_pos)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    return allowed | (key_pos == query_pos)
