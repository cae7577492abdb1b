"""Local (chunked) attention, the Reformer's cheap layers (trax `SelfAttention(chunk_len=...)`, transformers'
`LocalSelfAttention`): separate query, key and value projections, and each chunk of `local_chunk_length` positions
attends to itself and `local_num_chunks_before` chunks back (and, in bidirectional layers, `local_num_chunks_after`
chunks ahead), scaled by 1/sqrt(head_dim). Causal layers mask later positions; padded keys are never attended.

The chunk grid starts at each sequence's first real token, so a left-padded sequence is chunked exactly as it would be
alone (the module shifts each row so it starts at index 0, attends, and shifts back). Lengths that are not a
multiple of the chunk length are padded inside the module; a sequence no longer than one chunk is one chunk.

Decoding (`LocalCacheLayer`) keeps only the last (chunks_before + 1) * chunk_length keys and values of each sequence in
a ring buffer: a new token at chunk position p attends to the cached keys from the start of chunk p // m -
chunks_before up to itself, which is exactly what the chunked forward computes for it, at a cost per token that does
not depend on the context length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.configuration.base import check_int, check_probability
from attnzoo.modeling.attention.base import ZooAttention, check_attention_mask, register_attention
from attnzoo.modeling.attention.chunked import WindowMask, mask_values, pad_to_multiple, windowed_attention
from attnzoo.modeling.cache import SelfManagedCacheLayer


def leading_padding(key_mask: torch.Tensor) -> torch.Tensor:
    """[B] number of padded positions before each row's first real token."""
    return (key_mask.long().cumsum(-1) == 0).sum(-1)


@register_attention("local")
class LocalAttention(ZooAttention):
    """Chunked attention with look-back (and look-ahead for bidirectional layers); see the module docstring."""

    required_config_fields = ("local_chunk_length", "local_num_chunks_before", "local_num_chunks_after",
                              "local_attention_probs_dropout_prob", "reformer_head_size")
    family_config = "ZooReformerConfig"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.head_dim = config.reformer_head_size
        inner = self.num_heads * self.head_dim
        bias = config.attention_bias
        self.query = nn.Linear(self.hidden_size, inner, bias=bias)
        self.key = nn.Linear(self.hidden_size, inner, bias=bias)
        self.value = nn.Linear(self.hidden_size, inner, bias=bias)
        self.output = nn.Linear(inner, self.hidden_size, bias=bias)
        self.chunk_length = config.local_chunk_length
        self.chunks_before = config.local_num_chunks_before
        self.chunks_after = 0 if causal else config.local_num_chunks_after
        self.scale = 1.0 / math.sqrt(self.head_dim)
        rate = config.local_attention_probs_dropout_prob
        self.dropout = config.attention_probs_dropout_prob if rate is None else rate

    @classmethod
    def check_config(cls, config) -> None:
        check_int(config, "local_chunk_length", 1, "set a positive integer.")
        for name in ("local_num_chunks_before", "local_num_chunks_after"):
            check_int(config, name, 0, "set a non-negative integer (0 = no neighbouring chunks).")
        check_probability(config, "local_attention_probs_dropout_prob", optional=True)

    def _project(self, hidden_states):
        return (self.split_heads(self.query(hidden_states)), self.split_heads(self.key(hidden_states)),
                self.split_heads(self.value(hidden_states)))

    @property
    def dropout_rate(self) -> float:
        return self.dropout if self.training else 0.0

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, replay=None, grid_size=None):
        batch, length, _ = hidden_states.shape
        cache = past_key_values.layers[self.layer_idx] if past_key_values is not None else None
        past = cache.get_seq_length() if cache is not None else 0
        key_mask = check_attention_mask(attention_mask, batch, past + length)
        q, k, v = self._project(hidden_states)
        if past > 0:
            out = cache.decode(self, q, k, v, key_mask)
        else:
            # Inside a reversible recomputation (`replay` given) the backward follows at once: keep the probabilities.
            out = self._attend(q, k, v, key_mask, save_probs=replay is not None)
            if cache is not None:
                cache.prefill(self, k, v, key_mask)
        return self.output(self.merge_heads(out))

    def _attend(self, q, k, v, key_mask, save_probs=False):
        batch, heads, length, dim = q.shape
        valid = key_mask
        shift = None
        if key_mask is not None:
            # Rotate each row so its first real token sits at index 0 (its leading padding moves to the end).
            lead = leading_padding(key_mask)
            positions = torch.arange(length, device=q.device)
            shift = (positions + lead[:, None]) % length  # [B, L]: rotated index -> original index
            index = shift[:, None, :, None].expand(batch, heads, length, dim)
            q, k, v = q.gather(2, index), k.gather(2, index), v.gather(2, index)
            valid = key_mask.gather(1, shift)
        else:
            valid = torch.ones(batch, length, dtype=torch.bool, device=q.device)
        m, before, after = self.chunk_length, self.chunks_before, self.chunks_after
        if length <= m:  # one chunk holds everything
            m, before, after = length, 0, 0
        q, k, v = (pad_to_multiple(x, m, dim=2) for x in (q, k, v))
        valid = pad_to_multiple(valid, m, dim=1, value=False)
        padded = q.shape[2]
        chunks = padded // m
        mask = WindowMask(positions=torch.arange(padded, device=q.device).view(1, chunks, m).expand(
                              batch * heads, chunks, m),
                          valid=valid.repeat_interleave(heads, dim=0).view(batch * heads, chunks, m),
                          before=before, after=after, causal=self.causal)
        out, _ = windowed_attention(*(x.reshape(batch * heads, chunks, m, dim) for x in (q, k, v)), mask,
                                    self.scale, self.dropout_rate, save_probs)
        out = out.view(batch, heads, padded, dim)[:, :, :length]
        if shift is not None:
            unshift = shift.argsort(dim=-1)
            out = out.gather(2, unshift[:, None, :, None].expand(batch, heads, length, dim))
        return out

    def reference_forward(self, hidden_states, attention_mask=None, past_key_values=None, replay=None,
                          grid_size=None):
        """Dense [L, L] masks: key j is allowed to query i when its chunk (counted from the row's first real
        token) is at most `before` chunks back / `after` ahead of i's, j is real, and (causal) j <= i."""
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        q, k, v = self._project(hidden_states)
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool, device=q.device)
        lead = leading_padding(valid)
        chunk = torch.div(torch.arange(length, device=q.device) - lead[:, None], self.chunk_length,
                          rounding_mode="floor")  # [B, L]
        gap = chunk[:, None, :] - chunk[:, :, None]
        allowed = (gap >= -self.chunks_before) & (gap <= self.chunks_after) & valid[:, None, :]
        if self.causal:
            positions = torch.arange(length, device=q.device)
            allowed = allowed & (positions[None, :] <= positions[:, None])
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~allowed[:, None], mask_values(scores.dtype)[0])
        return self.output(self.merge_heads(scores.softmax(-1) @ v))

    def new_cache_layer(self):
        return LocalCacheLayer()


