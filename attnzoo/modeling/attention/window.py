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

import torch

from attnzoo.modeling.attention.base import check_attention_mask
from attnzoo.modeling.cache import RecurrentStateLayer, write_at_rows
from attnzoo.ops.chunked_attention import mask_values
from attnzoo.ops.window_attention import merge_far, window_attention
from attnzoo.ops.window_attention.rule import beyond_window, in_window, outside_window  # noqa: F401  (the rule)

# The near/far rule (`attnzoo.ops.window_attention.rule`): a key at position p is NEAR a causal query at position i
# when it is in the query's window (0 <= i - p < W) or is one of the first S tokens (a sink, p < S); every other
# earlier real key is FAR. Every form (parallel, decoding, reference) and mask is written with its functions.


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


def left_align(valid: torch.Tensor) -> torch.Tensor:
    """[B, L] permutation that moves each row's real tokens to the front, in order (stable)."""
    return torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)


def gather_tokens(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, d] reordered along L by order [B, L]."""
    return x.gather(2, order[:, None, :, None].expand_as(x))


def restore_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of `gather_tokens(x, order)` along the token axis (2)."""
    return torch.empty_like(x).scatter_(2, order[:, None, :, None].expand_as(x), x)


# -- the decoding ring of the near part ---------------------------------------------------------------------------
# Its tensors live in a cache slot's `state` dict (a `RecurrentStateLayer`'s, or a subclass's), so a windowed layer
# keeps its far part's state beside them in the same slot: the keys and values of the sinks and of the last W tokens
# in one buffer each, `ring_k` and `ring_v` [B, kv_heads, S + W, d] (the sinks in the first S slots, the token at
# position p in slot S + p mod W), the positions their slots hold, `ring_pos` [B, S + W] (-1: empty), and the number of
# real tokens seen per row, `count` [B]. Its size does not grow with the context. A step writes its token into its
# slot in place and reads the buffers whole: the attention is the same whatever the order of the keys, so the ring is
# never shifted or concatenated (shifting it and joining it to the sinks copied the window's keys and values three
# times a step and layer: 7% of a "window" decoding step on SmolLM2's shapes after an 8K prompt).
def window_slot(position, window: int, sinks: int):
    """[B] the ring slot of the token at `position` [B]: S + position mod W (a token's own key as it attends)."""
    return sinks + torch.remainder(position, window)


def ring_start(k, v, n_real, window: int, sinks: int, far_k=None) -> dict[str, torch.Tensor]:
    """The ring after a prefill of left-aligned keys/values [B, kv_heads, L, d] with `n_real` [B] real tokens:
    sinks = the first S real tokens, window = the last W real tokens of each row, each in its slot. `far_k`: the keys
    as a far part sees them, when they are not `k` (a far part without positions): the window keeps those too
    (`ring_far_k` [B, kv_heads, W, d], position p in slot p mod W), for the far part to take when they leave."""
    batch, kv_heads, length, dim = k.shape
    device = k.device
    sink_pos = torch.arange(sinks, device=device)[None].expand(batch, -1)
    first = n_real[:, None] - window  # the window's oldest position (negative: not yet full)
    slots = torch.arange(window, device=device)[None]
    window_pos = first + torch.remainder(slots - first, window)  # the position in window slot j: the one = j mod W
    positions = torch.cat([torch.where(sink_pos < n_real[:, None], sink_pos, -1),
                           torch.where(window_pos >= 0, window_pos, -1)], dim=1)  # [B, S + W]
    take_at = positions.clamp(0, max(length - 1, 0))

    def take(x, index):
        return x.gather(2, index[:, None, :, None].expand(batch, x.shape[1], index.shape[1], x.shape[3]))

    ring = {"ring_k": take(k, take_at), "ring_v": take(v, take_at), "ring_pos": positions, "count": n_real.clone()}
    if far_k is not None:
        ring["ring_far_k"] = take(far_k, take_at[:, sinks:])
    return ring


def _row_at(store, slot):
    """store [B, h, N, d] read at `slot` [B]: [B, h, 1, d] (a copy)."""
    return store.gather(2, slot.view(-1, 1, 1, 1).expand(-1, store.shape[1], 1, store.shape[3]))


