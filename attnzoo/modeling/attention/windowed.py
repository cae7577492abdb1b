"""One windowed layer: an exact near part and a pluggable far part, combined under one normalisation.

Every query of a causal layer sees its earlier real keys split by the near/far rule of `window.py` (positions
counted in real tokens; W = `window_size`, S = `num_sink_tokens`):

        keys of query i:  [ sinks 0..S-1 | ........ far keys ........ | window i-W+1 .. i ]
                             \\_____ near: exact ____/   \\_ far part _/   \\____ near: exact ____/
                                      |                        |
                          scores s_ij, values v_j     (numerator, denominator, log scale)
                                      \\________________________/
                                                    |
                 out_i = (Σ_near exp(s_ij) v_j + exp(c_i) num_i) / (Σ_near exp(s_ij) + exp(c_i) den_i)
                                        (`window.combine`, the one normalisation)

`WindowedAttention` owns the near part in all its forms: the blocked parallel form (`window.window_scores` on
left-aligned rows), the decoding ring (`window.ring_*`: the sinks and the last W tokens) and the dense reference
(`window.dense_near_and_far`). A `FarPart` gives the rest, over the far keys only, in the same three forms:

- `parallel(q, k, v, n_real, recompute, state)`: (num [B, H, L, e], den [B, H, L], log scale [B, H, L]) for every
  left-aligned query. When `state` is a cache slot (a prefill), it also puts its decoding state there.
- `step(state, q, k, v, real, position, leaving)`: one new token per row; `leaving` = (k, v, joins) is the key
  that leaves the window as this token arrives (it joins the far keys where `joins`). Returns the token's
  (num, den, log scale) [B, H, 1, ...] and updates its tensors in `state.state`; the layer stores the ring and
  counts the token.
- `reference(q, k, v, valid, far, recompute)`: the same triple, written plainly over a dense [B, L, L] far mask in
  the tokens' own order.

The q and k a far part gets are the layer's far view of them (`ZooAttention.far_view`): the rotated ones, as the
near part's, unless the layer's `far_positions` is "none" (then before rotation, the queries scaled as
`far_query_scale` says; the ring then also keeps the window's keys as the far part sees them, to hand over as they
leave). `project(hidden_states)` gives q, k, v before any rotation; the layer rotates.

A far part whose estimate of exp(s_ij) is on the exact scale (FAVOR+'s and LARA's features) returns its sums with
their common log scale; one that is normalised itself (LSH's bucket softmax, RA's far values) returns its output as
the numerator, 1 as the denominator and its log-sum-exp of scores as the log scale (`normalised_far`). A query
without far keys gets the log scale -inf.

A far part is registered with `@register_far_part("name")`, which also registers the attention kind
"name_window": a `WindowedAttention` whose `far_part_class` it is. The far part is built as `cls(layer, config)`
and may add parameters and buffers to the layer (under its plain family's names, so a checkpoint's keys do not
depend on whether the family's attention is windowed: FAVOR+'s `eval_projection`, LARA's `landmark_q`). Adding one
from user code is one file: docs/adding_an_attention.md ("A far part for the windowed layer").
"""

from __future__ import annotations

import math
import sys
from typing import ClassVar

import torch

from attnzoo.modeling.attention.base import (
    DrawsPerForward,
    InitialisesBuffers,
    UsesRecomputation,
    ZooAttention,
    check_attention_mask,
    register_attention,
)
from attnzoo.modeling.attention.window import (
    combine,
    dense_near_and_far,
    dense_sink_scores,
    gather_tokens,
    left_align,
    new_token_inputs,
    restore_order,
    ring_append,
    ring_leaving,
    ring_scores,
    ring_start,
    ring_visible,
    sink_queries,
    window_scores,
)
from attnzoo.modeling.cache import RecurrentStateLayer
from attnzoo.ops.chunked_attention import mask_values, pad_to_multiple

FAR_PART_REGISTRY: dict[str, type[FarPart]] = {}