class LocalCacheLayer(SelfManagedCacheLayer):
    """Ring buffers of the last (chunks_before + 1) * chunk_length keys and values of each sequence; a token at chunk
    position p (its index minus the row's leading padding) lives in slot p mod size."""

    is_croppable = False

    def _store(self, keys, values, chunk_positions, keep) -> None:
        """Write tokens whose `keep` is True into slot chunk_position mod size (later tokens win)."""
        batch, heads, _, dim = keys.shape
        size = self.size
        slot = torch.where(keep, chunk_positions % size, size)  # slot `size`: dropped
        index = slot[:, None, :, None].expand(batch, heads, -1, dim)
        ring_k = torch.cat([self.keys, self.keys.new_zeros(batch, heads, 1, dim)], dim=2)
        ring_v = torch.cat([self.values, self.values.new_zeros(batch, heads, 1, dim)], dim=2)
        ring_pos = torch.cat([self.positions, self.positions.new_full((batch, 1), -1)], dim=1)
        self.keys = ring_k.scatter_(2, index, keys.detach())[:, :, :size]
        self.values = ring_v.scatter_(2, index, values.detach())[:, :, :size]
        self.positions = ring_pos.scatter_(1, slot, torch.where(keep, chunk_positions, -1))[:, :size]

    def prefill(self, attn: LocalAttention, keys, values, key_mask) -> None:
        batch, heads, length, dim = keys.shape
        self.lazy_initialization(keys, values)
        self.chunk_length, self.chunks_before = attn.chunk_length, attn.chunks_before
        self.size = (attn.chunks_before + 1) * attn.chunk_length
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool,
                                                                 device=keys.device)
        self.lead = leading_padding(valid)
        chunk_positions = torch.arange(length, device=keys.device) - self.lead[:, None]
        self.keys = keys.new_zeros(batch, heads, self.size, dim)
        self.values = values.new_zeros(batch, heads, self.size, dim)
        self.positions = torch.full((batch, self.size), -1, dtype=torch.long, device=keys.device)
        # Only the last `size` positions can be seen by later tokens; distinct slots, so scatter order is moot.
        keep = valid & (chunk_positions >= 0) & (chunk_positions >= (length - self.lead - self.size)[:, None])
        self._store(keys, values, chunk_positions, keep)
        self.length = length

    def decode(self, attn: LocalAttention, q, k, v, key_mask) -> torch.Tensor:
        batch, heads, count, dim = q.shape
        new_mask = key_mask[:, self.length:] if key_mask is not None else torch.ones(
            batch, count, dtype=torch.bool, device=q.device)
        query_positions = self.length + torch.arange(count, device=q.device) - self.lead[:, None]  # [B, n]
        keys = torch.cat([self.keys, k], dim=2)
        values = torch.cat([self.values, v], dim=2)
        key_positions = torch.cat([self.positions, torch.where(new_mask, query_positions, -1)], dim=1)
        window_start = (torch.div(query_positions, attn.chunk_length, rounding_mode="floor")
                        - attn.chunks_before) * attn.chunk_length
        kp = key_positions[:, None, :]
        allowed = (kp >= 0) & (kp >= window_start[..., None]) & (kp <= query_positions[..., None])
        # A padded new token still sees its own key, so no softmax row is empty (as `allowed_keys` does).
        own = torch.arange(self.size + count, device=q.device)[None, :] == (
            self.size + torch.arange(count, device=q.device))[:, None]
        allowed = allowed | own
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], scale=attn.scale,
                                             dropout_p=attn.dropout_rate)
        last = query_positions[:, -1:]
        self._store(k, v, query_positions, new_mask & (query_positions > last - self.size))
        self.length += count
        return out

    # -- generation utilities ----------------------------------------------------------------------------------
    def _map(self, fn) -> None:
        if self.length == 0:
            return
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.positions, self.lead = fn(self.positions), fn(self.lead)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda x: x[indices])

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ValueError("a local-attention cache keeps only the last chunks, so it cannot be cropped; decode "
                         "without assisted generation (or use a softmax model as the assistant's target).")

    def offload(self):
        self._map(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.length and self.keys.device != self.device:
            self._map(lambda x: x.to(self.device, non_blocking=True))