def ring_leaving(state, real, window: int, sinks: int):
    """(k, v [B, kv_heads, 1, d], joins [B]) of the key that leaves the window when a token at position
    `state["count"]` arrives: the one in the token's slot (as the far part sees it), which joins the far keys when
    the token is real and that key is at position count - W and not a sink. Copies, read before the token's write."""
    position = state["count"]
    slot = window_slot(position, window, sinks)
    leaving_pos = state["ring_pos"].gather(1, slot[:, None])[:, 0]
    joins = real & (leaving_pos == position - window) & beyond_window(position, leaving_pos, window, sinks)
    far_k = state.get("ring_far_k")
    leaving_k = _row_at(state["ring_k"], slot) if far_k is None else _row_at(far_k, slot - sinks)
    return leaving_k, _row_at(state["ring_v"], slot), joins


def ring_append(state, k, v, real, window: int, sinks: int, far_k=None) -> dict[str, torch.Tensor]:
    """The ring's tensors after one new token per row (k, v [B, kv_heads, 1, d]) when `real` [B]: into its sink slot
    while fewer than S tokens were seen, and into its window slot (over the token W before it), both in place
    (`write_at_rows`). Padded tokens change nothing. Returns the tensors; the caller stores them."""
    position = state["count"]
    ring_k, ring_v, ring_pos = state["ring_k"], state["ring_v"], state["ring_pos"][:, None]
    new_pos = position.view(-1, 1, 1)
    writes = [(window_slot(position, window, sinks), real)]
    if sinks:  # while a row has seen fewer than S real tokens, its token is also a sink
        writes.append((position.clamp(max=sinks - 1), real & (position < sinks)))
    for slot, gate in writes:
        keep = gate.view(-1, 1, 1, 1)
        # a row that does not write puts back what its slot held
        ring_k = write_at_rows(ring_k, slot, torch.where(keep, k, _row_at(ring_k, slot)), ring_k.shape[2])
        ring_v = write_at_rows(ring_v, slot, torch.where(keep, v, _row_at(ring_v, slot)), ring_v.shape[2])
        held = ring_pos.gather(2, slot.view(-1, 1, 1))
        ring_pos = write_at_rows(ring_pos, slot, torch.where(keep[..., 0], new_pos, held), ring_pos.shape[2])
    new = {"ring_k": ring_k, "ring_v": ring_v, "ring_pos": ring_pos[:, 0], "count": position + real.long()}
    if far_k is not None:
        slot = window_slot(position, window, 0)
        keep = real.view(-1, 1, 1, 1)
        new["ring_far_k"] = write_at_rows(state["ring_far_k"], slot,
                                          torch.where(keep, far_k, _row_at(state["ring_far_k"], slot)),
                                          state["ring_far_k"].shape[2])
    return new


def ring_visible(state, position, window: int, sinks: int):
    """(keys, values [B, kv_heads, S + W, d], allowed [B, S + W]) that a token at `position` [B] attends to: the
    sinks outside its window, and the window's slots that hold a token (the token's own is slot S + position mod W,
    `window_slot`). The buffers themselves: no copy."""
    pos = state["ring_pos"]
    sink_allowed = (pos[:, :sinks] >= 0) & outside_window(position[:, None], pos[:, :sinks], window)
    allowed = torch.cat([sink_allowed, pos[:, sinks:] >= 0], dim=1)
    allowed[:, -1] |= ~allowed.any(-1)  # a padded token in an empty row: finite, never read
    return state["ring_k"], state["ring_v"], allowed


class WindowStateLayer(RecurrentStateLayer):
    """Decoding state of the "window" attention: the ring above, nothing else."""

    def __init__(self, window: int, sinks: int):
        super().__init__()
        self.window_size, self.sinks = window, sinks

    def start(self, k, v, n_real) -> None:
        self.store(k.shape[2], **ring_start(k, v, n_real, self.window_size, self.sinks))

    def append(self, k, v, real) -> None:
        self.store(1, **ring_append(self.state, k, v, real, self.window_size, self.sinks))

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


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv_heads, ...] -> [B, heads, ...]: query head h reads key/value head h // (heads / kv_heads)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


