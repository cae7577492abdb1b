"""The contract every attention module follows, the registry that names them, and the mask helpers they share.

An attention module is built as `cls(config, layer_idx, causal)` and called as

    out = attn(hidden_states,               # [batch, query_len, hidden_size]
               attention_mask=None,         # bool [batch, past_len + query_len], True = a real token
               cache=None,                  # a transformers `Cache`; this layer's slot is `layer_idx`
               position_ids=None)           # [batch, query_len]; passed only in rotary models (see below)

and returns the new hidden states, [batch, query_len, hidden_size]. Rules:
- `attention_mask` covers every key the query can see: cached ones first, then the current ones. Padded keys are
  never attended to; outputs at padded query positions are finite but meaningless.
- `causal` modules let a query see only keys at or before its own position.
- With a cache the module reads and extends `cache.layers[layer_idx]`, the slot it created with
  `new_cache_layer()`. Cache slots only store (see `attnzoo/modeling/cache.py`); the module computes, so decoding
  logic lives next to the forward it must equal.
- Randomness (hash rotations, random features, samples) comes from counter-based draws (`counter_random.py`) or the
  global RNG, never from hidden state that differs between two calls with the same seed. Evaluation is
  deterministic: LSH and RA draw from the config's `eval_seed`, Performer uses its saved `eval_projection`, LARA's
  samples are its proposals' means.
- Each module keeps a plain, obviously-correct `reference_forward` with the same signature; tests compare the fast
  path against it (values and gradients) and against exact softmax attention.

Rotary positions and grouped key/value heads (Llama-style models, docs/llama_backbones.md): with
`position_embedding_type="rotary"` every module has a `rotary` table over its head width and is called with
`position_ids` (the positions of the query tokens, counting real tokens only); it rotates q and k with
`self.rotate(...)` right after projecting them, before its own mechanism, and caches the rotated keys. With
`num_key_value_heads < num_attention_heads` the key and value projections (`build_projections`) give fewer heads;
`expand_kv` repeats each for its group of query heads (a softmax cache keeps the unrepeated ones).

Optional parts, each opted into by a module that needs it:
- `UsesRecomputation` (a `recompute=None` keyword of `forward` and `reference_forward`): a reversible stack
  recomputes every block in its backward pass after restoring the RNG state. It passes the same `Recomputation` to
  the forward pass (`replaying` False) and to its recomputation (`replaying` True); a module stores in `saved`
  whatever must not change between the two (LSH's buckets), and may keep intermediate results on the recomputation,
  whose backward follows at once.
- `DrawsPerForward.start_forward()`: called once per forward pass of the whole model, before any block runs and
  never on a recomputation, for per-step decisions (Performer's feature redraws).
- `InitialisesBuffers.init_buffers()`: fills buffers a checkpoint did not provide (called from `_init_weights`).
- `set_image_layout(grid_size, class_token)`: an image encoder declares its patch grid at construction.

A new attention is one file: subclass `ZooAttention`, set `family_config` if it reads settings beyond `ZooConfig`'s, and
decorate it with `@register_attention("name")`. Inside the package, put the file in `attnzoo/modeling/attention/`
(every module there is imported); in user code, import it before building the model: checkpoints carry it either way
(docs/adding_an_attention.md walks through both).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from attnzoo.modeling.attention.far_positions import FarQueryScale, far_positions_of
from attnzoo.modeling.rotary import RotaryEmbedding
from attnzoo.remote_code import CARRIED, load_carried_attention

ATTENTION_REGISTRY: dict[str, type[ZooAttention]] = {}


def register_attention(name: str):
    """Class decorator: make an attention module available to configs as `attn_layers=[name]`."""

    def add(cls: type[ZooAttention]) -> type[ZooAttention]:
        registered = ATTENTION_REGISTRY.get(name)
        if registered is not None and registered is not cls and not replaceable(registered):
            raise ValueError(f"attention name {name!r} is already registered to {registered.__name__} (module "
                             f"{registered.__module__}); give {cls.__name__} another name in @register_attention.")
        cls.name = name
        ATTENTION_REGISTRY[name] = cls
        return cls

    return add


def replaceable(registered: type) -> bool:
    """Whether a registration may be replaced: one made by a checkpoint's copy of a user's module
    (`remote_code.load_carried_attention`) gives way to the module itself when the user imports it."""
    return hasattr(sys.modules.get(registered.__module__), CARRIED)


def build_attention(kind: str, config, layer_idx: int, causal: bool, field_name: str = "attn_layers"):
    """The attention module of one layer, with a ValueError naming `field_name` for an unknown kind or a config
    class that lacks the kind's fields."""
    if kind not in ATTENTION_REGISTRY:
        # a user's attention that the checkpoint being loaded carries: registered from there, or named in the error
        hint = load_carried_attention(kind, config)
        if kind not in ATTENTION_REGISTRY:
            raise ValueError(f"{field_name}={list(getattr(config, field_name))!r} is invalid: unknown attention "
                             f"{kind!r}; known kinds: {sorted(ATTENTION_REGISTRY)}.{hint}")
    cls = ATTENTION_REGISTRY[kind]
    required = (cls.family_config,) if isinstance(cls.family_config, str) else tuple(cls.family_config)
    missing = [name for name in required if name not in {c.__name__ for c in type(config).__mro__}]
    if missing:
        raise ValueError(f"{field_name}={list(getattr(config, field_name))!r} is invalid: attention {kind!r} reads "
                         f"the settings of {' and '.join(missing)}, which {type(config).__name__} does not have; "
                         f"build the model with a config that has them: {', '.join(configs_having(config, required))}.")
    far_positions = far_positions_of(config, layer_idx)
    if far_positions == "none" and not cls.position_free_far_part:
        raise ValueError(f"far_positions={list(config.far_positions)!r} is invalid: layer {layer_idx} ({kind!r}) has "
                         "no far part that can do without positions (only the windowed attentions and 'full' have "
                         "one); give that layer 'rotary'.")
    if far_positions in ("fixed", "grouped") and not (cls.position_free_far_part and
                                                      getattr(cls, "far_part_class", None)):
        raise ValueError(f"far_positions={list(config.far_positions)!r} is invalid: layer {layer_idx} ({kind!r}) has "
                         f"no window beside a far part, and {far_positions!r} reads far keys at distances counted "
                         "from the window's edge (only the windowed attentions with a far part have one); give that "
                         "layer 'rotary' or 'none'.")
    if far_kv_heads_of(config, layer_idx) is not None and getattr(cls, "far_part_class", None) is None:
        raise ValueError(f"far_kv_heads={config.far_kv_heads!r} is invalid: layer {layer_idx} ({kind!r}) has no far "
                         "part whose heads it could choose (only the windowed attentions with a far part have one); "
                         "give that layer None.")
    if getattr(config, "position_embedding_type", None) == "rotary" and \
            "position_ids" not in inspect.signature(cls.forward).parameters:
        raise ValueError(f"{field_name}={list(getattr(config, field_name))!r} is invalid with "
                         f"position_embedding_type='rotary': attention {kind!r} ({cls.__name__}.forward) takes no "
                         "position_ids, so it cannot rotate its queries and keys; add a `position_ids=None` keyword "
                         "and rotate q and k (docs/adding_an_attention.md), or use another position_embedding_type.")
    return cls(config, layer_idx, causal)