def log_far_mass(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last axis of logits [..., Q, K] (-inf: not a far key), -inf for a query without far keys,
    with a zero (not NaN) gradient there."""
    has_far = torch.isfinite(logits).any(-1)
    lse = torch.where(has_far[..., None], logits, 0.0).logsumexp(-1)
    return torch.where(has_far, lse, float("-inf"))


def normalised_far(logits: torch.Tensor, values: torch.Tensor):
    """The far triple of a far part that is a softmax itself: (softmax(logits) @ values, 1, logsumexp(logits)) for
    logits [..., Q, K] (-inf: not a far key) and values [..., K, e]; a query without far keys gets 0, 1, -inf."""
    lse = log_far_mass(logits)
    weights = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return weights @ values, torch.ones_like(lse), lse


class FarPart:
    """The far part of a windowed layer: see the module docstring for the contract. Subclasses implement
    `parallel`, `step` and `reference`, and override the hooks below where their family needs it."""

    #: the config class (by name) whose fields the far part reads (its layer also reads `ZooWindowSettings`)
    family_config: ClassVar[str] = "ZooConfig"
    #: the family's plain attention, named in the refusal of an encoder layer
    plain_kind: ClassVar[str] = ""
    #: the layer's projection modules (what a conversion carries)
    projection_names: ClassVar[tuple[str, ...]] = ZooAttention.projection_names
    #: the config field of the head width when the family has its own (the Reformer's `reformer_head_size`)
    head_size_field: ClassVar[str | None] = None
    #: whether a query's own key gets LSH's large finite penalty in the near part (used only when nothing else is)
    penalises_own_key: ClassVar[bool] = False

    def __init__(self, layer: WindowedAttention, config):
        self.layer = layer  # a plain reference: the far part is not a module, its parameters are the layer's
        self.build_projections()

    # what the far part reads of its layer
    training = property(lambda self: self.layer.training)
    num_heads = property(lambda self: self.layer.num_heads)
    head_dim = property(lambda self: self.layer.head_dim)
    layer_idx = property(lambda self: self.layer.layer_idx)

    # -- projections and the near part's scores ----------------------------------------------------------------------
    def build_projections(self) -> None:
        self.layer.build_projections()

    def project(self, hidden_states):
        """q [B, H, L, d] and k, v [B, kv_heads, L, d] (the ring and the states keep the unrepeated heads), in float32
        at least, before rotary positions: the layer rotates them (and gives the far part the rotated or the plain
        ones, as `far_positions` says)."""
        layer = self.layer
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        projections = (layer.q_proj, layer.k_proj, layer.v_proj)
        return tuple(layer.split_heads(p(hidden_states)).to(compute) for p in projections)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.o_proj(x)

    def near_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The keys the near part scores against, one per query head, from `project`'s keys."""
        return self.layer.expand_kv(k)

    @property
    def scale(self) -> float:
        """The near part's score scale: s_ij = scale * q_i·key_j."""
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def near_dropout(self) -> float:
        """Dropout on the near weights in training (the far part's draws are its own)."""
        return 0.0

    # -- optional hooks --------------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        """Once per forward pass of the whole model (per-step draws)."""

    def init_buffers(self) -> None:
        """Fill buffers a checkpoint did not provide (`transformers.initialization` functions)."""

    def loaded(self) -> None:
        """After the layer's tensors were loaded from a state dict."""

    def new_cache_layer(self):
        return RecurrentStateLayer()

    # -- the far part ----------------------------------------------------------------------------------------------
    def parallel(self, q, k, v, n_real, recompute=None, state=None):
        raise NotImplementedError

    def step(self, state, q, k, v, real, position, leaving):
        raise NotImplementedError

    def reference(self, q, k, v, valid, far, recompute=None):
        raise NotImplementedError


class WindowedAttention(DrawsPerForward, InitialisesBuffers, UsesRecomputation, ZooAttention):
    """An exact window with sinks plus the far part `far_part_class`, under one normalisation (module docstring).
    Causal (decoder) layers only. The window always sees rotary positions; the far part sees the queries and keys
    `far_positions` gives it (`far_view`)."""

    far_part_class: ClassVar[type[FarPart]]
    position_free_far_part = True

    def __init__(self, config, layer_idx: int, causal: bool):
        far_part_class = self.far_part_class
        if not causal:
            raise ValueError(f"attention {self.name!r} is for causal (decoder) layers: set is_decoder=True for a "
                             "decoder-only model, or list it in decoder_attn_layers of an encoder-decoder; in "
                             f"encoders use {far_part_class.plain_kind or 'another attention'!r} or 'window'.")
        field = far_part_class.head_size_field
        super().__init__(config, layer_idx, causal, head_dim=getattr(config, field) if field else None)
        self.window_size = config.window_size
        self.sinks = config.num_sink_tokens
        self.sink_positions = config.sink_positions
        self.far = far_part_class(self, config)

    def start_forward(self) -> None:
        self.far.start_forward()

    def init_buffers(self) -> None:
        self.far.init_buffers()

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.far.loaded()

    def new_cache_layer(self):
        return self.far.new_cache_layer()

    def new_static_cache_layer(self, max_cache_len: int):
        return None  # the ring and the far states are updated out of place: no static slot yet

    def _views(self, hidden_states, position_ids, past, layer=None, valid=None):
        """(q, k, v, q_far, k_far, sink_q): the near part's rotated queries and keys, the values, what the far part
        sees (the same tensors unless `far_positions` says otherwise) and the queries that score the sinks
        (`window.sink_queries`: None when they are q)."""
        q, k, v = self.far.project(hidden_states)
        rotation = self.rotation(position_ids, past, q.shape[2], q.device, q.dtype)
        q_rotated, k_rotated = self.rotate(q, rotation), self.rotate(k, rotation)
        return (q_rotated, k_rotated, v, *self.far_view(q, k, q_rotated, k_rotated, position_ids, past),
                sink_queries(self, q, position_ids, past, layer, valid))

    def forward(self, hidden_states, attention_mask=None, cache=None, recompute=None, position_ids=None):
        layer, past, valid = new_token_inputs(self, hidden_states, attention_mask, cache)
        q, k, v, q_far, k_far, sink_q = self._views(hidden_states, position_ids, past, layer, valid)
        if layer is not None and layer.state:
            # A continuation over a filled state; generate() feeds one token at a time (not a hot path).
            far_k = None if k_far is k else k_far
            out = torch.cat([self._step(*(x[:, :, t:t + 1] for x in (q, k, v, q_far)), valid[:, t], layer,
                                        None if far_k is None else far_k[:, :, t:t + 1],
                                        None if sink_q is None else sink_q[:, :, t:t + 1])
                             for t in range(hidden_states.shape[1])], dim=2)
        else:
            out = self._parallel(q, k, v, q_far, k_far, valid, layer, recompute, sink_q)
        return self.far.output(self.merge_heads(out.to(hidden_states.dtype)))

    # -- the parallel form -----------------------------------------------------------------------------------------
    def _parallel(self, q, k, v, q_far, k_far, valid, layer, recompute, sink_q=None):
        batch, heads, length, _ = q.shape
        w = self.window_size
        order = left_align(valid)
        far_q = None if q_far is q else gather_tokens(q_far, order)
        far_k = None if k_far is k else gather_tokens(k_far, order)
        sink_q = None if sink_q is None else gather_tokens(sink_q, order)
        q, k, v = (gather_tokens(x, order) for x in (q, k, v))
        n_real = valid.sum(-1)
        far = self.far.parallel(q if far_q is None else far_q, k if far_k is None else far_k, v, n_real, recompute,
                                layer)
        if layer is not None:
            layer.store(length, **ring_start(k, v, n_real, w, self.sinks, far_k))
        scores, values = window_scores(q, self.far.near_keys(k), self.expand_kv(v), n_real, w, self.sinks, True,
                                       self.far.scale, sink_q)  # [B, H, blocks, w, keys]
        blocks, num_keys = scores.shape[2], scores.shape[-1]
        if self.far.penalises_own_key:  # block row i's own key is window column w + i, after the sink columns
            own_column = min(self.sinks, blocks * w) + w + torch.arange(w, device=q.device)
            own = torch.arange(num_keys, device=q.device)[None, :] == own_column[:, None]  # [w, keys]
            scores = scores.masked_fill(own, mask_values(scores.dtype)[1])
        # query rows past L (block padding) get no far part: log scale -inf
        num, den, log_scale = (pad_to_multiple(x, w, dim=2, value=fill).view(batch, heads, blocks, w, *x.shape[3:])
                               for x, fill in zip(far, (0.0, 0.0, float("-inf")), strict=True))
        out = combine(scores, values, num, den, log_scale, self.far.near_dropout, self.training)
        return restore_order(out.reshape(batch, heads, blocks * w, -1)[:, :, :length], order)

    # -- decoding --------------------------------------------------------------------------------------------------
    def _step(self, q, k, v, q_far, real, layer, far_k=None, sink_q=None):
        """One new token per row (`real` [B]: whether it is a real token): the key leaving the window goes to the far
        part, the token joins the ring, and it attends to the sinks and window exactly and to the far part.
        `far_k`: the key as the far part sees it, when that is not `k`; `sink_q`: the query that scores the sinks,
        when that is not `q`."""
        state = layer.state
        position = state["count"]  # [B]: this token's position when real
        leaving = ring_leaving(state, real, self.window_size, self.sinks)
        ring = ring_append(state, k, v, real, self.sinks, far_k)  # the tensors that change (no sinks: none of theirs)
        keys, values, allowed = ring_visible({**state, **ring}, position, self.window_size, self.sinks)
        far = self.far.step(layer, q_far, k if far_k is None else far_k, v, real, position, leaving)
        layer.store(1, **ring)
        scores = ring_scores(q, sink_q, self.far.near_keys(keys), self.sinks) * self.far.scale
        masked_value, own_value = mask_values(scores.dtype)
        scores = scores.masked_fill(~allowed[:, None, None, :], masked_value)
        if self.far.penalises_own_key:  # the ring's last key is the token itself
            scores = torch.cat([scores[..., :-1], torch.full_like(scores[..., -1:], own_value)], -1)
        return combine(scores, self.expand_kv(values), *far)

    # -- reference --------------------------------------------------------------------------------------------------
    def reference_forward(self, hidden_states, attention_mask=None, cache=None, recompute=None, position_ids=None):
        """Dense [L, L] masks in the tokens' own order: the near keys (`window.dense_near_and_far`; a padded query
        sees its own key) scored exactly, the far part's `reference` over the far keys, one normalisation."""
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool,
                                                                 device=hidden_states.device)
        q, k, v, q_far, k_far, sink_q = self._views(hidden_states, position_ids, 0, None, valid)
        near, far = dense_near_and_far(valid, self.window_size, self.sinks)
        own = torch.eye(length, dtype=torch.bool, device=q.device)
        near = near | (own[None] & ~valid[:, :, None])
        near_keys = self.far.near_keys(k)
        scores = dense_sink_scores((q @ near_keys.transpose(-1, -2)) * self.far.scale, sink_q, near_keys, valid,
                                   self.window_size, self.sinks, self.far.scale)
        if self.far.penalises_own_key:
            scores = scores.masked_fill(own, mask_values(scores.dtype)[1])
        out = combine(scores.masked_fill(~near[:, None], float("-inf")), self.expand_kv(v),
                      *self.far.reference(q_far, k_far, v, valid, far, recompute))
        return self.far.output(self.merge_heads(out.to(hidden_states.dtype)))


