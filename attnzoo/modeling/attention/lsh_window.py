"""LSH attention with an exact window inside every layer ("lsh_window"): each query attends exactly to its window
and sinks (`window_size`, `num_sink_tokens`, as the "window" attention), and through Reformer's LSH attention to the
earlier keys outside them that share its hash buckets, with ONE softmax normalisation over both parts.

Scores are LSH's (shared QK, "Reformer: The Efficient Transformer", arXiv 2001.04451, §2): s_ij = q_i · k_j with
k_j = q_j / |q_j| and no further scaling, and a query's own key gets the large finite penalty s_ii = -1e5, so it is
used only when nothing else is. With positions counted in real tokens,

    near(i) = {j <= i : pos_i - pos_j < W or pos_j < S}               (window and sinks, always exact)
    far(i)  = {j : S <= pos_j <= pos_i - W, j a candidate of i in some hash round}
    out_i   = (Σ_{near} e^{s_ij} v_j + Σ_{far} e^{s_ij} v_j) / (Σ_{near} e^{s_ij} + Σ_{far} e^{s_ij}).

The far part is LSH's multi-round bucket attention (candidates as the `lsh_attend_to` setting "bucket"/"chunk" defines
them, rounds combined through their log-sum-exps with the duplicate correction, Appendix A) with every key of near(i)
removed, so a key in both the window and the query's bucket is counted once, in the window. It yields out_far and its
log-sum-exp lse_far; the near part is an exact softmax with lse_near, and the two combine as
out = softmax([lse_near, lse_far]) · [out_near, out_far]: the window's scores and a far part of mass exp(lse_far)
and value out_far under the one normalisation every windowed layer shares (`window.combine`). This is content-addressed
retrieval of exact tokens from anywhere in the context
(the passkey retrieval task of "Landmark Attention", arXiv 2305.16300) beside an exact local window with attention
sinks ("Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453, §3.2). With the "bucket" setting
a far key is found when, in some round, it is among the K = lsh_num_chunks_before · lsh_chunk_length most recent keys
of the query's bucket: recall reaches back K bucket-mates (window keys among them included), not K tokens.

The parallel form moves each row's real tokens to the front (so sequence index = real position; padding hashes to the
extra bucket that sorts last, so no real token changes its sorted slot), runs LSH's chunked `lsh_attention` with a
`FarKeyMask` (on the PyTorch path of `chunked_attention`: the fused kernels do not read that mask), and the blocked
window scores of the "window" attention: O(L · (rounds · (chunks_before + 1) · chunk_length + 2W + S)) time and
memory. `lsh_full_attention_threshold` is not read: the exact window is this layer's full attention for nearby keys.
Causal decoders only. Decoding keeps LSH's own cache (every token's key, value and buckets, each bucket's K recent
keys): a new token reads the sinks and the last W tokens from the stored tokens, adding no store of its own, and
costs O((S + W + rounds · K) · head_dim). With the "bucket" setting it equals the full forward
(docs/lsh_attention.md, §5), for rows whose real tokens are contiguous after their left padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnzoo.modeling.attention.base import check_attention_mask, register_attention
from attnzoo.modeling.attention.lsh import LSHAttention
from attnzoo.modeling.attention.lsh_hashing import (
    inverse_permutation,
    normalize_keys,
    recent_keys_by_bucket,
    sort_by_bucket,
)
from attnzoo.modeling.attention.window import (
    WindowInsideLayer,
    beyond_window,
    combine,
    dense_near_and_far,
    gather_tokens,
    left_align,
    outside_window,
    restore_order,
    window_scores,
)
from attnzoo.modeling.cache import TokenBufferLayer
from attnzoo.ops.chunked_attention import ChunkMask, mask_values, pad_to_multiple


@dataclass
class FarKeyMask(ChunkMask):
    """LSH's `ChunkMask` minus every key of the query's exact window and sinks: a key at position p is allowed to
    the query at position i only when `sinks` <= p <= i - `window_size`. `positions` must count real tokens (rows
    left-aligned). Only the PyTorch path of `chunked_attention` reads the extra condition (`disallowed`)."""

    window_size: int = 1
    sinks: int = 0

    def disallowed(self) -> torch.Tensor:
        key_positions = self.neighbours(self.positions, -1).unsqueeze(-2)  # [N, C, 1, W]; -1 past the ends
        far = beyond_window(self.positions.unsqueeze(-1), key_positions, self.window_size, self.sinks)
        return super().disallowed() | ~far


@register_attention("lsh_window")
class WindowedLSHAttention(WindowInsideLayer, LSHAttention):
    """Exact window and sinks plus LSH beyond them, one softmax normalisation; see the module docstring."""

    # FarKeyMask adds a condition that only the PyTorch path reads.
    chunk_backend = "torch"

    plain_kind = "lsh"

    def window_mask(self, **fields) -> FarKeyMask:
        # A query's own key is always in its window, so the far part has no self penalty: a query without far keys
        # gets the floor log-sum-exp there and no weight.
        fields["self_penalty"] = False
        return FarKeyMask(**fields, window_size=self.window_size, sinks=self.sinks)

    # -- the parallel form ----------------------------------------------------------------------------------
    def _attend(self, qk, v, key_mask, recompute, cache):
        """Attention over a whole sequence (no cached prefix); fills `cache` (prefill) when given."""
        batch, _, length, _ = qk.shape
        valid = self.all_real(key_mask, batch, length, qk.device)
        factors = self.bucket_factors()
        num_buckets = math.prod(factors)
        replaying = recompute is not None and recompute.replaying
        if replaying:  # the backward's recomputation reuses the forward's buckets
            buckets = recompute.saved["buckets"]
            if self.rotation_seed() is None:  # advance the global RNG as the first call did (dropout repeats)
                self.draw_rotations(batch, buckets.shape[2], factors, qk.device)
        else:
            rotations = self.draw_rotations(batch, self.num_hashes, factors, qk.device)
            buckets = self.hash_vectors(qk, rotations, factors, valid)  # [B, H, R, L], in sequence order
            if recompute is not None:
                recompute.saved["buckets"] = buckets
            if cache is not None:  # LSH's own decoding cache; the window part reads it too
                cache.start({"keys": (qk, 2), "values": (v, 2), "buckets": (buckets, 3), "valid": (valid, 1)},
                            rotations=rotations, recent=recent_keys_by_bucket(buckets, num_buckets, self.recent_size),
                            lead=(valid.long().cumsum(-1) == 0).sum(-1))
        # Real tokens first, so that a token's index is its real position (what FarKeyMask and the window compare).
        # Padding is hashed to the extra bucket, which sorts last: every real token keeps its sorted slot.
        order = left_align(valid)
        qk_aligned, v_aligned = gather_tokens(qk, order), gather_tokens(v, order)
        buckets_aligned = buckets.gather(3, order[:, None, None, :].expand_as(buckets))
        m = self.chunk_length
        buckets_padded = pad_to_multiple(buckets_aligned, m, dim=3, value=num_buckets)
        # On a recomputation the backward follows at once: keeping the probabilities costs no peak memory.
        far_out, far_lse = self.lsh_attention(
            pad_to_multiple(qk_aligned, m, dim=2), pad_to_multiple(v_aligned, m, dim=2), buckets_padded,
            sort_by_bucket(buckets_padded), num_buckets, save_probs=replaying, return_lse=True)
        out = self._with_window(qk_aligned, v_aligned, valid.sum(-1), far_out[:, :, :length], far_lse[:, :, :length])
        return restore_order(out, order)

    def _with_window(self, qk, v, n_real, far_out, far_lse):
        """The one normalisation (`window.combine`) over the window's scores (left-aligned rows) and the far part: its
        output out_far with mass exp(lse_far)."""
        batch, heads, length, dim = qk.shape
        w = self.window_size
        scores, values = window_scores(qk, normalize_keys(qk), v, n_real, w, self.sinks, True, 1.0)  # [B,H,C,w,K]
        blocks, num_keys = scores.shape[2], scores.shape[-1]
        # The own key of block row i is window column w + i, after the min(S, blocks * w) sink columns.
        own_column = min(self.sinks, blocks * w) + w + torch.arange(w, device=qk.device)
        own = torch.arange(num_keys, device=qk.device)[None, :] == own_column[:, None]  # [w, K]
        scores = scores.masked_fill(own, mask_values(scores.dtype)[1])
        far_out = pad_to_multiple(far_out, w, dim=2).view(batch, heads, blocks, w, dim)
        far_lse = pad_to_multiple(far_lse, w, dim=2).view(batch, heads, blocks, w)
        out = combine(scores, values, far_out, torch.ones_like(far_lse), far_lse, self.dropout_rate, self.training)
        return out.reshape(batch, heads, blocks * w, dim)[:, :, :length]

    # -- decoding -------------------------------------------------------------------------------------------
    def _decode_one(self, qk, v, valid, cache: TokenBufferLayer) -> torch.Tensor:
        """One new token (cache index t, real position t - lead): join its buckets' recent lists as LSH does, then
        one softmax over its sinks and last W tokens (read from the stored tokens) and over the recent keys of its
        buckets that lie outside them, a key listed in several rounds counted once (Appendix A)."""
        batch, heads, _, dim = qk.shape
        t = cache.get_seq_length()
        far_index = self.join_bucket_lists(qk, v, valid, cache)[..., :-1].reshape(batch, heads, -1)  # [B, H, R*K]
        lead = cache.sequence["lead"]
        position = t - lead  # [B]
        w, s = self.window_size, self.sinks
        sink_positions = torch.arange(s, device=qk.device)[None].expand(batch, s)
        window_positions = position[:, None] - w + 1 + torch.arange(w, device=qk.device)  # ends with the token
        near_positions = torch.cat([sink_positions, window_positions], dim=1)  # [B, S + W]
        near_allowed = torch.cat([outside_window(position[:, None], sink_positions, w), window_positions >= 0], dim=1)
        near_index = torch.where(near_allowed, near_positions + lead[:, None], -1)
        far_positions = far_index - lead[:, None, None]
        far_allowed = (far_index >= 0) & beyond_window(position[:, None, None], far_positions, w, s)
        far_index = torch.where(far_allowed, far_index, -1)
        index = torch.cat([near_index[:, None].expand(batch, heads, -1), far_index], -1)  # [B, H, S + W + R*K]
        safe = index.clamp(min=0)
        present = (index >= 0) & cache.tokens("valid").gather(1, safe.flatten(1)).view_as(safe)
        gather = safe[..., None].expand(-1, -1, -1, dim)
        keys, values = cache.tokens("keys").gather(2, gather), cache.tokens("values").gather(2, gather)
        scores = (qk @ normalize_keys(keys).transpose(-1, -2)).squeeze(2)
        if self.duplicate_correction:  # near and far keys are disjoint; a far key may be listed in several rounds
            counts = (far_index[..., :, None] == far_index[..., None, :]).sum(-1)
            scores = torch.cat([scores[..., :s + w], scores[..., s + w:] - counts.to(scores.dtype).log()], -1)
        masked_value, self_value = mask_values(scores.dtype)
        scores = scores.masked_fill(~present, masked_value).masked_fill(index == t, self_value)
        return torch.softmax(scores, dim=-1).unsqueeze(2) @ values

    # -- reference ------------------------------------------------------------------------------------------
    def reference_forward(self, hidden_states, attention_mask=None, cache=None, recompute=None, position_ids=None):
        """Dense [L, L] form in sequence order: per round, key j is a candidate of query i when LSH's window lists it
        (same bucket within K sorted slots before, or within the neighbouring chunks); the far keys listed in c_ij
        rounds get the logit s_ij + log(c_ij) (the rounds' log-sum-exp combination), or s_ij with the duplicate
        correction; window and sinks get s_ij, the own key the penalty; one softmax. Rotations are drawn as
        `forward` draws them, or the buckets come from a replaying `recompute`."""
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        qk, v = self._project(hidden_states, position_ids)
        valid = self.all_real(key_mask, batch, length, qk.device)
        factors = self.bucket_factors()
        if recompute is not None and recompute.replaying:
            buckets = recompute.saved["buckets"]
        else:
            rotations = self.draw_rotations(batch, self.num_hashes, factors, qk.device)
            buckets = self.hash_vectors(qk, rotations, factors, valid)
        slots = inverse_permutation(sort_by_bucket(buckets))  # [B, H, R, L]
        m, before = self.chunk_length, self.chunks_before
        if self.attend_to == "chunk":
            chunk_gap = slots[..., None, :] // m - slots[..., :, None] // m
            candidate = (chunk_gap >= -before) & (chunk_gap <= 0)
        else:
            slot_gap = slots[..., None, :] - slots[..., :, None]
            candidate = (buckets[..., None, :] == buckets[..., :, None]) & (slot_gap >= -before * m) & (slot_gap <= 0)
        rounds_listing = candidate.sum(dim=2)  # [B, H, L, L]
        if self.duplicate_correction:
            rounds_listing = rounds_listing.clamp(max=1)
        near, beyond = dense_near_and_far(valid, self.window_size, self.sinks)  # [B, L, L]
        far = beyond[:, None] & (rounds_listing > 0)
        scores = qk @ normalize_keys(qk).transpose(-1, -2)
        logits = torch.where(far, scores + rounds_listing.to(scores.dtype).log(), float("-inf"))
        logits = torch.where(near[:, None], scores, logits)
        logits = logits.masked_fill(torch.eye(length, dtype=torch.bool, device=qk.device), mask_values(qk.dtype)[1])
        return self.output(self.merge_heads(logits.softmax(-1) @ v))