def far_kv_heads_of(config, layer_idx: int) -> list[int] | None:
    """The `far_kv_heads` entry of layer `layer_idx` (a shorter list repeats, as `attn_layers` does): the key-value
    heads that keep the layer's far part, or None for every head."""
    entries = getattr(config, "far_kv_heads", None)
    return None if not entries else entries[layer_idx % len(entries)]


def configs_having(config, settings: tuple[str, ...]) -> list[str]:
    """The names of the family configs (the config classes with a `model_type` of their own) related to `config`'s
    class whose bases include every class named in `settings`."""
    root = next(c for c in type(config).__mro__ if c.__name__ == "ZooConfig")
    found, todo = set(), [root]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "model_type" in vars(cls) and set(settings) <= {c.__name__ for c in cls.__mro__}:
            found.add(cls.__name__)
    return sorted(found)


@dataclass
class Recomputation:
    """What a reversible stack hands an attention for one block of one forward pass: `replaying` is False on the
    forward pass and True on the backward pass's recomputation; `saved` holds what the module recorded for it."""

    replaying: bool = False
    saved: dict = field(default_factory=dict)


class ZooAttention(nn.Module):
    """Base class of self-attention modules. Subclasses implement `forward`, `reference_forward` and, when they
    support incremental decoding, `new_cache_layer`."""

    name: ClassVar[str] = ""
    #: the config class (by name), or the classes, whose fields the module reads (a family's settings, e.g.
    #: "ZooPerformerSettings"); a model built with a config that lacks one is refused, naming configs that have it.
    family_config: ClassVar[str | tuple[str, ...]] = "ZooConfig"

    #: names of the modules that project into and out of the heads (the weights a conversion carries); everything
    #: else an attention owns (feature maps, landmark transforms, ...) is its own, see `own_parameters`
    projection_names: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj")
    #: whether the module has a far (global) part that `far_positions="none"` can take the rotation from (see
    #: `far_view`): the windowed attentions' far parts, and "full" as a whole
    position_free_far_part: ClassVar[bool] = False

    def __init__(self, config, layer_idx: int, causal: bool, head_dim: int | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.causal = causal
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim or config.head_dim  # hidden_size / heads unless the attention has its own width
        self.hidden_size = config.hidden_size
        rotary = getattr(config, "position_embedding_type", None) == "rotary"
        self.rotary = RotaryEmbedding(config, self.head_dim) if rotary else None
        self.far_positions = far_positions_of(config, layer_idx) if self.position_free_far_part else "rotary"
        scale = getattr(config, "far_query_scale", None) if self.far_positions != "rotary" else None
        self.far_position_group = getattr(config, "far_position_group", None)
        self.far_query_scale = None if scale is None else FarQueryScale(
            scale, self.num_heads, config.far_query_scale_length, config.max_position_embeddings)

    def build_projections(self) -> None:
        """The usual separate q, k, v and output projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`); k and v have
        `num_key_value_heads` heads."""
        bias = self.config.attention_bias
        output_bias = getattr(self.config, "attention_output_bias", None)
        inner, kv_inner = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, inner, bias=bias)
        self.k_proj = nn.Linear(self.hidden_size, kv_inner, bias=bias)
        self.v_proj = nn.Linear(self.hidden_size, kv_inner, bias=bias)
        self.o_proj = nn.Linear(inner, self.hidden_size, bias=bias if output_bias is None else output_bias)

    def own_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of what this attention learns beyond its projections (a learnable feature map,
        landmark transforms, ...): what attention transfer trains with everything else frozen. Empty for
        attentions with nothing of their own (softmax, RA, LSH, local)."""
        return [(name, p) for name, p in self.named_parameters() if name.split(".")[0] not in self.projection_names]

    def rotation(self, position_ids, past: int, length: int, device, dtype):
        """(cos, sin) for the `length` query tokens, or None without rotary positions. `position_ids` default to
        `past, past + 1, ...` (a module called on its own, without padding)."""
        if self.rotary is None:
            return None
        if position_ids is None:  # `past` may be a static slot's 0-d count: no host value is read
            position_ids = (past + torch.arange(length, device=device))[None]
        return self.rotary(position_ids, dtype)

    def far_view(self, q, k, q_rotated, k_rotated, position_ids, past: int = 0, real_positions=None):
        """(q, k) as the module's far part sees them, from the queries and keys before and after rotation: rotated
        ("rotary"); not ("none"); "fixed": the keys not rotated and every query rotated as if at position
        `window_size`, so that rotary's relative rotation puts every far key at distance `window_size` from its
        query (q R(W) · k R(0) = q R(p) · k R(p - W) for any p); or "grouped" (Self-Extend): with G =
        `far_position_group`, a key at real position j rotated as if at floor(j / G) and a query at i as if at
        floor(i / G) + W - floor(W / G), so the pair sits at W + floor(i / G) - floor(j / G) - floor(W / G) >= W
        for every far key (j <= i - W): distances continue from the window's edge, G times slower.
        `real_positions` [B, L] count real tokens from 0 ("grouped" needs them: a left-padded row's first real
        token is its position 0). The queries of every option but "rotary" are scaled by `far_query_scale` at
        their positions (`position_ids`, real positions, or `past, past + 1, ...`). Returns the rotated tensors
        themselves when nothing changes."""
        if self.far_positions == "rotary":
            return q_rotated, k_rotated
        if self.far_positions == "fixed":
            at_window = torch.full((1, q.shape[2]), self.window_size, dtype=torch.long, device=q.device)
            q = self.rotate(q, self.rotary(at_window, q.dtype))
        elif self.far_positions == "grouped":
            if real_positions is None:
                real_positions = (past + torch.arange(q.shape[2], device=q.device))[None]
            group, window = self.far_position_group, self.window_size
            grouped = torch.div(real_positions, group, rounding_mode="floor")
            q = self.rotate(q, self.rotary(grouped + (window - window // group), q.dtype))
            k = self.rotate(k, self.rotary(grouped, k.dtype))
        if self.far_query_scale is None:
            return q, k
        if position_ids is None:
            position_ids = (past + torch.arange(q.shape[2], device=q.device))[None]
        return q * self.far_query_scale(position_ids, q.dtype), k

    @staticmethod
    def rotate(x: torch.Tensor, rotation) -> torch.Tensor:
        """x [batch, heads, length, head_dim] rotated by `rotation` (from `rotation()`); x itself when None."""
        if rotation is None:
            return x
        cos, sin = rotation
        return RotaryEmbedding.rotate(x, cos.to(x.dtype), sin.to(x.dtype))

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, kv_heads, ...] -> [batch, heads, ...]: query head h reads key/value head h // group."""
        if self.num_kv_heads == self.num_heads:
            return x
        return x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def set_image_layout(self, grid_size: tuple[int, int], class_token: bool) -> None:
        """Called when the module is built into an image encoder whose tokens are a `grid_size` patch grid (after a
        class token when `class_token`): a module that uses the 2-D layout keeps it, and one whose settings cannot
        work there raises ValueError now rather than at the first forward."""

    def new_cache_layer(self):
        """The `CacheLayerMixin` that holds this layer's decoding state."""
        raise NotImplementedError(f"attention {self.name!r} does not support incremental decoding")

    def new_static_cache_layer(self, max_cache_len: int):
        """The cache slot for compiled or graph-captured decoding of up to `max_cache_len` positions: fixed shapes and
        addresses, a position count kept as a tensor. None for an attention that has none (the model then refuses a
        static cache, naming it)."""
        return None

    def cache_slot(self, cache):
        """This layer's slot of a cache, or None without one."""
        return cache.layers[self.layer_idx] if cache is not None else None

    def cache_layer_types(self) -> tuple[type, ...]:
        """The cache slot classes this attention reads and writes correctly (by default: its own
        `new_cache_layer()`'s and `new_static_cache_layer()`'s)."""
        static = self.new_static_cache_layer(1)
        return (type(self.new_cache_layer()),) + ((type(static),) if static is not None else ())

    def key_masks(self, attention_mask, slot, batch: int, length: int):
        """(past, key mask, new-token mask) for `length` new tokens over this layer's cache slot (None: no cache):
        `past` counts the cached positions (a 0-d tensor for a static slot), the key mask covers every key (bool or
        None) and the new-token mask the new tokens' columns of it. A static slot's key mask has `max_cache_len`
        columns (a shorter mask is padded: columns not written yet count as padding) and its new tokens' columns are
        read at `past`, so nothing in a decode step depends on a host value that changes."""
        past = slot.get_seq_length() if slot is not None and getattr(slot, "is_initialized", True) else 0
        capacity = getattr(slot, "max_cache_len", None)
        if capacity is None:
            key_mask = check_attention_mask(attention_mask, batch, past + length)
            return past, key_mask, (key_mask[:, past:] if key_mask is not None else None)
        if attention_mask is None:
            return past, None, None
        key_mask = static_key_mask(attention_mask, batch, capacity)
        columns = (past + torch.arange(length, device=key_mask.device))[None].expand(batch, -1)
        return past, key_mask, key_mask.gather(1, columns)

    def check_cache_slot(self, cache) -> None:
        """Refuse a cache whose slot for this layer holds another kind of state (e.g. a transformers `StaticCache`
        or `DynamicCache` in front of a recurrent FAVOR+ layer), which would be read wrongly and silently. A slot not
        created yet is left to the cache where this attention keeps keys and values (an empty `DynamicCache()` adds
        such slots as layers write), and refused otherwise."""
        if cache is None:
            return
        accepted = self.cache_layer_types()
        names = " or ".join(kind.__name__ for kind in accepted)
        fix = "pass no cache (the model builds its own, as generate() does) or one from model.new_decoding_cache()."
        if self.layer_idx >= len(getattr(cache, "layers", ())):
            # an empty `DynamicCache()` adds key/value slots as layers write: fine for an attention that keeps those
            if not any(issubclass(kind, DynamicLayer) for kind in accepted):
                raise ValueError(f"the cache passed has no slot for layer {self.layer_idx}, whose {self.name!r} "
                                 f"attention decodes from a {names}; {fix}")
            return
        slot = cache.layers[self.layer_idx]
        if type(slot) not in accepted:
            raise ValueError(f"the cache passed holds a {type(slot).__name__} for layer {self.layer_idx}, whose "
                             f"{self.name!r} attention decodes from a {names}; {fix}")

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, length, heads * head_dim] -> [batch, heads, length, head_dim] (key/value projections of a
        grouped-query model give fewer heads: the count follows from the width)."""
        batch, length, width = x.shape
        return x.view(batch, length, width // self.head_dim, self.head_dim).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)


class UsesRecomputation:
    """Mixin for attentions that take the reversible stack's `Recomputation` as `forward(..., recompute=None)` (see
    the module docstring); only these are passed one."""


class DrawsPerForward:
    """Mixin for attentions that make one random decision per forward pass of the whole model (e.g. redrawing
    random features): the Transformer calls `start_forward()` once before its blocks run, never on a recomputation
    (reversible or checkpointed backward), so recomputations see the same draws."""

    def start_forward(self) -> None:
        raise NotImplementedError


class InitialisesBuffers:
    """Mixin for attentions with buffers that weight initialisation must fill (e.g. a saved random projection):
    `_init_weights` calls `init_buffers()`, also on the meta device, for modules a checkpoint did not fill; use
    `transformers.initialization` functions, which leave loaded tensors alone."""

    def init_buffers(self) -> None:
        raise NotImplementedError


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


def continues_cache(slot, past) -> bool:
    """Whether a forward over cache slot `slot` (None: no cache) with `past` cached positions continues from them
    (decoding) rather than filling the slot (a prefill). A static slot answers from whether it was filled, never
    from its count, which is a tensor that a decode step must not read on the host."""
    if slot is None:
        return False
    if getattr(slot, "max_cache_len", None) is not None:
        return bool(slot.is_initialized)
    return past > 0


def static_key_mask(attention_mask: torch.Tensor, batch: int, capacity: int) -> torch.Tensor:
    """A 2-D padding mask for a static cache of `capacity` positions, as bool with `capacity` columns: a mask that
    covers only the positions so far (cached and new) is padded with False, which the attentions read as "not
    written yet". Raises ValueError for a mask of the wrong batch or more columns than the cache holds."""
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] > capacity:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; with a static cache of max_cache_len="
            f"{capacity} pass ({batch}, {capacity}) (one entry per cache position, 1 = a real token) or ({batch}, "
            "cached + new tokens), and build the cache with max_cache_len >= the total length."
        )
    return torch.nn.functional.pad(attention_mask.bool(), (0, capacity - attention_mask.shape[1]))


def static_allowed_keys(key_mask: torch.Tensor | None, written, query_len: int, key_len: int, causal: bool,
                        device) -> torch.Tensor:
    """Bool [batch|1, 1, query_len, key_len] over a static slot's `key_len` preallocated keys, of which the first
    `written` (a 0-d tensor) are filled and the queries are the last `query_len`: filled keys only, causally when
    `causal`, minus padded keys (`key_mask`, `key_len` columns, or None). A padded query sees itself, so no row is
    empty. Tensors only, so a decode step can be captured in a CUDA graph."""
    key_index = torch.arange(key_len, device=device)
    query_index = written - query_len + torch.arange(query_len, device=device)
    allowed = (key_index < written)[None, :]
    if causal:
        allowed = allowed & (key_index[None, :] <= query_index[:, None])
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    return allowed | (key_index[None, :] == query_index[:, None])


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
