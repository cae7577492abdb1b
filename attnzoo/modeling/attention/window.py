"""Sliding-window attention with attention sinks: each query sees, exactly, the last `window_size` tokens (itself
included) and the first `num_sink_tokens` tokens of its sequence.

The sinks are "Efficient Streaming Language Models with Attention Sinks" (StreamingLLM, arXiv 2309.17453): trained
softmax models put much of their attention mass on the first tokens, so a window keeps quality only when those stay
visible. Cut into a pretrained model with no training at all (window 64, 4 sinks), this is the baseline that
linearizing conversions have to beat ("Sliding-window beats linear attention", arXiv 2608.28444).

Positions count real tokens, from each row's first real token, so a left-padded row attends exactly as it would
alone: the module moves each row's real tokens to the front, attends, and moves the outputs back. The parallel form
cuts the sequence into blocks of `window_size` queries; each block's keys are its own block, the block before (and,
in bidirectional layers, the one after) and the sinks, so memory and time are O(length * (2 * window + sinks)). A
sink that is also inside a query's window is counted once (in the window). Decoding keeps the sinks and a ring of
the last `window_size` tokens: S + W keys and values per layer, whatever the context length.

In rotary models a query at position p sees a sink p tokens back, so at p beyond the training length the window part
meets rotary distances it never saw in training, through the sinks alone. With `sink_positions="adjacent"` the
queries score the sinks rotated at min(p, W + S - 1) instead (`sink_queries`): the sinks sit just before the window
(distances W .. W + S - 1 for a sink outside it), StreamingLLM's positions within the cache (arXiv 2309.17453,
section 3.2), and every near distance stays below W + S at any length. The keys are rotated as always; p counts
real tokens, so rotary positions that do not start at 0 (an offset, or a padded row without `position_ids`) move
the sinks with them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnzoo.modeling.attention.base import ZooAttention, check_attention_mask, register_attention
from attnzoo.modeling.cache import RecurrentStateLayer
from attnzoo.ops.chunked_attention import mask_values, pad_to_multiple


# -- the near/far rule, once ------------------------------------------------------------------------------------------
# Positions count real tokens. A key at position p is NEAR a (causal) query at position i when it is in the query's
# window (0 <= i - p < W) or is one of the first S tokens (a sink, p < S); every other earlier real key is FAR. The
# exact window part attends to the near keys; a windowed layer's far part (FAVOR+, causal LARA, RA, LSH) to the far
# ones. Every layer, form (parallel, decoding, reference) and mask below is written with these two functions.
def in_window(query_pos, key_pos, window: int):
    """Whether a key at `key_pos` lies in the causal window of a query at `query_pos` (broadcasting tensors)."""
    gap = query_pos - key_pos
    return (gap >= 0) & (gap < window)


def outside_window(query_pos, key_pos, window: int):
    """Whether a key at `key_pos` comes before the window of a query at `query_pos` (a sink there is attended as a
    sink; one inside the window, as part of the window)."""
    return query_pos - key_pos >= window


def beyond_window(query_pos, key_pos, window: int, sinks: int):
    """Whether an earlier key at `key_pos` is far from a query at `query_pos`: before its window and not a sink."""
    return outside_window(query_pos, key_pos, window) & (key_pos >= sinks)


def real_positions(layer, valid: torch.Tensor) -> torch.Tensor:
    """[B, L] each new token's position counted in real tokens (`valid` [B, L]), after the real tokens the cache
    slot `layer` already holds (None or empty: none)."""
    before = layer.state["count"][:, None] if layer is not None and layer.state else 0
    return before + valid.long().cumsum(-1) - 1


def sink_queries(module, q, position_ids, past, layer=None, valid=None):
    """The queries as they score the sinks: `q` [B, H, L, d] before rotation, rotated when the module's
    `sink_positions` is "adjacent" (see the module docstring) at their rotary positions (`position_ids`, or `past,
    past + 1, ...`) moved back by max(0, p - (W + S - 1)), p counting real tokens (`real_positions(layer, valid)`;
    `valid` None: every token real): a query then sees its row's first real token, whatever rotary position that
    has, at most W + S - 1 tokens back. None when the sinks are scored by the rotated queries themselves."""
    if module.sink_positions != "adjacent" or module.rotary is None or not module.sinks:
        return None
    if position_ids is None:
        position_ids = (past + torch.arange(q.shape[2], device=q.device))[None]
    if valid is None:
        valid = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
    beyond = (real_positions(layer, valid) - (module.window_size + module.sinks - 1)).clamp(min=0)
    return module.rotate(q, module.rotation(position_ids - beyond, past, q.shape[2], q.device, q.dtype))


def dense_sink_scores(scores, sink_q, keys, valid, window: int, sinks: int, scale: float):
    """Dense scores [B, H, L, L] (queries and keys in the tokens' own order) with each sink column that a query
    attends to as a sink (before its window) scored by `sink_q` instead: the references' form of `sink_queries`."""
    if sink_q is None:
        return scores
    pos = valid.long().cumsum(-1) - 1
    as_sink = (pos[:, None, :] < sinks) & outside_window(pos[:, :, None], pos[:, None, :], window)  # [B, L, L]
    return torch.where(as_sink[:, None], (sink_q @ keys.transpose(-1, -2)) * scale, scores)


def ring_scores(q, sink_q, keys, sinks: int):
    """q [B, H, 1, d] against the ring's keys [B, H, S + W, d] (sinks first), the sink columns by `sink_q` when
    given (unscaled)."""
    if sink_q is None:
        return q @ keys.transpose(-1, -2)
    return torch.cat([sink_q @ keys[:, :, :sinks].transpose(-1, -2), q @ keys[:, :, sinks:].transpose(-1, -2)], -1)


def dense_near_and_far(valid: torch.Tensor, window: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(near, far) [B, L, L] bool masks of the dense references for `valid` [B, L] real tokens, each query's earlier
    real keys split by the rule above (positions counted in real tokens)."""
    length = valid.shape[1]
    pos = valid.long().cumsum(-1) - 1
    index = torch.arange(length, device=valid.device)
    earlier = (index[:, None] >= index[None, :])[None] & valid[:, None, :]
    far = earlier & beyond_window(pos[:, :, None], pos[:, None, :], window, sinks)
    return earlier & ~far, far


def combine(scores: torch.Tensor, values: torch.Tensor, far_num: torch.Tensor, far_den: torch.Tensor,
            far_scale: torch.Tensor, dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """The one normalisation of every windowed layer: the exact near part (scores [..., Q, K], disallowed keys at the
    dtype's most negative value or -inf; values [..., K, e]) and the far part, given per query as a numerator
    [..., Q, e], a denominator [..., Q] and their common log scale [..., Q]:

        out = (Σ_near exp(s) v + exp(c) far_num) / (Σ_near exp(s) + exp(c) far_den).

    A far part that is itself normalised (LSH's bucket attention, RA's far values) gives far_den = 1 and its
    log-sum-exp as c; a query without far keys gives c = -inf. `dropout` applies to the near weights in training (the
    far part's draws are its own)."""
    top = torch.maximum(scores.amax(-1), far_scale).detach()
    near = torch.exp(scores - top[..., None])
    far = torch.exp(far_scale - top)
    denominator = near.sum(-1) + far * far_den
    if dropout > 0.0 and training:
        near = F.dropout(near / denominator[..., None], dropout) * denominator[..., None]
    numerator = torch.einsum("...qk,...ke->...qe", near, values) + far[..., None] * far_num
    return numerator / denominator[..., None]


def left_align(valid: torch.Tensor) -> torch.Tensor:
    """[B, L] permutation that moves each row's real tokens to the front, in order (stable)."""
    return torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)


def gather_tokens(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, d] reordered along L by order [B, L]."""
    return x.gather(2, order[:, None, :, None].expand_as(x))


def restore_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of `gather_tokens(x, order)` along the token axis (2)."""
    return torch.empty_like(x).scatter_(2, order[:, None, :, None].expand_as(x), x)


def window_scores(q, k, v, n_real, window: int, sinks: int, causal: bool, scale: float, sink_q=None):
    """The blocked window-with-sinks scores of left-aligned q, k, v [B, H, L, d] with `n_real` [B] real tokens:
    (scores [B, H, blocks, window, keys] with disallowed keys at the dtype's most negative value, values
    [B, H, blocks, keys, d]). Block c's keys are the sinks, then blocks c - 1 and c (and c + 1 when not causal); a
    sink inside a query's window is counted in the window only; a padded query with nothing to see gets its own
    key. Query rows past L (up to `blocks * window`) are padding. `sink_q` (left-aligned as q): the queries that
    score the sink columns (`sink_queries`), when not q."""
    batch, heads, _, dim = q.shape
    w = window
    q, k, v = (pad_to_multiple(x, w, dim=2) for x in (q, k, v))
    sink_q = q if sink_q is None else pad_to_multiple(sink_q, w, dim=2)
    blocks = q.shape[2] // w
    device = q.device
    position = torch.arange(blocks * w, device=device)
    real = position[None, :] < n_real[:, None]  # [B, Lp]
    neighbours = [-1, 0] if causal else [-1, 0, 1]

    def around(x):  # [B, H, Lp, d] -> [B, H, blocks, len(neighbours) * w, d]: each block's neighbour blocks
        x = x.view(*x.shape[:2], blocks, w, -1)
        padded = F.pad(x, (0, 0, 0, 0, 1, 1))
        return torch.cat([padded[:, :, 1 + n:1 + n + blocks] for n in neighbours], dim=3)

    keys, values = around(k), around(v)
    key_pos = (torch.arange(blocks, device=device)[:, None] * w
               + torch.arange(-w, (len(neighbours) - 1) * w, device=device)[None, :])  # [blocks, n * w]
    in_range = (key_pos >= 0) & (key_pos < blocks * w)
    key_real = real.gather(1, key_pos.clamp(0, blocks * w - 1).flatten()[None].expand(batch, -1)).view(
        batch, blocks, -1) & in_range
    query_pos = position.view(blocks, w)
    gap = query_pos[:, :, None] - key_pos[:, None, :]  # [blocks, w, n * w]
    near = in_window(query_pos[:, :, None], key_pos[:, None, :], w) if causal else gap.abs() < w
    allowed = near[None] & key_real[:, :, None, :]
    own = gap == 0
    sink_count = min(sinks, blocks * w)
    if sink_count:  # a sink inside the query's window is counted there
        sink_pos = torch.arange(sink_count, device=device)
        sink_gap = query_pos[:, :, None] - sink_pos  # [blocks, w, S]
        far = outside_window(query_pos[:, :, None], sink_pos, w) if causal else sink_gap.abs() >= w
        allowed = torch.cat([far[None] & real[:, None, None, :sink_count], allowed], dim=-1)
        values = torch.cat([v[:, :, None, :sink_count].expand(-1, -1, blocks, -1, -1), values], dim=3)
        own = torch.cat([torch.zeros_like(far), own], dim=-1)
    allowed = allowed | (~allowed.any(-1, keepdim=True) & own[None])
    scores = torch.einsum("bhcqd,bhckd->bhcqk", q.view(batch, heads, blocks, w, dim), keys)
    if sink_count:
        sink_scores = torch.einsum("bhcqd,bhkd->bhcqk", sink_q.view(batch, heads, blocks, w, dim), k[:, :, :sink_count])
        scores = torch.cat([sink_scores, scores], dim=-1)
    scores = scores * scale
    return scores.masked_fill(~allowed[:, None], mask_values(scores.dtype)[0]), values


# -- the decoding ring of the near part ---------------------------------------------------------------------------
# Its tensors live in a cache slot's `state` dict (a `RecurrentStateLayer`'s, or a subclass's), so a windowed layer
# keeps its far part's state beside them in the same slot: the sinks' keys and values [B, kv_heads, S, d] with their
# validity [B, S], the last W tokens' keys and values [B, kv_heads, W, d] with their positions [B, W] (-1: empty),
# and the number of real tokens seen per row [B]. Its size does not grow with the context.
def ring_start(k, v, n_real, window: int, sinks: int, far_k=None) -> dict[str, torch.Tensor]:
    """The ring after a prefill of left-aligned keys/values [B, kv_heads, L, d] with `n_real` [B] real tokens:
    sinks = the first S real tokens, window = the last W real tokens of each row. `far_k`: the keys as a far part
    sees them, when they are not `k` (a far part without positions): the window keeps those too, for the far part to
    take when they leave."""
    batch, kv_heads, length, dim = k.shape
    device = k.device
    sink_index = torch.arange(sinks, device=device)
    sink_take = sink_index.clamp(max=max(length - 1, 0))[None].expand(batch, -1)
    window_index = n_real[:, None] - window + torch.arange(window, device=device)[None]  # the last W real positions
    window_take = window_index.clamp(0, max(length - 1, 0))

    def take(x, index):
        return x.gather(2, index[:, None, :, None].expand(batch, x.shape[1], index.shape[1], x.shape[3]))

    ring = {"sink_k": take(k, sink_take), "sink_v": take(v, sink_take),
            "sink_valid": sink_index[None] < n_real[:, None], "window_k": take(k, window_take),
            "window_v": take(v, window_take), "window_pos": torch.where(window_index >= 0, window_index, -1),
            "count": n_real.clone()}
    if far_k is not None:
        ring["window_far_k"] = take(far_k, window_take)
    return ring


def ring_leaving(state, real, window: int, sinks: int):
    """(k, v [B, kv_heads, 1, d], joins [B]) of the key that leaves the window when a token at position
    `state["count"]` arrives: the ring's oldest (as the far part sees it), which joins the far keys when the token is
    real and that key is at position count - W and not a sink."""
    position, leaving_pos = state["count"], state["window_pos"][:, 0]
    joins = real & (leaving_pos == position - window) & beyond_window(position, leaving_pos, window, sinks)
    return state.get("window_far_k", state["window_k"])[:, :, :1], state["window_v"][:, :, :1], joins


def ring_append(state, k, v, real, sinks: int, far_k=None) -> dict[str, torch.Tensor]:
    """The ring's tensors after one new token per row (k, v [B, kv_heads, 1, d]) when `real` [B]: into its sink slot
    while fewer than S tokens were seen, and into the window (the oldest token leaves). Padded tokens change
    nothing. Returns the new tensors; the caller stores them."""
    position = state["count"]
    gate = real[:, None, None, None]
    new = {}
    if sinks:
        slot = (torch.arange(sinks, device=k.device)[None] == position[:, None]) & real[:, None]  # [B, S]
        new["sink_k"] = torch.where(slot[:, None, :, None], k, state["sink_k"])
        new["sink_v"] = torch.where(slot[:, None, :, None], v, state["sink_v"])
        new["sink_valid"] = state["sink_valid"] | slot
    new["window_k"] = torch.where(gate, torch.cat([state["window_k"][:, :, 1:], k], 2), state["window_k"])
    new["window_v"] = torch.where(gate, torch.cat([state["window_v"][:, :, 1:], v], 2), state["window_v"])
    new["window_pos"] = torch.where(real[:, None], torch.cat([state["window_pos"][:, 1:], position[:, None]], 1),
                                    state["window_pos"])
    if far_k is not None:
        new["window_far_k"] = torch.where(gate, torch.cat([state["window_far_k"][:, :, 1:], far_k], 2),
                                          state["window_far_k"])
    new["count"] = position + real.long()
    return new


def ring_visible(state, position, window: int, sinks: int):
    """(keys, values [B, kv_heads, S + W, d], allowed [B, S + W]) that a token at `position` [B] attends to: the
    sinks outside its window, and the ring."""
    sink_pos = torch.arange(sinks, device=position.device)[None]
    sink_allowed = state["sink_valid"] & outside_window(position[:, None], sink_pos, window)
    allowed = torch.cat([sink_allowed, state["window_pos"] >= 0], dim=1)
    allowed[:, -1] |= ~allowed.any(-1)  # a padded token in an empty row: finite, never read
    return (torch.cat([state["sink_k"], state["window_k"]], 2), torch.cat([state["sink_v"], state["window_v"]], 2),
            allowed)


class WindowStateLayer(RecurrentStateLayer):
    """Decoding state of the "window" attention: the ring above, nothing else."""

    def __init__(self, window: int, sinks: int):
        super().__init__()
        self.window_size, self.sinks = window, sinks

    def start(self, k, v, n_real) -> None:
        self.store(k.shape[2], **ring_start(k, v, n_real, self.window_size, self.sinks))

    def append(self, k, v, real) -> None:
        self.store(1, **ring_append(self.state, k, v, real, self.sinks))

    def visible(self, position):
        return ring_visible(self.state, position, self.window_size, self.sinks)


def new_token_inputs(module, hidden_states, attention_mask, cache):
    """(this layer's cache slot or None, the number of cached tokens, the validity [B, L] of the new tokens) for a
    causal window layer; a cache in a bidirectional layer is refused."""
    layer = module.cache_slot(cache)
    if layer is not None and not module.causal:
        raise ValueError("a cache is only used by causal (decoder) attention.")
    batch, length, _ = hidden_states.shape
    past = layer.get_seq_length() if layer is not None else 0
    key_mask = check_attention_mask(attention_mask, batch, past + length)
    valid = key_mask[:, past:] if key_mask is not None else torch.ones(batch, length, dtype=torch.bool,
                                                                     device=hidden_states.device)
    return layer, past, valid


@register_attention("window")
class SlidingWindowAttention(ZooAttention):
    """Exact softmax over the last `window_size` tokens and the first `num_sink_tokens` ones; see the module
    docstring. Bidirectional layers see `window_size - 1` tokens to each side."""

    family_config = "ZooWindowSettings"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.build_projections()
        self.window_size = config.window_size
        self.sinks = config.num_sink_tokens
        self.sink_positions = config.sink_positions
        self.dropout = config.attention_probs_dropout_prob
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def new_cache_layer(self):
        return WindowStateLayer(self.window_size, self.sinks)

    def _project(self, hidden_states, position_ids, past, layer=None, valid=None):
        """(q, k, v, sink_q): the rotated queries and keys, the values, and the queries that score the sinks
        (`sink_queries`: None when they are q)."""
        q, k, v = (self.split_heads(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
        rotation = self.rotation(position_ids, past, q.shape[2], q.device, q.dtype)
        return (self.rotate(q, rotation), self.rotate(k, rotation), v,
                sink_queries(self, q, position_ids, past, layer, valid))

    def forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        layer, past, valid = new_token_inputs(self, hidden_states, attention_mask, cache)
        length = hidden_states.shape[1]
        q, k, v, sink_q = self._project(hidden_states, position_ids, past, layer, valid)
        if layer is not None and layer.state:
            # A continuation over a filled state; generate() feeds one token at a time (not a hot path).
            out = torch.cat([self._step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], valid[:, t], layer,
                                        None if sink_q is None else sink_q[:, :, t:t + 1])
                             for t in range(length)], dim=2)
        else:
            out = self._parallel(q, k, v, valid, layer, sink_q)
        return self.o_proj(self.merge_heads(out))

    # -- the parallel form ----------------------------------------------------------------------------------
    def _parallel(self, q, k, v, valid, layer=None, sink_q=None):
        batch, heads, length, dim = q.shape
        order = left_align(valid)
        q, k, v = gather_tokens(q, order), gather_tokens(k, order), gather_tokens(v, order)
        sink_q = None if sink_q is None else gather_tokens(sink_q, order)
        n_real = valid.sum(-1)
        if layer is not None:
            layer.start(k, v, n_real)
        scores, values = window_scores(q, self.expand_kv(k), self.expand_kv(v), n_real, self.window_size, self.sinks,
                                       self.causal, self.scale, sink_q)
        probs = F.dropout(scores.softmax(-1), self.dropout if self.training else 0.0, training=self.training)
        out = torch.einsum("bhcqk,bhckd->bhcqd", probs, values).reshape(batch, heads, -1, dim)[:, :, :length]
        return restore_order(out, order)

    # -- decoding -------------------------------------------------------------------------------------------
    def _step(self, q, k, v, real, layer: WindowStateLayer, sink_q=None):
        """One new token per row (`real` [B]: whether it is a real token): update the sinks and the ring, then attend
        to them. Padded tokens leave the state as it was."""
        position = layer.state["count"]  # [B]: this token's position when real
        layer.append(k, v, real)
        keys, values, allowed = layer.visible(position)
        scores = ring_scores(q, sink_q, self.expand_kv(keys), self.sinks) * self.scale
        probs = scores.masked_fill(~allowed[:, None, None, :], mask_values(scores.dtype)[0]).softmax(-1)
        return probs @ self.expand_kv(values)

    # -- reference --------------------------------------------------------------------------------------------
    def reference_forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        """Dense [L, L] masks over positions counted in real tokens: key j is allowed to query i when it is real,
        within the window (causal: 0 <= pos_i - pos_j < W; bidirectional: |pos_i - pos_j| < W) or one of the first
        S real tokens; a padded query sees its own key."""
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool,
                                                                 device=hidden_states.device)
        q, k, v, sink_q = self._project(hidden_states, position_ids, 0, None, valid)
        k, v = self.expand_kv(k), self.expand_kv(v)
        if self.causal:
            allowed, _ = dense_near_and_far(valid, self.window_size, self.sinks)
        else:  # bidirectional: |pos_i - pos_j| < W, and the first S real tokens
            pos = valid.long().cumsum(-1) - 1  # [B, L]
            gap = pos[:, :, None] - pos[:, None, :]
            allowed = ((gap.abs() < self.window_size) | (pos[:, None, :] < self.sinks)) & valid[:, None, :]
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=q.device)[None] & ~valid[:, :, None]
        scores = dense_sink_scores((q @ k.transpose(-1, -2)) * self.scale, sink_q, k, valid, self.window_size,
                                   self.sinks, self.scale)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        return self.o_proj(self.merge_heads(scores.softmax(-1) @ v))
