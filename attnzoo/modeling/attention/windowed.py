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
                                        (`merge_far`, the one normalisation)

`WindowedAttention` holds the near part (`window.NearPart`, one implementation for every windowed layer and for
"window", which is this layer with no far part) in all its forms: the parallel form on left-aligned rows (the op
`attnzoo.ops.window_attention`: PyTorch's fused flash-attention kernel on the CPU, about L * W work per head, or the
blocked PyTorch path), the decoding ring (`window.ring_*`: the sinks and the last W tokens) and the dense reference
(`window.dense_near_and_far`). A `FarPart` gives the rest, over the far keys only, in the same three forms, each
called with one bundle, `FarInputs` x, and returning a `FarOutput` (num [B, H, Q, e], den [B, H, Q], log scale
[B, H, Q], state, constants):

- `parallel(x)`: every query of left-aligned rows (x.valid [B, L] is then `arange(L) < n_real`, x.position the
  sequence index). When x.keep_state (a prefill) it also returns its decoding state: a dict of tensors with a
  leading batch axis (beam search reorders them), and any per-generation constants without one (a random draw
  that a whole generation keeps).
- `step(x)`: one new token per row (x.valid [B, 1]: whether it is real; x.position [B, 1]: its real position);
  x.state is the state its last call returned, x.constants the constants, x.seen the tokens the cache held before
  this one (padding included: a host bound on every position), x.leaving = (k, v, joins) the key that leaves the
  window as this token arrives (it joins the far keys where `joins`). It returns the token's triple and the state
  entries it changed (tensors may be written in place; `cache.write_at_rows`); the layer stores them with the ring.
- `reference(x)`: the same triple, written plainly over a dense far mask x.far [B, L, L] in the tokens' own order
  (x.valid: the real tokens, x.position their real positions).