class NearPart:
    """The exact near part of every windowed layer, once: each query's window (the last W real tokens, itself
    included; bidirectionally the W - 1 on each side) and the first S real tokens outside it (the sinks), in the
    three forms (`parallel`, `step` over the decoding ring, `reference`), each merging a far part's (numerator,
    denominator, log scale) under the one normalisation (`attnzoo.ops.window_attention.merge_far`).

    The layer projects, rotates and chooses the scoring: `scale` multiplies q·k; with `penalises_own_key` (LSH's
    shared QK, whose keys are the normalised queries) a query's own key gets a large finite penalty, so it is used
    only when nothing else is. Keys and values come with their key/value heads; the near part repeats them per
    query head where it must."""

    def __init__(self, window: int, sinks: int, causal: bool, scale: float, penalises_own_key: bool = False,
                 dropout: float = 0.0):
        self.window, self.sinks, self.causal, self.scale = window, sinks, causal, scale
        self.penalises_own_key, self.dropout = penalises_own_key, dropout

    def own_score(self, dtype: torch.dtype) -> float | None:
        return mask_values(dtype)[1] if self.penalises_own_key else None

    def parallel(self, q, k, v, n_real, sink_q=None, far=None, training: bool = False):
        """Left-aligned q [B, H, L, d], k, v [B, kv_heads, L, .] with `n_real` [B] real tokens: [B, H, L, e] (the
        blocked or fused op of `attnzoo.ops.window_attention`), merged with `far` when given."""
        out, lse = window_attention(q, k, v, self.window, self.sinks, self.scale, n_real=n_real, causal=self.causal,
                                    sink_q=sink_q, own_score=self.own_score(q.dtype), dropout=self.dropout,
                                    training=training)
        return out if far is None else merge_far(out, lse, *far)

    def step(self, q, keys, values, allowed, sink_q=None, far=None, own=None):
        """One query per row, q [B, H, 1, d], over the ring's keys and values [B, kv_heads, S + W, .] (sinks first;
        `ring_visible`) where `allowed` [B, S + W]: [B, H, 1, e], merged with `far`. `own` [B]: the slot of each
        token's own key (`window_slot`), which `penalises_own_key` scores apart."""
        batch, heads = q.shape[:2]

        def grouped(x, kv_heads):  # [B, H, 1, n] -> [B, kv_heads, H / kv_heads, n]: a head's query heads as rows
            return None if x is None else x.reshape(batch, kv_heads, heads // kv_heads, x.shape[-1])

        # the query heads of a key (value) head read its ring as one matrix product: no copy of the ring per query
        # head (on SmolLM2's shapes at 16K tokens, repeat_kv's copies were a ninth of an lsh_window decoding step).
        # Keys and values may differ in heads (shared QK's keys have a head per query head).
        scores = ring_scores(grouped(q, keys.shape[1]), grouped(sink_q, keys.shape[1]), keys, self.sinks)
        scores = scores.reshape(batch, heads, 1, -1) * self.scale
        masked_value, own_value = mask_values(scores.dtype)
        scores = scores.masked_fill(~allowed[:, None, None, :], masked_value)
        if self.penalises_own_key:
            scores = scores.scatter(-1, own.view(-1, 1, 1, 1).expand(batch, heads, 1, 1), own_value)
        out = (grouped(scores.softmax(-1), values.shape[1]) @ values).reshape(batch, heads, 1, values.shape[-1])
        return out if far is None else merge_far(out, scores.logsumexp(-1), *far)

    def reference(self, q, k, v, valid, sink_q=None, far=None):
        """Dense [L, L] masks over the tokens in their own order (`valid` [B, L]), positions counted in real tokens;
        a padded query sees its own key: [B, H, L, e], merged with `far` when given."""
        heads, length = q.shape[1], q.shape[2]
        k, v = repeat_kv(k, heads), repeat_kv(v, heads)
        if self.causal:
            near, _ = dense_near_and_far(valid, self.window, self.sinks)
        else:  # bidirectional: |pos_i - pos_j| < W, and the first S real tokens
            pos = valid.long().cumsum(-1) - 1
            gap = pos[:, :, None] - pos[:, None, :]
            near = ((gap.abs() < self.window) | (pos[:, None, :] < self.sinks)) & valid[:, None, :]
        own = torch.eye(length, dtype=torch.bool, device=q.device)
        near = near | (own[None] & ~valid[:, :, None])
        scores = dense_sink_scores((q @ k.transpose(-1, -2)) * self.scale, sink_q, k, valid, self.window,
                                   self.sinks, self.scale)
        if self.penalises_own_key:
            scores = scores.masked_fill(own, mask_values(scores.dtype)[1])
        scores = scores.masked_fill(~near[:, None], float("-inf"))
        out = scores.softmax(-1) @ v
        return out if far is None else merge_far(out, scores.logsumexp(-1), *far)
