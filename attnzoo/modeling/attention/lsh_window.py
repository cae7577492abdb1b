"""LSH attention as the far part of a windowed layer ("lsh_window"): each query attends exactly to its window and
sinks (`window_size`, `num_sink_tokens`, as the "window" attention), and through Reformer's LSH attention to the
earlier keys outside them that share its hash buckets, with ONE softmax normalisation over both parts
(`windowed.WindowedAttention`).

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

The parallel form runs on rows whose real tokens the layer has moved to the front (so sequence index = real
position; padding hashes to the extra bucket that sorts last, so no real token changes its sorted slot): LSH's
chunked `lsh_attention` (`lsh.LSHBuckets`, the "lsh" attention's) with a `FarKeyMask` (on the PyTorch path of
`chunked_attention`: the fused kernels do not read that mask), beside the blocked window scores of the near part:
O(L · (rounds · (chunks_before + 1) · chunk_length + 2W + S)) time and memory. `lsh_full_attention_threshold` is not
read: the exact window is this layer's full attention for nearby keys. Causal decoders only. Decoding keeps, beside
the window's ring, every real token's key and value at its position, the rotations, and each bucket's K most recent
positions: a new token costs O((S + W + rounds · K) · head_dim). With the "bucket" setting it equals the full
forward (docs/lsh_attention.md, §5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnzoo.modeling.attention.chunked_attention import ChunkedAttention, head_projection
from attnzoo.modeling.attention.lsh import LSHBuckets
from attnzoo.modeling.attention.lsh_hashing import (
    hash_buckets,
    inverse_permutation,
    normalize_keys,
    recent_keys_by_bucket,
    sort_by_bucket,
)
from attnzoo.modeling.attention.window import beyond_window, left_align, restore_order
from attnzoo.modeling.attention.windowed import FarPart, normalised_far, register_far_part
from attnzoo.modeling.cache import write_at_rows
from attnzoo.ops.chunked_attention import ChunkMask, pad_to_multiple


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


def gather_grouped(store: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """store [B, kv_heads, N, d] read at index [B, H, n] for each query head (head h reads key/value head
    h // (H / kv_heads)) -> [B, H, n, d], without repeating the store."""
    batch, kv_heads, length, dim = store.shape
    heads = index.shape[1]
    group = torch.arange(heads, device=index.device)[None, :, None] // (heads // kv_heads)
    flat = (group * length + index).reshape(batch, -1, 1).expand(-1, -1, dim)
    return store.reshape(batch, kv_heads * length, dim).gather(1, flat).view(batch, heads, -1, dim)


@register_far_part("lsh")
class LSHFarPart(LSHBuckets, FarPart):
    """LSH's bucket attention beyond the window; see the module docstring. Scores are LSH's (shared QK, keys
    normalised, no scaling, a query's own key penalised), so the near part scores the same way."""

    family_config = "ZooReformerSettings"
    plain_kind = "lsh"
    projection_names = ChunkedAttention.projection_names
    head_size_field = "reformer_head_size"
    penalises_own_key = True
    causal = True
    # FarKeyMask adds a condition that only the PyTorch path reads.
    chunk_backend = "torch"

    def __init__(self, layer, config):
        super().__init__(layer, config)
        self.chunk_length, self.chunks_before, self.chunks_after = config.lsh_chunk_length, \
            config.lsh_num_chunks_before, 0
        self.dropout = config.lsh_attention_probs_dropout_prob
        self.read_lsh_settings(config)

    @property
    def dropout_rate(self) -> float:
        return self.dropout if self.training else 0.0

    # -- projections and the near part's scores ---------------------------------------------------------------------
    def build_projections(self) -> None:
        # Shared QK has one head per query head; grouped-query models group the values only.
        layer = self.layer
        layer.query_key, layer.value = head_projection(layer), head_projection(layer, key_value=True)
        layer.output = head_projection(layer, into_heads=False)

    def project(self, hidden_states, position_ids=None, past: int = 0):
        """(qk, qk, v): the shared query-key vectors (rotated in rotary models, before hashing) as both queries and
        keys, and the values with their key/value heads, in the model's dtype."""
        layer = self.layer
        qk = layer.split_heads(layer.query_key(hidden_states))
        qk = layer.rotate(qk, layer.rotation(position_ids, past, qk.shape[2], qk.device, qk.dtype))
        return qk, qk, layer.split_heads(layer.value(hidden_states))

    def output(self, x):
        return self.layer.output(x)

    def near_keys(self, k):
        return normalize_keys(k)  # one head per query head already

    @property
    def scale(self) -> float:
        return 1.0

    @property
    def near_dropout(self) -> float:
        return self.dropout_rate

    # -- the parallel form ------------------------------------------------------------------------------------------
    def window_mask(self, **fields) -> FarKeyMask:
        # A query's own key is always in its window, so the far part has no self penalty: a query without far keys
        # gets the floor log-sum-exp there and no weight.
        fields["self_penalty"] = False
        return FarKeyMask(**fields, window_size=self.layer.window_size, sinks=self.layer.sinks)

    def _buckets(self, qk, valid, recompute):
        """[B, H, R, L] buckets of this forward: hashed with new rotations (and saved for a reversible stack's
        recomputation, which reuses them), or the saved ones when replaying; (buckets, rotations or None)."""
        factors = self.bucket_factors()
        if recompute is not None and recompute.replaying:
            buckets = recompute.saved["buckets"]
            if self.rotation_seed() is None:  # advance the global RNG as the first call did (dropout repeats)
                self.draw_rotations(qk.shape[0], buckets.shape[2], factors, qk.device)
            return buckets, None
        rotations = self.draw_rotations(qk.shape[0], self.num_hashes, factors, qk.device)
        buckets = self.hash_vectors(qk, rotations, factors, valid)
        if recompute is not None:
            recompute.saved["buckets"] = buckets
        return buckets, rotations

    def parallel(self, q, k, v, n_real, recompute=None, state=None):
        length = q.shape[2]
        num_buckets = math.prod(self.bucket_factors())
        valid = torch.arange(length, device=q.device)[None, :] < n_real[:, None]
        buckets, rotations = self._buckets(q, valid, recompute)  # padding in the extra bucket, which sorts last
        if state is not None:
            state.state.update(lsh_keys=q, lsh_values=v, lsh_rotations=rotations,
                               lsh_recent=recent_keys_by_bucket(buckets, num_buckets, self.recent_size))
        m = self.chunk_length
        buckets = pad_to_multiple(buckets, m, dim=3, value=num_buckets)
        # On a recomputation the backward follows at once: keeping the probabilities costs no peak memory.
        replaying = recompute is not None and recompute.replaying
        out, lse = self.lsh_attention(pad_to_multiple(q, m, dim=2), pad_to_multiple(self.layer.expand_kv(v), m, dim=2),
                                      buckets, sort_by_bucket(buckets), num_buckets, save_probs=replaying,
                                      return_lse=True)
        return out[:, :, :length], torch.ones_like(lse[:, :, :length]), lse[:, :, :length]

    # -- decoding ---------------------------------------------------------------------------------------------------
    def step(self, state, q, k, v, real, position, leaving):
        """One new token per row: hash it with the prefill's rotations, join its buckets' recent lists (as LSH
        does), store its key and value at its position, and attend to the recent keys of its buckets that are far
        from it, a key listed in several rounds counted once with the duplicate correction (Appendix A)."""
        stored = state.state
        batch, heads, _, dim = q.shape
        factors = self.bucket_factors()
        buckets = hash_buckets(q, stored["lsh_rotations"], factors)  # [B, H, R, 1]
        buckets = buckets.masked_fill(~real[:, None, None, None], math.prod(factors))
        rounds, keep = buckets.shape[2], self.recent_size
        rows = buckets[..., None].expand(batch, heads, rounds, 1, keep)
        previous = stored["lsh_recent"].gather(3, rows)  # [B, H, R, 1, K], before this token joins
        joined = torch.cat([previous[..., 1:], position.view(batch, 1, 1, 1, 1).expand(-1, heads, rounds, 1, 1)], -1)
        stored["lsh_recent"] = stored["lsh_recent"].scatter(3, rows, joined)
        needed = state.get_seq_length() + 1  # positions never exceed the tokens seen
        stored["lsh_keys"] = write_at_rows(stored["lsh_keys"], position, q, needed)
        stored["lsh_values"] = write_at_rows(stored["lsh_values"], position, v, needed)
        index = previous[:, :, :, 0].reshape(batch, heads, rounds * keep)  # positions; -1: none
        far = (index >= 0) & beyond_window(position[:, None, None], index, self.layer.window_size, self.layer.sinks)
        index = torch.where(far, index, -1)
        safe = index.clamp(min=0)
        keys = stored["lsh_keys"].gather(2, safe[..., None].expand(-1, -1, -1, dim))
        logits = q @ normalize_keys(keys).transpose(-1, -2)  # [B, H, 1, R*K]
        if self.duplicate_correction:
            counts = (index[..., :, None] == index[..., None, :]).sum(-1)
            logits = logits - counts.to(logits.dtype).log()[:, :, None]
        return normalised_far(logits.masked_fill(~far[:, :, None], float("-inf")),
                              gather_grouped(stored["lsh_values"], safe))

    # -- reference --------------------------------------------------------------------------------------------------
    def reference(self, q, k, v, valid, far, recompute=None):
        """Dense [L, L] form in the tokens' own order: per round, key j is a candidate of query i when LSH's window
        lists it (same bucket within K sorted slots before, or within the neighbouring chunks); the far keys listed
        in c_ij rounds get the logit s_ij + log(c_ij) (the rounds' log-sum-exp combination), or s_ij with the
        duplicate correction. Rotations are drawn as `parallel` draws them, or the buckets come from a replaying
        `recompute` (saved in left-aligned order)."""
        if recompute is not None and recompute.replaying:
            buckets = restore_order(recompute.saved["buckets"].transpose(2, 3), left_align(valid)).transpose(2, 3)
        else:
            buckets, _ = self._buckets(q, valid, None)
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
        listed = far[:, None] & (rounds_listing > 0)
        logits = q @ normalize_keys(q).transpose(-1, -2) + rounds_listing.to(q.dtype).log()
        return normalised_far(logits.masked_fill(~listed, float("-inf")), self.layer.expand_kv(v))