x.recompute is the reversible stack's record (`Recomputation`) in `parallel` and `reference`: a far part that draws
(LSH's buckets) saves its draws there and replays them. The layer checks each form's triple (`check_far_outputs`:
shape comparisons on the host, no device sync) and names the far part when one is wrong, rather than failing, or
broadcasting silently, inside `merge_far`; a plain (num, den, log scale) tuple is accepted as a FarOutput without
state.

The q and k a far part gets are the layer's far view of them (`ZooAttention.far_view`): the rotated ones, as the
near part's, unless the layer's `far_positions` is "none", "fixed" or "grouped" (then the keys before rotation or at
grouped positions, the queries before rotation, rotated as if at position W or at grouped positions, and scaled as
`far_query_scale` says; the ring then also keeps the window's keys as the far part sees them, to hand over as they
leave). The layer projects, rotates and scores: separate q, k, v (q·k / √d), or, where the far part names a config
field that asks for it (`shared_qk_field`: LSH's `lsh_shared_qk`), one shared query-key projection whose keys the
near part normalises and scores unscaled, a query's own key penalised; the near part's dropout is the layer's
`attention_probs_dropout_prob`. The far part only describes itself: it is built for the layer's shapes (num_heads,
num_kv_heads, head_dim, layer_idx, window_size, sinks: plain attributes set once) and follows its train/eval mode.

A layer may keep its far part in some of its key-value heads only (the config's `far_kv_heads`, DuoAttention's
retrieval heads): the far part is then built for those heads (its num_kv_heads, and num_heads their query heads) and
sees only their queries, keys and values in every form; the layer gives the other query heads the triple of no far
keys (0, 1, -inf), so they attend to their window and sinks exactly, and the far part's state holds the chosen heads
alone. A far part needs nothing of its own for this.

A far part whose estimate of exp(s_ij) is on the exact scale (FAVOR+'s and LARA's features) returns its sums with
their common log scale; one that is normalised itself (LSH's bucket softmax, RA's far values) returns its output as
the numerator, 1 as the denominator and its log-sum-exp of scores as the log scale (`normalised_far`). A query
without far keys gets the log scale -inf.

A far part is registered with `@register_far_part("name")`, which also registers the attention kind
"name_window": a `WindowedAttention` whose `far_part_class` it is (both names or neither). The far part is built as
`cls(layer, config)` and may add parameters and buffers to the layer (under its plain family's names, so a
checkpoint's keys do not depend on whether the family's attention is windowed: FAVOR+'s `eval_projection`, LARA's
`landmark_q`). Adding one from user code is one file: docs/adding_an_attention.md ("A far part for the windowed
layer").
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import torch

from attnzoo.modeling.attention.base import (
    ATTENTION_REGISTRY,
    DrawsPerForward,
    InitialisesBuffers,
    UsesRecomputation,
    ZooAttention,
    check_attention_mask,
    far_kv_heads_of,
    register_attention,
    replaceable,
)
from attnzoo.modeling.attention.chunked_attention import head_projection
from attnzoo.modeling.attention.lsh_hashing import normalize_keys
from attnzoo.modeling.attention.window import (
    NearPart,
    WindowStateLayer,
    dense_near_and_far,
    gather_tokens,
    left_align,
    new_token_inputs,
    real_positions,
    restore_order,
    ring_append,
    ring_leaving,
    ring_start,
    ring_visible,
    sink_queries,
    window_slot,
)
from attnzoo.modeling.cache import RecurrentStateLayer

FAR_PART_REGISTRY: dict[str, type[FarPart]] = {}


class _LogSumExpOfSoftmax(torch.autograd.Function):
    """log sum exp(s) over the last axis, from the softmax p of the scores s and their largest, s_max: p is largest
    there, at exp(s_max - lse) >= 1 / n, so lse = s_max - log max p is exact to rounding, and costs two reductions
    rather than another exp pass. Its gradient is p, logsumexp's (differentiating the formula instead would be wrong
    wherever two unequal scores round to one probability)."""

    @staticmethod
    def forward(ctx, logits, probs, peak):
        ctx.save_for_backward(probs)
        return peak - probs.amax(-1).log()

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        return grad.unsqueeze(-1) * probs, None, None


def far_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax, logsumexp) over the last axis of logits [..., K], where -inf or the dtype's lowest finite value
    marks a key that is not a far key. A query without far keys gets lse -inf (with a zero, not NaN, gradient) and a
    uniform softmax that its lse gives no weight. torch's fused softmax runs over finite scores (exp of -inf scores
    is a slow path: exp(s - lse) and logsumexp took up to twice as long, one thread), and the log-sum-exp is read off
    it (`_LogSumExpOfSoftmax`)."""
    lowest = torch.finfo(logits.dtype).min
    finite = logits.clamp(min=lowest)
    probs = torch.softmax(finite, dim=-1)
    peak = finite.detach().amax(-1)
    return probs, torch.where(peak > lowest, _LogSumExpOfSoftmax.apply(finite, probs, peak), float("-inf"))


def log_far_mass(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last axis of logits [..., Q, K] (-inf: not a far key), -inf for a query without far keys,
    with a zero (not NaN) gradient there."""
    return far_softmax(logits)[1]


def normalised_far(logits: torch.Tensor, values: torch.Tensor):
    """The far triple of a far part that is a softmax itself: (softmax(logits) @ values, 1, logsumexp(logits)) for
    logits [..., Q, K] (-inf: not a far key) and values [..., K, e]; a query without far keys gets 0, 1, -inf."""
    probs, lse = far_softmax(logits)
    return torch.where(torch.isfinite(lse)[..., None], probs @ values, 0.0), torch.ones_like(lse), lse