def register_far_part(name: str):
    """Class decorator: make a `FarPart` available as `name`, and the windowed layer with it as the attention kind
    `f"{name}_window"`. The layer class (`cls.layer_class`, named Windowed<Name>Attention after the far part's class
    <Name>FarPart) is also put in the far part's module, so that pickling and checkpoints' remote code find it
    there by name."""

    def add(cls: type[FarPart]) -> type[FarPart]:
        kind = f"{name}_window"
        if name in FAR_PART_REGISTRY and FAR_PART_REGISTRY[name] is not cls:
            raise ValueError(f"far part name {name!r} is already registered to {FAR_PART_REGISTRY[name].__name__}")
        FAR_PART_REGISTRY[name] = cls
        class_name = f"Windowed{cls.__name__.removesuffix('FarPart')}Attention"
        layer_class = type(class_name, (WindowedAttention,), {
            "far_part_class": cls, "family_config": (cls.family_config, "ZooWindowSettings"),
            "projection_names": cls.projection_names,
            "__module__": cls.__module__, "__qualname__": class_name,
            "__doc__": f"An exact window with sinks plus the far part {cls.__name__}, under one normalisation."})
        register_attention(kind)(layer_class)
        cls.layer_class = layer_class
        vars(sys.modules[cls.__module__])[class_name] = layer_class
        return cls

    return add
