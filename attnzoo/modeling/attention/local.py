"""Local (chunked) attention, the Reformer's cheap layers (trax's `SelfAttention(chunk_len=...)`, transformers'
`LocalSelfAttention`): separate query, key and value projections, and each chunk of `local_chunk_length` positions
attends to itself and `local_num_chunks_before` chunks back (and, in bidirectional layers, `local_num_chunks_after`
chunks ahead), scaled by 1/sqrt(head_dim). Causal layers mask later positions; padded keys are never attended.

The chunk grid starts at each sequence's first real token, so a left-padded sequence is chunked exactly as it would be
alone (the module shifts each row so it starts at index 0, attends, and shifts back). Lengths that are not a
multiple of the chunk length are padded inside the module; a sequence no longer than one chunk is one chunk.

Decoding keeps the keys and values of every token (so the cache can be cropped, as assisted decoding needs): a new
token at chunk position p attends to the cached keys from the start of chunk p // m - chunks_before up to itself,
read by index, which is exactly what the chunked forward computes for it, at a cost per token that does not depend
on the context length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnzoo.modeling.attention.base import check_attention_mask, register_attention
from attnzoo.modeling.attention.chunked_attention import ChunkedAttention
from attnzoo.modeling.cache import TokenBufferLayer
from attnzoo.ops.chunked_attention import ChunkMask, chunked_attention, mask_values, pad_to_multiple


def leading_padding(key_mask: torch.Tensor) -> torch.Tensor:
    """[B] number of padded positions before each row's first real token."""
    return (key_mask.long().cumsum(-1) == 0).sum(-1)


@register_attention("local")
class LocalAttention(ChunkedAttention):
    """Chunked attention with look-back (and look-ahead for bidirectional layers); see the module docstring."""

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal, chunk_length=config.local_chunk_length,
                         chunks_before=config.local_num_chunks_before, chunks_after=config.local_num_chunks_after,
                         dropout=config.local_attention_probs_dropout_prob)
        self.query = self.projection()
        self.key, self.value = self.projection(key_value=True), self.projection(key_value=True)
        self.output = self.projection(into_heads=False)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def _project(self, hidden_states, position_ids=None, past: int = 0):
        q, k, v = (self.split_heads(p(hidden_states)) for p in (self.query, self.key, self.value))
        rotation = self.rotation(position_ids, past, q.shape[2], q.device, q.dtype)
        return self.rotate(q, rotation), self.expand_kv(self.rotate(k, rotation)), self.expand_kv(v)

    def forward(self, hidden_states, attention_mask=None, cache=None, recompute=None, position_ids=None):
        slot, past, decoding, key_mask = self.cached_inputs(hidden_states, attention_mask, cache)
        q, k, v = self._project(hidden_states, position_ids, past)
        if decoding:
            out = self._decode(q, k, v, key_mask, slot)
        else:
            # On a reversible recomputation the backward follows at once: keeping the probabilities costs no peak
            # memory and saves recomputing them.
            out = self._attend(q, k, v, key_mask, save_probs=recompute is not None and recompute.replaying)
            if slot is not None:
                valid = self.all_real(key_mask, *hidden_states.shape[:2], q.device)
                slot.start({"keys": (k, 2), "values": (v, 2), "valid": (valid, 1)}, lead=leading_padding(valid))
        return self.output(self.merge_heads(out))

    def _attend(self, q, k, v, key_mask, save_probs=False):
        batch, heads, length, dim = q.shape
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
            valid = self.all_real(None, batch, length, q.device)
        m, before, after = self.chunk_length, self.chunks_before, self.chunks_after
        if length <= m:  # one chunk holds everything
            m, before, after = length, 0, 0
        q, k, v = (pad_to_multiple(x, m, dim=2) for x in (q, k, v))
        valid = pad_to_multiple(valid, m, dim=1, value=False)
        padded = q.shape[2]
        chunks = padded // m
        mask = ChunkMask(positions=torch.arange(padded, device=q.device).view(1, chunks, m).expand(
                              batch * heads, chunks, m),
                          valid=valid.repeat_interleave(heads, dim=0).view(batch * heads, chunks, m),
                          before=before, after=after, causal=self.causal)
        out, _ = chunked_attention(*(x.reshape(batch * heads, chunks, m, dim) for x in (q, k, v)), mask,
                                    self.scale, self.dropout_rate, save_probs)
        out = out.view(batch, heads, padded, dim)[:, :, :length]
        if shift is not None:
            unshift = shift.argsort(dim=-1)
            out = out.gather(2, unshift[:, None, :, None].expand(batch, heads, length, dim))
        return out

    def _decode(self, q, k, v, new_mask, cache: TokenBufferLayer) -> torch.Tensor:
        """New tokens (`new_mask`: their padding mask or None) over a cache: each attends to the keys of the window
        the chunked forward gives its position, read from the cache by index, so a token costs the same whatever the
        context length (a static slot's count stays on the device: indices are clamped to it, not sliced)."""
        batch, heads, count, dim = q.shape
        new_valid = new_mask if new_mask is not None else self.all_real(None, batch, count, q.device)
        cache.append(keys=k, values=v, valid=new_valid)
        index, query_index = self.decode_window(cache, count)
        lead = cache.sequence["lead"][:, None]
        safe = torch.minimum(index, torch.as_tensor(cache.get_seq_length() - 1, device=index.device)).clamp(min=0)
        allowed = (index >= lead[..., None]) & (index <= query_index[..., None])
        allowed &= cache.tokens("valid").gather(1, safe.flatten(1)).view_as(safe)
        allowed |= index == query_index[..., None]  # a padded new token still sees its own key (no empty row)
        gather = safe.flatten(1)[:, None, :, None].expand(batch, heads, -1, dim)
        keys = cache.tokens("keys").gather(2, gather).view(batch, heads, count, -1, dim)
        values = cache.tokens("values").gather(2, gather).view(batch, heads, count, -1, dim)
        scores = torch.einsum("bhnd,bhnwd->bhnw", q, keys) * self.scale
        probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        probs = F.dropout(probs, self.dropout_rate, training=self.training)
        return torch.einsum("bhnw,bhnwd->bhnd", probs, values)

    def decode_window(self, cache: TokenBufferLayer, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache indices [B, n, (chunks_before + 1) * chunk_length] of the window of each of the last `count`
        cached tokens (some out of range or before the row's first real token: masked), and their own indices."""
        device = cache.sequence["lead"].device
        lead = cache.sequence["lead"][:, None]  # [B, 1]
        query_index = cache.get_seq_length() - count + torch.arange(count, device=device)[None, :]  # [1, n]
        m, before = self.chunk_length, self.chunks_before
        start = lead + (torch.div(query_index - lead, m, rounding_mode="floor") - before) * m  # [B, n]
        return start[..., None] + torch.arange((before + 1) * m, device=device), query_index

    def reference_forward(self, hidden_states, attention_mask=None, cache=None, recompute=None, position_ids=None):
        """Dense [L, L] masks: key j is allowed to query i when its chunk (counted from the row's first real
        token) is at most `before` chunks back / `after` ahead of i's, j is real, and (causal) j <= i."""
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        q, k, v = self._project(hidden_states, position_ids)
        valid = self.all_real(key_mask, batch, length, q.device)
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