@dataclass(frozen=True)
class FarInputs:
    """What every form of a far part gets, in one bundle (the module docstring says what each form's fields hold).
    q [B, H, Q, d]: the queries as the far part sees them; k, v [B, kv_heads, K, d|e]: the keys and values (all the
    tokens in `parallel` and `reference`, the new token's in `step`); valid [B, K]: which of them are real tokens;
    position [B, Q]: each query's real position."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    position: torch.Tensor
    #: reference: [B, L, L] the far keys of each query (the window rule's)
    far: torch.Tensor | None = None
    #: step: (k, v [B, kv_heads, 1, d|e], joins [B]): the key that leaves the window as the token arrives
    leaving: tuple | None = None
    #: step: the state the far part's last call returned
    state: dict | None = None
    #: step (and a prefill): the per-generation constants the far part returned, {} if none
    constants: dict | None = None
    #: parallel: return the decoding state (a prefill)
    keep_state: bool = False
    #: step: the tokens the cache held before this one, padding included (a host bound on every position)
    seen: int = 0
    #: parallel and reference: the reversible stack's record of this forward's draws, or None
    recompute: object = None

    @property
    def n_real(self) -> torch.Tensor:
        """[B] real tokens per row."""
        return self.valid.sum(-1)


class FarOutput(NamedTuple):
    """A far part's result: (numerator [B, H, Q, e], denominator [B, H, Q], log scale [B, H, Q]) for its queries,
    and what decoding keeps: `state` (tensors with a leading batch axis) and `constants` (without one), or None."""

    num: torch.Tensor
    den: torch.Tensor
    log_scale: torch.Tensor
    state: dict | None = None
    constants: dict | None = None


def check_far_outputs(layer: WindowedAttention, form: str, outputs, x: FarInputs) -> FarOutput:
    """`outputs`, what a far part's form `form` returned for the bundle x, as a FarOutput if its triple has the
    contract's shapes [B, H, Q, e], [B, H, Q], [B, H, Q] (a plain triple is a FarOutput without state); else a
    ValueError naming the far part, rather than a broadcasting error (or a silent broadcast) inside `merge_far`. Only
    host-side shape comparisons, no device sync: cheap enough for every call, decoding steps included."""
    batch, heads, queries = x.q.shape[:3]
    expected = ((batch, heads, queries, x.v.shape[-1]), (batch, heads, queries), (batch, heads, queries))
    if not isinstance(outputs, FarOutput) and isinstance(outputs, tuple | list) and len(outputs) == 3:
        outputs = FarOutput(*outputs)
    if isinstance(outputs, FarOutput) and all(isinstance(t, torch.Tensor) for t in outputs[:3]):
        if tuple(tuple(t.shape) for t in outputs[:3]) == expected:
            return outputs
        got = "shapes " + ", ".join(str(list(t.shape)) for t in outputs[:3])
    else:
        got = f"a {type(outputs).__name__}" + (f" of {len(outputs)}" if isinstance(outputs, tuple | list) else "")
    raise ValueError(f"far part {type(layer.far).__name__} (attention {layer.name!r}): {form}() returned {got}; it "
                     "must return a FarOutput (or three tensors: numerator, denominator, log scale) of shapes "
                     f"{', '.join(str(list(shape)) for shape in expected)} ([batch, heads, queries, value width], "
                     "[batch, heads, queries] twice; the contract is in attnzoo/modeling/attention/windowed.py).")


#: the prefix of a far part's state entries in the layer's cache slot, beside the ring's
FAR_STATE = "far."


def far_state(slot) -> dict[str, torch.Tensor]:
    """The far part's decoding state in a windowed layer's cache slot `slot`: what its last call returned."""
    return {name[len(FAR_STATE):]: t for name, t in slot.state.items() if name.startswith(FAR_STATE)}


class FarPart:
    """The far part of a windowed layer: see the module docstring for the contract. Subclasses implement
    `parallel`, `step` and `reference`, each taking a `FarInputs` and returning a `FarOutput`; the class attributes
    below describe them to the layer, which projects, rotates and scores (nothing of the near part is the far
    part's)."""

    #: the config class (by name) whose fields the far part reads (its layer also reads `ZooWindowSettings`)
    family_config: ClassVar[str] = "ZooConfig"
    #: the family's plain attention, named in the refusal of an encoder layer
    plain_kind: ClassVar[str] = ""
    #: the layer's projection modules (what a conversion carries)
    projection_names: ClassVar[tuple[str, ...]] = ZooAttention.projection_names
    #: the config field of the head width when the family has its own (the Reformer's `reformer_head_size`)
    head_size_field: ClassVar[str | None] = None
    #: the config field that says whether queries and keys share one projection (LSH's shared QK, whose keys are the
    #: normalised queries); None: separate projections. The layer projects and scores accordingly.
    shared_qk_field: ClassVar[str | None] = None

    def __init__(self, layer: WindowedAttention, config):
        # The layer holds the far part's parameters and buffers (under its plain family's names, so a checkpoint's
        # keys do not depend on the layer being windowed): the far part is not a module.
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        if layer.far_kv_heads is not None:  # built for the heads that keep it (module docstring)
            self.num_kv_heads = len(layer.far_kv_heads)
            self.num_heads = self.num_kv_heads * (layer.num_heads // layer.num_kv_heads)
        self.layer_idx = layer.layer_idx
        self.window_size, self.sinks = layer.window_size, layer.sinks
        self.training = layer.training  # kept in step by the layer's `train()`

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, kv_heads, ...] -> [batch, heads, ...]: query head h reads key/value head h // group."""
        if self.num_kv_heads == self.num_heads:
            return x
        return x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    # -- optional hooks --------------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        """Once per forward pass of the whole model (per-step draws)."""

    def init_buffers(self) -> None:
        """Fill buffers a checkpoint did not provide (`transformers.initialization` functions)."""

    def loaded(self) -> None:
        """After the layer's tensors were loaded from a state dict."""

    # -- the far part ----------------------------------------------------------------------------------------------
    def parallel(self, x: FarInputs) -> FarOutput:
        raise NotImplementedError

    def step(self, x: FarInputs) -> FarOutput:
        raise NotImplementedError

    def reference(self, x: FarInputs) -> FarOutput:
        raise NotImplementedError


class WindowedAttention(DrawsPerForward, InitialisesBuffers, UsesRecomputation, ZooAttention):
    """An exact window with sinks (`window.NearPart`) plus the far part `far_part_class`, under one normalisation
    (module docstring). With a far part, causal (decoder) layers only; without one (`far_part_class` None: the
    "window" attention), bidirectional layers too. The window always sees rotary positions; the far part sees the
    queries and keys `far_positions` gives it (`far_view`)."""

    far_part_class: ClassVar[type[FarPart] | None]
    position_free_far_part = True

    def __init__(self, config, layer_idx: int, causal: bool):
        far_part_class = self.far_part_class
        if not causal and far_part_class is not None:
            raise ValueError(f"attention {self.name!r} is for causal (decoder) layers: set is_decoder=True for a "
                             "decoder-only model, or list it in decoder_attn_layers of an encoder-decoder; in "
                             f"encoders use {far_part_class.plain_kind or 'another attention'!r} or 'window'.")
        field = far_part_class.head_size_field if far_part_class is not None else None
        super().__init__(config, layer_idx, causal, head_dim=getattr(config, field) if field else None)
        self.window_size, self.sinks = self.near_span(config)
        self.sink_positions = config.sink_positions
        field = far_part_class.shared_qk_field if far_part_class is not None else None
        self.shared_qk = bool(getattr(config, field)) if field else False
        if self.shared_qk:  # one head per query head for the shared vectors; grouped-query models group the values
            self.query_key, self.value = head_projection(self), head_projection(self, key_value=True)
            self.output = head_projection(self, into_heads=False)
        else:
            self.build_projections()
        self.window_dropout = config.attention_probs_dropout_prob
        heads = far_kv_heads_of(config, layer_idx)
        #: the key-value heads that keep the far part, ascending; None: every head (the config's `far_kv_heads`)
        self.far_kv_heads = None if heads is None or sorted(heads) == list(range(self.num_kv_heads)) else sorted(heads)
        self.far = None if far_part_class is None else far_part_class(self, config)

    @classmethod
    def near_span(cls, config) -> tuple[int, int]:
        """(window size, sinks) of the near part."""
        return config.window_size, config.num_sink_tokens

    @property
    def near(self) -> NearPart:
        """The near part with the layer's scoring and the dropout of now: q·k / √d, or with shared QK LSH's (keys
        normalised, no scale, a query's own key penalised: used only when nothing else is)."""
        scale = 1.0 if self.shared_qk else 1.0 / math.sqrt(self.head_dim)
        return NearPart(self.window_size, self.sinks, self.causal, scale, self.shared_qk, self.window_dropout)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.far is not None:
            self.far.training = mode
        return self

    def start_forward(self) -> None:
        if self.far is not None:
            self.far.start_forward()

    def init_buffers(self) -> None:
        if self.far is not None:
            self.far.init_buffers()

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.far is not None:
            self.far.loaded()

    def new_cache_layer(self):
        return WindowStateLayer(self.window_size, self.sinks) if self.far is None else RecurrentStateLayer()

    def new_static_cache_layer(self, max_cache_len: int):
        return None  # the ring and the far states are updated out of place: no static slot yet

    def _project(self, hidden_states):
        """q [B, H, L, d] and k, v [B, kv_heads, L, d] before rotary positions (the ring and the states keep the
        unrepeated heads); with a far part in float32 at least, for its features and sums. Shared QK: (qk, qk, v),
        in the model's dtype."""
        if self.shared_qk:
            qk = self.split_heads(self.query_key(hidden_states))
            return qk, qk, self.split_heads(self.value(hidden_states))
        qkv = (self.split_heads(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.far is None:
            return tuple(qkv)
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        return tuple(x.to(compute) for x in qkv)

    def _output(self, x):
        return self.output(x) if self.shared_qk else self.o_proj(x)

    def _near_keys(self, k):
        """The keys the near part scores against (shared QK: normalised, one per query head)."""
        return normalize_keys(k) if self.shared_qk else k

    def _views(self, hidden_states, position_ids, past, layer=None, valid=None):
        """(q, k, v, q_far, k_far, sink_q): the near part's rotated queries and keys, the values, what the far part
        sees (the same tensors unless `far_positions` says otherwise) and the queries that score the sinks
        (`window.sink_queries`: None when they are q)."""
        q, k, v = self._project(hidden_states)
        rotation = self.rotation(position_ids, past, q.shape[2], q.device, q.dtype)
        q_rotated, k_rotated = self.rotate(q, rotation), self.rotate(k, rotation)
        far_q, far_k = (q_rotated, k_rotated) if self.far is None else self.far_view(
            q, k, q_rotated, k_rotated, position_ids, past,
            real_positions(layer, valid) if self.far_positions == "grouped" else None)
        return q_rotated, k_rotated, v, far_q, far_k, sink_queries(self, q, position_ids, past, layer, valid)

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
            out = self._parallel(q, k, v, q_far, k_far, valid, layer, recompute, sink_q,
                                 all_real=attention_mask is None)
        return self._output(self.merge_heads(out.to(hidden_states.dtype)))

    # -- the far part's heads ---------------------------------------------------------------------------------------
    def _call_far(self, form: str, x: FarInputs) -> FarOutput:
        """The far part's form `form` on the bundle x, checked; with `far_kv_heads`, on the chosen heads' slice of x,
        and widened to every query head (the others: no far keys)."""
        if self.far_kv_heads is None:
            return check_far_outputs(self, form, getattr(self.far, form)(x), x)
        query_heads, kv_heads = self.far_head_indices(x.q.device)

        def heads_of(t):  # a keys' tensor has a head per query head under shared QK, else per key-value head
            return t.index_select(1, query_heads if t.shape[1] == self.num_heads else kv_heads)

        leaving = None if x.leaving is None else (heads_of(x.leaving[0]), heads_of(x.leaving[1]), *x.leaving[2:])
        chosen = replace(x, q=heads_of(x.q), k=heads_of(x.k), v=heads_of(x.v), leaving=leaving)
        out = check_far_outputs(self, form, getattr(self.far, form)(chosen), chosen)
        shape = (x.q.shape[0], self.num_heads, *out.num.shape[2:])
        num = out.num.new_zeros(shape).index_copy(1, query_heads, out.num)
        den = out.den.new_ones(shape[:3]).index_copy(1, query_heads, out.den)
        log_scale = out.log_scale.new_full(shape[:3], float("-inf")).index_copy(1, query_heads, out.log_scale)
        return FarOutput(num, den, log_scale, out.state, out.constants)

    def far_head_indices(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(query heads [H'], key-value heads [kv']) that keep the far part: query head h reads key-value head
        h // group (`FarPart.expand_kv`)."""
        group = self.num_heads // self.num_kv_heads
        kv_heads = torch.tensor(self.far_kv_heads, device=device)
        return (kv_heads[:, None] * group + torch.arange(group, device=device)).flatten(), kv_heads

    # -- the parallel form -----------------------------------------------------------------------------------------
    def _parallel(self, q, k, v, q_far, k_far, valid, layer, recompute, sink_q=None, all_real=False):
        """Rows left-aligned (each row's real tokens first: a sequence index is then a real position; skipped when
        no mask was given, so every token is real), the near part over them, the far part merged."""
        length = q.shape[2]
        order = None if all_real else left_align(valid)

        def aligned(x):
            return x if x is None or order is None else gather_tokens(x, order)

        far_q = None if q_far is q else aligned(q_far)
        far_k = None if k_far is k else aligned(k_far)
        sink_q = aligned(sink_q)
        q, k, v = aligned(q), aligned(k), aligned(v)
        n_real = valid.sum(-1)
        far, far_entries = None, {}
        if self.far is not None:
            position = torch.arange(length, device=q.device)
            x = FarInputs(q if far_q is None else far_q, k if far_k is None else far_k, v,
                          position[None, :] < n_real[:, None], position[None, :].expand(q.shape[0], -1),
                          keep_state=layer is not None, recompute=recompute)
            far = self._call_far("parallel", x)
            if layer is not None:
                far_entries = {FAR_STATE + name: t for name, t in (far.state or {}).items()}
                layer.shared.update(far.constants or {})
        if layer is not None:
            layer.store(length, **ring_start(k, v, n_real, self.window_size, self.sinks, far_k), **far_entries)
        far = None if far is None else far[:3]
        out = self.near.parallel(q, self._near_keys(k), v, n_real, sink_q, far, self.training)
        return out if order is None else restore_order(out, order)

    # -- decoding --------------------------------------------------------------------------------------------------
    def _step(self, q, k, v, q_far, real, layer, far_k=None, sink_q=None):
        """One new token per row (`real` [B]: whether it is a real token): the key leaving the window goes to the far
        part, the token joins the ring, and it attends to the sinks and window exactly and to the far part.
        `far_k`: the key as the far part sees it, when that is not `k`; `sink_q`: the query that scores the sinks,
        when that is not `q`."""
        state = layer.state
        position = state["count"]  # [B]: this token's position when real
        leaving = ring_leaving(state, real, self.window_size, self.sinks)  # copies, before the token's write
        ring = ring_append(state, k, v, real, self.window_size, self.sinks, far_k)  # written in place
        keys, values, allowed = ring_visible({**state, **ring}, position, self.window_size, self.sinks)
        far, far_entries = None, {}
        if self.far is not None:
            x = FarInputs(q_far, k if far_k is None else far_k, v, real[:, None], position[:, None], leaving=leaving,
                          state=far_state(layer), constants=layer.shared, seen=layer.get_seq_length())
            far = self._call_far("step", x)
            far_entries = {FAR_STATE + name: t for name, t in (far.state or {}).items()}
            far = far[:3]
        layer.store(1, **ring, **far_entries)
        return self.near.step(q, self._near_keys(keys), values, allowed, sink_q, far,
                              window_slot(position, self.window_size, self.sinks))

    # -- reference --------------------------------------------------------------------------------------------------
    def reference_forward(self, hidden_states, attention_mask=None, cache=None, recompute=None, position_ids=None):
        """Dense [L, L] masks in the tokens' own order: the near keys (`window.dense_near_and_far`; a padded query
        sees its own key) scored exactly, the far part's `reference` over the far keys, one normalisation."""
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool,
                                                                 device=hidden_states.device)
        q, k, v, q_far, k_far, sink_q = self._views(hidden_states, position_ids, 0, None, valid)
        far_part = None
        if self.far is not None:
            far = dense_near_and_far(valid, self.window_size, self.sinks)[1]
            x = FarInputs(q_far, k_far, v, valid, valid.long().cumsum(-1) - 1, far=far, recompute=recompute)
            far_part = self._call_far("reference", x)[:3]
        out = self.near.reference(q, self._near_keys(k), v, valid, sink_q, far_part)
        return self._output(self.merge_heads(out.to(hidden_states.dtype)))


@register_attention("window")
class WindowAttention(WindowedAttention):
    """Exact softmax over the last `window_size` tokens and the first `num_sink_tokens` ones: the windowed layer
    with no far part. Bidirectional layers see `window_size - 1` tokens to each side. See `window.py`."""

    far_part_class = None
    family_config = "ZooWindowSettings"
    position_free_far_part = False


def register_far_part(name: str):
    """Class decorator: make a `FarPart` available as `name`, and the windowed layer with it as the attention kind
    `f"{name}_window"`. The layer class (`cls.layer_class`, named Windowed<Name>Attention after the far part's class
    <Name>FarPart) is also put in the far part's module, so that pickling and checkpoints' remote code find it
    there by name. Both names are registered or neither: a clash is refused before either registry changes, so a
    corrected retry is not refused as a half registration. Decorating the same class again changes nothing."""

    def add(cls: type[FarPart]) -> type[FarPart]:
        kind = f"{name}_window"
        registered, clash = FAR_PART_REGISTRY.get(name), ATTENTION_REGISTRY.get(kind)
        if registered is cls and clash is getattr(cls, "layer_class", None):
            return cls
        if registered is not None and not replaceable(registered):
            raise ValueError(f"far part name {name!r} is already registered to {registered.__name__} (module "
                             f"{registered.__module__}); give {cls.__name__} another name in @register_far_part.")
        if clash is not None and not replaceable(clash):
            raise ValueError(f"far part name {name!r} would register the attention kind {kind!r}, which is already "
                             f"registered to {clash.__name__} (module {clash.__module__}); give {cls.__name__} "
                             "another name in @register_far_part (nothing was registered).")
        class_name = f"Windowed{cls.__name__.removesuffix('FarPart')}Attention"
        layer_class = type(class_name, (WindowedAttention,), {
            "far_part_class": cls, "family_config": (cls.family_config, "ZooWindowSettings"),
            "projection_names": cls.projection_names,
            "__module__": cls.__module__, "__qualname__": class_name,
            "__doc__": f"An exact window with sinks plus the far part {cls.__name__}, under one normalisation."})
        register_attention(kind)(layer_class)  # cannot refuse now: the kind is free (or a checkpoint copy's)
        FAR_PART_REGISTRY[name] = cls
        cls.layer_class = layer_class
        vars(sys.modules[cls.__module__])[class_name] = layer_class
        return cls

    return add
