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
and value out_far under the one normalisation every windowed layer shares (`merge_far`). This is content-addressed
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
the window's ring, the prefill's keys as a bucket index (each round's positions in (bucket, position) order), the
buckets of the tokens decoded since, and the keys and values that have left the window, each once (no larger than a
KV cache; the evaluation rotations are drawn again from the seed): a new token costs
O((S + W + rounds · K) · head_dim + rounds · t) after t decoded tokens, whatever the prompt's length. With the
"bucket" setting it equals the full forward (docs/lsh_attention.md, §6). With `lsh_shared_qk=False` queries and keys
keep their own projections and are hashed apart, and the far part scores each query's candidates in blocks of the
keys' sorted order (docs/lsh_attention.md, §7; with `lsh_group_rotations` a key-value group's query heads share
rotations, so each key is hashed once per group); with `lsh_centre_keys` each key is hashed minus its head's centre,
a buffer of the layer (scores unchanged; "Centred keys" there), and with `lsh_key_centroids` the buckets are learned:
a key's is its nearest centroid (a buffer of the layer, k-means on a calibration text's centred keys), the same every
round, and a query's in round r is the centroid it scores r-th highest ("Learned buckets" there), or with
`lsh_member_mean_block` the bucket whose far members' mean key it scores r-th highest, the sums frozen once per block
of that many tokens ("Probing by the members' mean" there), or with `lsh_member_score="log_mass"` the bucket whose
members' log mass, that score over √d plus the log of their number, is r-th highest ("Ranking by the members' mass").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import initialization as init

from attnzoo.modeling.attention.chunked_attention import ChunkedAttention
from attnzoo.modeling.attention.lsh import LSHAttention, LSHBuckets, grouped_rows
from attnzoo.modeling.attention.lsh_hashing import (
    hash_buckets,
    inverse_permutation,
    most_recent_in_bucket,
    normalize_keys,
    sort_by_bucket,
)
from attnzoo.modeling.attention.window import beyond_window, left_align, restore_order
from attnzoo.modeling.attention.windowed import (
    FarInputs,
    FarOutput,
    FarPart,
    far_softmax,
    log_far_mass,
    normalised_far,
    register_far_part,
)
from attnzoo.modeling.cache import with_spare_tokens, write_at_rows
from attnzoo.ops.chunked_attention import ChunkMask, pad_to_multiple

#: queries per block (and sorted keys per chunk) of separate-QK LSH's sorted blocks: each query scores K + SORTED_BLOCK
#: keys. 32 was the fastest of 16, 32 and 64 for a SmolLM2-shaped layer at 8K tokens (K = 64, 4 rounds, 2 cores).
SORTED_BLOCK = 32
#: (query, key slot) pairs that separate-QK LSH's sorted blocks score at once. Small enough that a group's copies,
#: scores and masks (about 25 MB in float32) stay in the CPU's caches between the passes over them: 2^20 took 0.75x
#: the time of 2^24 (300 MB a group) for a SmolLM2-shaped layer at 32K tokens on 2 cores, 2^18 and 2^19 no less.
FAR_BLOCK_PAIRS = 1 << 20
#: (query, centroid) scores learned buckets compute at once: 2^24 floats, 64 MB
CENTROID_SCORES = 1 << 24
#: (block, bucket) key sums the members' mean holds at once: 2^22 floats, 16 MB (the blocks of a 32K prompt at
#: P = 256 in one piece for a key-value head of SmolLM2's shapes)
MEMBER_SUMS = 1 << 22
#: the bound off the CPU: a GPU has no such cache to fit and pays a few dozen kernel launches a group (the CPU's bound
#: before, about 300 MB of scores and masks a group in float32)
FAR_BLOCK_PAIRS_OFF_CPU = 1 << 24


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


@register_far_part("lsh")
class LSHFarPart(LSHBuckets, FarPart):
    """LSH's bucket attention beyond the window; see the module docstring. With shared QK (the Reformer's) scores are
    LSH's (keys normalised, no scaling, a query's own key penalised), so the near part scores the same way; with
    separate queries and keys (`lsh_shared_qk=False`) both parts score q·k / √d, as the source model does."""

    family_config = "ZooReformerSettings"
    plain_kind = "lsh"
    projection_names = ChunkedAttention.projection_names + FarPart.projection_names
    head_size_field = "reformer_head_size"
    causal = True
    # FarKeyMask adds a condition that only the PyTorch path reads.
    chunk_backend = "torch"

    shared_qk_field = "lsh_shared_qk"

    def __init__(self, layer, config):
        super().__init__(layer, config)
        self.shared_qk = layer.shared_qk
        self.chunk_length, self.chunks_before, self.chunks_after = config.lsh_chunk_length, \
            config.lsh_num_chunks_before, 0
        dropout = config.lsh_attention_probs_dropout_prob
        self.dropout = config.attention_probs_dropout_prob if dropout is None else dropout
        self.read_lsh_settings(config)
        self.centre_keys = config.lsh_centre_keys
        #: learned buckets: keys by their nearest centroid, queries by the centroids they score highest
        self.key_centroids = config.lsh_key_centroids
        #: with learned buckets: rank them by their far members' mean key, taken once per block of this many tokens
        #: (None: by the centroids)
        self.member_mean_block = config.lsh_member_mean_block
        #: with the members' mean: "mean" ranks a bucket by q·m, "log_mass" by q·m / √d + log(1 + n)
        self.member_score = config.lsh_member_score
        #: with `lsh_group_rotations`, a key-value group's query heads hash with the rotations of its first query
        #: head, so keys are hashed once per key-value head (learned buckets: a key's bucket is its head's, whatever
        #: the query head)
        grouped = config.lsh_group_rotations or self.key_centroids
        self.group = self.num_heads // self.num_kv_heads if grouped else 1
        if self.centre_keys:  # one centre per key-value head of this far part (zero until calibrated)
            layer.register_buffer("lsh_key_centre", torch.zeros(self.num_kv_heads, self.head_dim), persistent=True)
        if self.key_centroids:  # lsh_num_buckets centroids per key-value head (zero until fitted)
            layer.register_buffer("lsh_key_centroids", torch.zeros(self.num_kv_heads, config.lsh_num_buckets,
                                                                   self.head_dim), persistent=True)
        #: while not None, `_hash_keys` adds [kv_heads, d] key sums and their count here (`lsh_key_centres`)
        self.key_record: list | None = None
        #: while not None, `_keys_to_hash` adds each row's real keys as hashed, [kv_heads, n, d], here
        #: (`fit_lsh_key_centroids`)
        self.key_capture: list | None = None

    def init_buffers(self) -> None:
        if self.centre_keys:
            init.zeros_(self.layer.lsh_key_centre)
        if self.key_centroids:
            init.zeros_(self.layer.lsh_key_centroids)

    @property
    def dropout_rate(self) -> float:
        return self.dropout if self.training else 0.0

    @property
    def scale(self) -> float:
        """The far part's score scale, the layer's: 1 with shared QK (LSH's scores), 1 / √d with separate QK."""
        return 1.0 if self.shared_qk else 1.0 / math.sqrt(self.head_dim)

    def _far_logits(self, q, keys):
        """Scores of queries q [..., T, d] against the keys retrieved for them [..., T, n, d] (shared QK: normalised,
        unscaled)."""
        keys = normalize_keys(keys) if self.shared_qk else keys
        # the query as a row against the keys transposed: one [1, d] x [d, n] product per query, no copies of the
        # keys (as keys @ q, a matrix-vector product, it took 4x as long on 2 cores at n = 256)
        logits = (q.unsqueeze(-2) @ keys.transpose(-1, -2)).squeeze(-2)
        return logits if self.shared_qk else logits * self.scale

    # -- hashing ----------------------------------------------------------------------------------------------------
    def _indexed_rounds(self, key_buckets):
        """The rounds of key buckets [B, H_k, R, n] that the sorted order and the decoding index keep: all R, or
        with learned buckets, where a key's bucket is the same in every round, the first alone ([B, H_k, 1, n]),
        which serves every round."""
        return key_buckets[:, :, :1] if self.key_centroids else key_buckets

    def _query_rotations(self, rotations):
        """The rotations each query head hashes with: its own, or with `lsh_group_rotations` its group's."""
        if self.group == 1:
            return rotations
        return rotations[:, ::self.group].repeat_interleave(self.group, dim=1)

    def _per_query_head(self, key_buckets):
        """Key buckets [B, H, R, L] as each query head sees them, from the heads the keys were hashed in."""
        return key_buckets if self.group == 1 else key_buckets.repeat_interleave(self.group, dim=1)

    def _keys_to_hash(self, k, valid):
        """Keys k [B, kv_heads, L, d] as they are hashed (minus their head's centre with `lsh_centre_keys`), their
        sums recorded while `key_record` is set."""
        if self.key_record is not None:
            real = k.new_ones(k.shape[0], k.shape[2]) if valid is None else valid.to(k.dtype)
            self.key_record.append((torch.einsum("bhld,bl->hd", k.detach(), real), real.sum()))
        hashed = k - self.layer.lsh_key_centre[:, None, :].to(k.dtype) if self.centre_keys else k
        if self.key_capture is not None:
            self.key_capture.extend(hashed[b].detach() if valid is None else hashed[b][:, valid[b]].detach()
                                    for b in range(k.shape[0]))
        return hashed

    def _centroid_buckets(self, q, k, valid):
        """Learned buckets (`lsh_key_centroids`): ([B, H, R, L] each query's R best-scoring buckets in descending
        order, [B, kv_heads, R, L] each key's nearest centroid after its head's centre, repeated over the R rounds);
        padding (valid False) in the extra bucket. A bucket scores q·c, its centroid's score, or with
        `lsh_member_mean_block` its members' mean key's (`_member_mean_probes`: the rows left-aligned, so an index
        is a position). Scored in blocks of queries, so the [.., L, centroids] scores stay small at long lengths."""
        centroids = self.layer.lsh_key_centroids.to(self._centroid_dtype(k))  # [kv, C, d]
        count, rounds = centroids.shape[1], self.num_hashes
        keys = self._keys_to_hash(k, valid).to(centroids.dtype)
        nearest = self._nearest_centroids(keys, centroids)  # [B, kv, L]
        if self.member_mean_block is not None:
            query_buckets = self._member_mean_probes(q, keys, nearest, valid, centroids)
        else:
            per_query_head = centroids.repeat_interleave(self.group, dim=0).transpose(-1, -2)  # [H, d, C]
            block = max(1, CENTROID_SCORES // (q.shape[0] * q.shape[1] * count))
            query_buckets = torch.cat([(part.to(centroids.dtype) @ per_query_head).topk(rounds, dim=-1).indices
                                       for part in q.split(block, dim=2)], dim=2).transpose(2, 3)  # [B, H, R, L]
        key_buckets = nearest[:, :, None, :].expand(-1, -1, rounds, -1)  # [B, kv, R, L]
        if valid is not None:
            key_buckets = key_buckets.masked_fill(~valid[:, None, None, :], count)
            query_buckets = query_buckets.masked_fill(~valid[:, None, None, :], count)
        return query_buckets, key_buckets

    @staticmethod
    def _centroid_dtype(k):
        """Learned buckets are chosen in float32, or in the keys' own dtype when it is wider (float64 tests)."""
        return torch.promote_types(k.dtype, torch.float32)

    @staticmethod
    def _nearest_centroids(keys, centroids):
        """[B, kv, L] the nearest centroid (of [kv, C, d]) to each key of [B, kv, L, d]: by |k - c|^2 = |k|^2 -
        2 k·c + |c|^2, the argmax of 2 k·c - |c|^2."""
        return (2 * keys @ centroids.transpose(-1, -2) - (centroids * centroids).sum(-1)[:, None, :]).argmax(-1)

    def _member_key(self, position, valid):
        """Which keys join the members' sums, and when: ([B, L] a real key past the sinks, [L] the first block of
        queries whose sums hold it). The query at position i ranks by the far keys up to e_i = ⌊i / P⌋·P - W, so key
        j counts for the blocks a with aP - W >= j: from block ⌊(j + W - 1) / P⌋ + 1 on."""
        counted = position >= self.sinks
        counted = counted[None] if valid is None else counted[None] & valid
        first_block = torch.div(position + self.window_size - 1, self.member_mean_block, rounding_mode="floor") + 1
        return counted, first_block

    def _member_scores(self, scores, counts):
        """What each bucket scores from q·m, its query's product with the members' mean ([..., C]), and n, the far
        keys it holds (counts, broadcastable): q·m itself ("mean"), or with `lsh_member_score="log_mass"` q·m / √d +
        log(1 + n), by Jensen's inequality a lower bound on log Σ exp(q·k / √d) over the bucket's 1 + n members (the
        centroid one of them): the bucket's share of an exact softmax, where the mean alone ranks a bucket of one
        key above a bucket of a thousand that scores a little lower."""
        if self.member_score == "mean":
            return scores
        return scores * self.scale + torch.log1p(counts)

    def _member_mean_probes(self, q, keys, nearest, valid, centroids):
        """[B, H, R, L] each left-aligned query's R buckets whose members' mean key scores highest: per block of P =
        `lsh_member_mean_block` queries, the sums and counts per bucket of the far keys as of the block's start
        (`_member_key`): the keys scattered into (block, bucket) slots and summed cumulatively over the blocks, a
        piece of blocks at a time (so a small P holds no [L / P, C, d] sums at once); a bucket's mean is
        (μ + Σ k) / (1 + n), its centroid one member. keys [B, kv, L, d]: as hashed (centred); nearest [B, kv, L]:
        their buckets."""
        batch, kv_heads, length, dim = keys.shape
        heads, count, rounds = q.shape[1], centroids.shape[1], self.num_hashes
        group, block_size = heads // kv_heads, self.member_mean_block
        if length == 0:
            return nearest.new_zeros(batch, heads, rounds, 0)
        size = min(block_size, length)  # one block holds every query when the block is longer
        blocks = -(-length // size)
        counted, first_block = self._member_key(torch.arange(length, device=keys.device), valid)
        counted = counted.expand(batch, -1)
        # a key head's queries block by block: [B, kv, blocks, group * size, d]
        queries = torch.nn.functional.pad(q.to(keys.dtype), (0, 0, 0, blocks * size - length)).view(
            batch, kv_heads, group, blocks, size, dim).transpose(2, 3).reshape(batch, kv_heads, blocks, -1, dim)
        per_piece = max(1, min(MEMBER_SUMS // (batch * kv_heads * count * dim),
                               CENTROID_SCORES // (batch * kv_heads * queries.shape[3] * count)))
        row_piece = min(queries.shape[3], max(1, CENTROID_SCORES // (batch * kv_heads * count)))
        sums, counts = keys.new_zeros(batch, kv_heads, 1, count, dim), keys.new_zeros(batch, kv_heads, 1, count)
        best = []
        for start in range(0, blocks, per_piece):  # a few pieces: memory, not work, is what they bound
            end = min(start + per_piece, blocks)
            # the keys first counted in blocks start..end - 1 lie at [(start - 1)P - W + 1, (end - 1)P - W + 1); each
            # to its (block, bucket) slot, or, not counted (padding, sinks), to a spare block's
            lo, hi = (min(max((at - 1) * block_size - self.window_size + 1, 0), length) for at in (start, end))
            slot = torch.where(counted[:, lo:hi], (first_block[lo:hi] - start) * count, (end - start) * count)
            slot = slot[:, None] + nearest[:, :, lo:hi]
            added = keys.new_zeros(batch, kv_heads, (end - start + 1) * count, dim).scatter_add_(
                2, slot[..., None].expand(-1, -1, -1, dim), keys[:, :, lo:hi])
            added_counts = keys.new_zeros(batch, kv_heads, (end - start + 1) * count).scatter_add_(
                2, slot, torch.ones_like(keys[:, :, lo:hi, 0]))
            piece_sums = sums + added.view(batch, kv_heads, -1, count, dim)[:, :, :end - start].cumsum(2)
            piece_counts = counts + added_counts.view(batch, kv_heads, -1, count)[:, :, :end - start].cumsum(2)
            sums, counts = piece_sums[:, :, -1:], piece_counts[:, :, -1:]
            means = (centroids[None, :, None] + piece_sums) / (1 + piece_counts)[..., None]  # [B, kv, n, C, d]
            mass = piece_counts[:, :, :, None, :]  # [B, kv, n, 1, C]: each block's counts, for all its queries
            best.append(torch.cat([self._member_scores(part @ means.transpose(-1, -2), mass).topk(rounds, dim=-1)
                                   .indices for part in queries[:, :, start:end].split(row_piece, dim=3)], dim=3))
        best = torch.cat(best, dim=2).view(batch, kv_heads, blocks, group, size, rounds).permute(0, 1, 3, 5, 2, 4)
        return best.reshape(batch, heads, rounds, blocks * size)[..., :length]

    def _member_start(self, k, nearest, valid):
        """The members' state after a prefill of left-aligned rows: per row of L_b real tokens, the sums and counts
        per bucket of its last token's block (`lsh_member_sums`, `lsh_member_counts`: the far keys up to
        ⌊(L_b - 1) / P⌋·P - W) and of the far keys since (`lsh_pending_sums`, `lsh_pending_counts`: up to L_b - 1 -
        W), which join the first at the next block's first token (`_member_token`). Keys are left out by selection
        (`torch.where`), not by a zero weight, so a padding key's values never reach a sum."""
        centroids = self.layer.lsh_key_centroids.to(self._centroid_dtype(k))
        batch, kv_heads, length, dim = k.shape
        keys = (k - self.layer.lsh_key_centre[:, None, :].to(k.dtype)).to(centroids.dtype)
        position = torch.arange(length, device=k.device)
        counted, first_block = self._member_key(position, valid)
        real = valid.sum(-1, keepdim=True) if valid is not None else position.new_full((batch, 1), length)
        snapshot = torch.div(real - 1, self.member_mean_block, rounding_mode="floor")  # the next query's block
        is_far = counted & (position <= real - 1 - self.window_size)
        state = {}
        for name, chosen in (("member", is_far & (first_block <= snapshot)), ("pending", is_far & (first_block >
                                                                                                   snapshot))):
            chosen = chosen[:, None, :].expand(-1, kv_heads, -1)
            weight = chosen.to(keys.dtype)
            bucket = nearest.clamp(max=centroids.shape[1] - 1)
            state[f"lsh_{name}_sums"] = keys.new_zeros(batch, kv_heads, centroids.shape[1], dim).scatter_add_(
                2, bucket[..., None].expand(-1, -1, -1, dim), torch.where(chosen[..., None], keys, 0))
            state[f"lsh_{name}_counts"] = keys.new_zeros(batch, kv_heads, centroids.shape[1]).scatter_add_(
                2, bucket, weight)
        return state

    def _member_token(self, stored, q, k, x):
        """(query buckets [B, H, R, 1], key buckets [B, kv_heads, R, 1], the members' state after it) of one new
        token at x.position: the key leaving the window joins the pending sums (when it joins the far keys), which
        join the members' at a block's first token; the query then ranks the buckets by their members' mean."""
        centroids = self.layer.lsh_key_centroids.to(self._centroid_dtype(k))
        centre = self.layer.lsh_key_centre[:, None, :]
        rounds = self.num_hashes
        batch, heads, _, dim = q.shape
        nearest = self._nearest_centroids(self._keys_to_hash(k, None).to(centroids.dtype), centroids)  # [B, kv, 1]
        leaving_k, _, joins = x.leaving
        gone = (leaving_k - centre.to(leaving_k.dtype)).to(centroids.dtype)
        gone_bucket = self._nearest_centroids(gone, centroids)
        weight = joins.to(gone.dtype).view(batch, 1, 1).expand(-1, gone.shape[1], 1)
        pending_sums = stored["lsh_pending_sums"].scatter_add(2, gone_bucket[..., None].expand(-1, -1, -1, dim),
                                                              torch.where(joins.view(batch, 1, 1, 1), gone, 0))
        pending_counts = stored["lsh_pending_counts"].scatter_add(2, gone_bucket, weight)
        fold = (x.valid[:, 0] & (x.position[:, 0] % self.member_mean_block == 0)).view(batch, 1, 1)
        sums = stored["lsh_member_sums"] + torch.where(fold[..., None], pending_sums, 0)
        counts = stored["lsh_member_counts"] + torch.where(fold, pending_counts, 0)
        state = dict(lsh_member_sums=sums, lsh_member_counts=counts,
                     lsh_pending_sums=torch.where(fold[..., None], 0, pending_sums),
                     lsh_pending_counts=torch.where(fold, 0, pending_counts))
        means = (centroids + sums) / (1 + counts)[..., None]  # [B, kv, C, d]
        kv_heads = means.shape[1]
        scores = self._member_scores(q.to(means.dtype).view(batch, kv_heads, heads // kv_heads, dim) @
                                     means.transpose(-1, -2), counts[:, :, None, :])
        query_buckets = scores.topk(rounds, dim=-1).indices.view(batch, heads, rounds, 1)
        return query_buckets, nearest[:, :, None, :].expand(-1, -1, rounds, -1), state

    def _reference_member_probes(self, q, k, valid, position):
        """[B, H, R, L] the members' mean rule in the tokens' own order, densely: for the query at position i, the
        mean key (μ + Σ k) / (1 + n) of each bucket's real keys at positions S <= j <= ⌊i / P⌋·P - W (centred, each
        in the bucket of its nearest centroid by distance), and its R best-scoring buckets."""
        centroids = self.layer.lsh_key_centroids.to(self._centroid_dtype(k))
        keys = (k - self.layer.lsh_key_centre[:, None, :].to(k.dtype)).to(centroids.dtype)
        nearest = (keys[:, :, :, None, :] - centroids[None, :, None]).square().sum(-1).argmin(-1)  # [B, kv, L]
        members = torch.nn.functional.one_hot(nearest, centroids.shape[1]).to(keys.dtype)  # [B, kv, L, C]
        last = torch.div(position, self.member_mean_block, rounding_mode="floor") * self.member_mean_block - \
            self.window_size
        counted = (position[:, None, :] >= self.sinks) & (position[:, None, :] <= last[:, :, None])
        counted = (counted & valid[:, None, :]).to(keys.dtype)  # [B, L (query), L (key)]
        sums = torch.einsum("bqj,bhjc,bhjd->bhqcd", counted, members, keys)
        counts = torch.einsum("bqj,bhjc->bhqc", counted, members)
        means = ((centroids[None, :, None] + sums) / (1 + counts)[..., None]).repeat_interleave(self.group, dim=1)
        scores = self._member_scores(torch.einsum("bhqd,bhqcd->bhqc", q.to(keys.dtype), means),
                                     counts.repeat_interleave(self.group, dim=1))
        best = scores.topk(self.num_hashes, dim=-1).indices.transpose(2, 3)
        return best.masked_fill(~valid[:, None, None, :], centroids.shape[1])

    def _hash_token(self, q, k, rotations, factors):
        """(query buckets [B, H, R, 1], key buckets [B, H_k, R, 1]) of one new token, its query q [B, H, 1, d] and
        key k [B, kv_heads, 1, d] hashed in one product (a decoding step is many small operations: one hashing
        instead of two); with learned buckets, by the centroids."""
        if self.key_centroids:
            return self._centroid_buckets(q, k, None)
        if self.shared_qk:
            buckets = hash_buckets(q, rotations, factors)
            return buckets, buckets
        batch, heads, _, dim = q.shape
        k = self._keys_to_hash(k, None)
        if self.group > 1:  # a group's queries and its key, hashed with the group's rotations
            kv_heads = heads // self.group
            both = torch.cat([q.view(batch, kv_heads, self.group, dim), k], dim=2)
            buckets = hash_buckets(both, rotations[:, ::self.group], factors)  # [B, kv, R, group + 1]
            query_buckets = buckets[..., :self.group].transpose(2, 3).reshape(batch, heads, -1, 1)
            return query_buckets, buckets[..., self.group:]
        buckets = hash_buckets(torch.cat([q, self.expand_kv(k)], dim=2), rotations, factors)  # [B, H, R, 2]
        return buckets[..., :1], buckets[..., 1:]

    def _hash_keys(self, k, rotations, factors, valid):
        """Key buckets [B, H_k, R, L] of keys k [B, kv_heads, L, d] (valid [B, L] or None), minus their head's centre
        with `lsh_centre_keys`: hashed per query head with that head's rotations (H_k = H), or with
        `lsh_group_rotations` once per key-value head with its group's (H_k = kv_heads)."""
        k = self._keys_to_hash(k, valid)
        if self.group > 1:
            return self.hash_vectors(k, rotations[:, ::self.group], factors, valid)
        return self.hash_vectors(self.expand_kv(k), rotations, factors, valid)

    def _buckets(self, q, k, valid, recompute):
        """(query buckets [B, H, R, L], key buckets [B, H_k, R, L] (`_hash_keys`; shared QK: the query buckets),
        rotations or None) of this forward: hashed with new rotations
        (and saved for a reversible stack's recomputation, which reuses them), or the saved ones when replaying."""
        # Learned buckets are a function of q and k alone: a replay computes the same buckets again, except that the
        # members' sums are scattered (on a GPU in no fixed order), so a replay reads those it saved.
        if self.key_centroids and not (self.member_mean_block is not None and recompute is not None
                                       and recompute.replaying):
            query_buckets, key_buckets = self._centroid_buckets(q, k, valid)
            if recompute is not None and not recompute.replaying:  # (what the reference reads when it replays)
                recompute.saved.update(buckets=query_buckets, key_buckets=key_buckets)
            return query_buckets, key_buckets, None
        factors = self.bucket_factors()
        if recompute is not None and recompute.replaying:
            buckets = recompute.saved["buckets"]
            if self.rotation_seed() is None:  # advance the global RNG as the first call did (dropout repeats)
                self.draw_rotations(q.shape[0], buckets.shape[2], factors, q.device)
            return buckets, recompute.saved.get("key_buckets", buckets), None
        rotations = self.draw_rotations(q.shape[0], self.num_hashes, factors, q.device)
        query_buckets = self.hash_vectors(q, self._query_rotations(rotations), factors, valid)
        key_buckets = query_buckets if self.shared_qk else self._hash_keys(k, rotations, factors, valid)
        if recompute is not None:
            recompute.saved["buckets"] = query_buckets
            if not self.shared_qk:
                recompute.saved["key_buckets"] = key_buckets
        return query_buckets, key_buckets, rotations

    # -- the parallel form ------------------------------------------------------------------------------------------
    def window_mask(self, **fields) -> FarKeyMask:
        # A query's own key is always in its window, so the far part has no self penalty: a query without far keys
        # gets the floor log-sum-exp there and no weight.
        fields["self_penalty"] = False
        return FarKeyMask(**fields, window_size=self.window_size, sinks=self.sinks)

    def parallel(self, x: FarInputs) -> FarOutput:
        query_buckets, key_buckets, rotations = self._buckets(x.q, x.k, x.valid, x.recompute)  # padding: extra bucket
        state = self._start_state(x.k, x.v, key_buckets, rotations) if x.keep_state else None
        if state is not None and self.member_mean_block is not None:
            state.update(self._member_start(x.k, key_buckets[:, :, 0], x.valid))
        if not self.shared_qk:
            return FarOutput(*self._far_of_sorted_blocks(x.q, x.k, x.v, query_buckets, key_buckets), state)
        return FarOutput(*self._far_of_shared_qk(x.q, x.k, x.v, query_buckets, x.recompute), state)

    def _far_of_shared_qk(self, q, k, v, query_buckets, recompute):
        """The far triple of shared-QK LSH for left-aligned queries: LSH's chunked bucket attention with the window's
        keys masked out (`window_mask`)."""
        length = q.shape[2]
        num_buckets = math.prod(self.bucket_factors())
        m = self.chunk_length
        buckets = pad_to_multiple(query_buckets, m, dim=3, value=num_buckets)
        # On a recomputation the backward follows at once: keeping the probabilities costs no peak memory.
        replaying = recompute is not None and recompute.replaying
        out, lse = self.lsh_attention(pad_to_multiple(q, m, dim=2), pad_to_multiple(self.expand_kv(v), m, dim=2),
                                      buckets, sort_by_bucket(buckets), num_buckets, save_probs=replaying,
                                      return_lse=True, keys=None if k is q else pad_to_multiple(k, m, dim=2))
        return out[:, :, :length], torch.ones_like(lse[:, :, :length]), lse[:, :, :length]

    def _far_of_sorted_blocks(self, q, k, v, query_buckets, key_buckets):
        """The far triple of separate-QK LSH for left-aligned queries, from the keys' (bucket, position) order, in dense
        blocks. Per round, query i's candidates (the K most recent earlier keys of its bucket) are the sorted keys in
        the slots [lo_i, b_i), where b_i counts the keys that sort before i's own code and lo_i = max(b_i - K, the
        first slot of i's bucket). Queries whose b_i fall in one C-slot chunk of the sorted keys (C = `SORTED_BLOCK`)
        all find theirs in the K + C slots [jC - K, (j+1)C), so queries are laid
        out by that chunk, C to a block (a chunk with more queries fills several blocks), and each block scores its
        span of keys in one matrix product: no per-query copies of keys (docs/lsh_attention.md, §7). Each round
        gives its own softmax (with the duplicate correction a pair already listed in an earlier round is left out,
        so each key counts once); the rounds combine by their log-sum-exps. Keys hashed once per key-value head
        (`lsh_group_rotations`) are sorted, copied and laid out once for their group: the group's query heads are
        then one list of queries over them, and fill the blocks of each chunk together.

        q [B, H, L, d] and k, v [B, kv_heads, L, d|e] left-aligned; query buckets [B, H, R, L] and key buckets
        [B, H_k, R, L] (H_k = H, or kv_heads with grouped rotations; padding: the extra bucket, which sorts last and
        no real query shares)."""
        batch, heads, rounds, length = query_buckets.shape
        key_heads, group = key_buckets.shape[1], heads // key_buckets.shape[1]
        device, C, K = q.device, SORTED_BLOCK, self.recent_size
        # Queries before position W + S have no far key (positions count real tokens: the rows are left-aligned).
        first = min(self.window_size + self.sinks, length)
        none = (q.new_zeros(batch, heads, first, v.shape[-1]), q.new_ones(batch, heads, first),
                q.new_full((batch, heads, first), float("-inf")))
        if first == length:
            return none
        per_head = length - first
        # a key head's query heads as one list of queries: query j * per_head + i is head j's query at first + i;
        # scaled once here rather than every score
        q = (q[:, :, first:] * self.scale).reshape(batch, key_heads, group * per_head, q.shape[-1])
        query_buckets = query_buckets[..., first:].reshape(batch, key_heads, group, rounds, per_head).transpose(
            2, 3).reshape(batch, key_heads, rounds, group * per_head)
        queries, heads = group * per_head, key_heads
        position = torch.arange(length, device=device)
        query_position = position[first:].repeat(group)
        # Learned buckets give a key one bucket in every round: one sorted order (and one copy of the sorted keys)
        # serves all rounds, where random rotations need one a round. No pair is then listed in two rounds either (a
        # query's buckets differ round to round), so the duplicate correction has nothing to remove.
        key_buckets = self._indexed_rounds(key_buckets)
        key_rounds = key_buckets.shape[2]
        codes, key_order = (key_buckets * length + position).sort(dim=-1)  # slot -> key position

        def slots_of(values):  # [B, H_k, R, Q] -> where in its round's sorted codes each value goes
            wanted = values.reshape(batch, key_heads, key_rounds, -1).contiguous()
            return torch.searchsorted(codes, wanted).view(batch, key_heads, rounds, -1)

        before = slots_of(query_buckets * length + query_position)  # [B, H_k, R, Q]
        low = torch.maximum(before - K, slots_of(query_buckets * length))  # from the bucket's first slot at most
        key_slot = inverse_permutation(key_order)  # key position -> slot
        # Queries by the chunk of sorted keys their candidates end in; `rank`: their place among that chunk's queries.
        chunk = torch.div(before, C, rounding_mode="floor")
        chunk_sorted, query_order = chunk.sort(dim=-1, stable=True)
        rank = torch.arange(queries, device=device) - torch.searchsorted(chunk_sorted, chunk_sorted)
        chunks = length // C + 1
        count = torch.zeros(batch, heads, rounds, chunks, dtype=torch.long, device=device)
        count.scatter_add_(-1, chunk_sorted, torch.ones_like(chunk_sorted))
        blocks_of_chunk = torch.div(count + C - 1, C, rounding_mode="floor")
        first_block = blocks_of_chunk.cumsum(-1) - blocks_of_chunk
        block = first_block.gather(-1, chunk_sorted) + torch.div(rank, C, rounding_mode="floor")
        num_blocks = -(-queries // C) + chunks  # a static bound: the sum of ceil(count / C) over the chunks
        place = block * C + rank % C  # each query's place in the [num_blocks * C] layout, in sorted order
        query_at = position.new_full((batch, heads, rounds, num_blocks * C), -1).scatter_(-1, place, query_order)
        place_of_query = torch.empty_like(place).scatter_(-1, query_order, place)  # query -> its place
        chunk_of_block = torch.zeros(batch, heads, rounds, num_blocks, dtype=torch.long, device=device).scatter_(
            -1, block, chunk_sorted)
        # Keys and values once in each round's sorted order, side by side in one row (a block's span is then one copy;
        # two, of keys and of values, took a tenth longer), padded by K slots before and C after: chunk j's span is
        # then the K + C consecutive rows from row jC, copied once per block.
        span = K + C
        sorted_rows = grouped_rows(k, key_order)
        both = torch.cat([k, v], dim=-1)
        sorted_pairs = torch.nn.functional.pad(both.reshape(-1, both.shape[-1]).index_select(0, sorted_rows).view(
            batch, heads, key_rounds, length, -1), (0, 0, K, C))  # [B, H, R | 1, K + L + C, d + e]
        sorted_positions = torch.nn.functional.pad(key_order, (K, C), value=-1)  # their key positions, -1: padding
        # int32 from here: the [.., C, K + C] comparisons are most of the far part's time
        bounds = (low.int(), before.int(), key_slot.int())
        pairs = FAR_BLOCK_PAIRS if device.type == "cpu" else FAR_BLOCK_PAIRS_OFF_CPU
        per_group = max(1, pairs // (batch * heads * rounds * C * span))
        parts = [self._far_of_block_group(q, first, per_head, query_at[..., start * C:(start + per_group) * C],
                                          chunk_of_block[..., start:start + per_group], sorted_pairs,
                                          sorted_positions, *bounds)
                 for start in range(0, num_blocks, per_group)]
        out, lse = parts[0] if len(parts) == 1 else (torch.cat(part, dim=3) for part in zip(*parts, strict=True))
        # each round's (out, lse) back in query order, whole rows copied (a gather over e took twice as long)
        rows = (torch.arange(batch * heads * rounds, device=device)[:, None] * out.shape[3]
                + place_of_query.flatten(0, 2)).reshape(-1)
        out = out.reshape(-1, out.shape[-1]).index_select(0, rows).view(batch, heads, rounds, queries, -1)
        lse = lse.reshape(-1).index_select(0, rows).view(batch, heads, rounds, queries)
        # the rounds under one log-sum-exp: round r's output weighs exp(lse_r - total). Added round by round (one
        # [B, H, R, Q, e] product and a sum over R took three times as long), then a query head per row:
        # [B, H_k, group * Q] -> [B, H, Q], a view.
        total = log_far_mass(lse.transpose(2, 3))  # [B, H_k, group * Q]
        relative = torch.exp(lse - torch.where(torch.isfinite(total), total, 0.0)[:, :, None])
        weight = torch.where(torch.isfinite(lse), relative, 0.0)[..., None]
        combined = out[:, :, 0] * weight[:, :, 0]
        for r in range(1, rounds):
            combined.addcmul_(out[:, :, r], weight[:, :, r])
        total = total.view(batch, key_heads * group, per_head)
        found = (combined.view(batch, key_heads * group, per_head, -1), torch.ones_like(total), total)
        return tuple(torch.cat([early, late], dim=2) for early, late in zip(none, found, strict=True))

    def _far_of_block_group(self, q, first, per_head, query_at, chunk_of_block, sorted_pairs, sorted_positions, low,
                            before, key_slot):
        """(out [B, H, R, n * C, e], lse [B, H, R, n * C]) of n blocks of queries over the K + C key slots that end
        each block's chunk of sorted keys (H: the heads the keys were hashed in): each round's softmax over its far
        keys and their log-sum-exp. q [B, H, Q, d]: the queries (scaled) from
        position `first` on, `per_head` of them for each query head of the key head's group in turn (query i sits at
        position first + i mod `per_head`); `query_at` [B, H, R, n * C]: which of them sit in each block's places
        (-1: an empty place); `sorted_pairs` [B, H, R | 1, K + L + C, d + e]: each round's sorted keys and values
        side by side (one order for every round with learned buckets), K zero rows before and C after, so chunk j's
        span starts at row jC; `sorted_positions` [B, H, R | 1, K + L + C]: their key positions, -1 on the padding;
        `low`, `before` [B, H, R, Q]: each query's candidate slots [low, before) per round (int32); `key_slot`
        [B, H, R | 1, L]: each key's slot per round (int32)."""
        batch, heads, key_rounds, length = key_slot.shape
        rounds = chunk_of_block.shape[2]
        C, K = SORTED_BLOCK, self.recent_size
        blocks, span = chunk_of_block.shape[-1], K + C
        shape = (batch, heads, rounds, blocks, C)
        device, dim = q.device, q.shape[-1]
        slot = chunk_of_block[..., None] * C - K + torch.arange(span, device=device)  # [B, H, R, n, S]
        key_at = sorted_positions.expand(-1, -1, rounds, -1).gather(-1, (slot + K).flatten(3)).view_as(slot)
        # each block's span: K + C consecutive rows of the padded sorted keys and values (of its round's order)
        head_round = torch.arange(batch * heads * key_rounds, device=device).view(batch, heads, key_rounds, 1, 1)
        rows = head_round * (K + length + C) + (slot + K)
        pairs = sorted_pairs.reshape(-1, sorted_pairs.shape[-1]).index_select(0, rows.reshape(-1)).view(
            *shape[:4], span, -1)
        keys, values = pairs[..., :dim], pairs[..., dim:]
        query_real = (query_at >= 0).view(shape)
        query_pos = query_at.clamp(min=0)
        # an empty place lists no slot: [0, 0)
        q_low = torch.where(query_real, low.gather(-1, query_pos).view(shape), 0)[..., None]
        q_before = torch.where(query_real, before.gather(-1, query_pos).view(shape), 0)[..., None]
        query_pos = query_pos.view(shape)
        slot = slot.int()[..., None, :]
        far = slot >= q_low  # [B, H, R, n, C, S], built in place
        far &= slot < q_before
        far &= (key_at >= self.sinks).unsqueeze(-2)
        at_position = query_pos if per_head == q.shape[2] else query_pos % per_head  # a group: i mod per_head
        far &= key_at.unsqueeze(-2) <= (at_position + (first - self.window_size)).unsqueeze(-1)
        if self.duplicate_correction and key_rounds > 1:
            # a pair listed in an earlier round already counts there: each key once (the reference's correction)
            query_index, key_index = query_pos.flatten(3), key_at.clamp(min=0).flatten(3)
            for this in range(1, rounds):
                for earlier in range(this):  # a handful of rounds: R(R - 1)/2 comparisons of one round's size
                    there = key_slot[:, :, earlier].gather(-1, key_index[:, :, this]).view(batch, heads, blocks, 1,
                                                                                            span)
                    lo = low[:, :, earlier].gather(-1, query_index[:, :, this]).view(batch, heads, blocks, C, 1)
                    end = before[:, :, earlier].gather(-1, query_index[:, :, this]).view(batch, heads, blocks, C, 1)
                    far[:, :, this] &= (there < lo) | (there >= end)
        rows = grouped_rows(q, query_pos)
        queries = q.reshape(-1, dim).index_select(0, rows).view(*shape, -1)
        # non-candidates at the lowest finite score (of the scores' own dtype: under autocast not the queries'), in
        # place (bmm's backward needs no output); `far_softmax` reads that as -inf without exp's slow path for it
        logits = queries @ keys.transpose(-1, -2)
        logits.masked_fill_(~far, torch.finfo(logits.dtype).min)
        probs, lse = far_softmax(logits)  # a query without far keys: lse -inf, which gives its output no weight
        return (probs @ values).flatten(3, 4), lse.flatten(3)

    def _far_softmax(self, q, index, position, keys, values):
        """(num, 1, log-sum-exp) of queries q [B, H, T, d] at positions [B|1, 1, T, 1] over the keys listed at
        `index` [B, H, T, n] (-1: none; keys, values [B, H, T, n, d] gathered there): those beyond the window."""
        far = (index >= 0) & beyond_window(position, index, self.window_size, self.sinks)
        logits = self._far_logits(q, keys)
        if self.duplicate_correction and not self.key_centroids:  # (learned buckets list no key twice)
            # A key listed in c slots counts once: the correction's logit s - log(c) in each of its c slots sums to
            # exp(s), as keeping its first slot alone does. Sorting the n slots finds repeats in O(n log n), where
            # counting them pairwise built an [n, n] comparison per query (most of the far part's time).
            ordered, order = torch.where(far, index, -1).sort(dim=-1)
            first = torch.cat([torch.ones_like(ordered[..., :1], dtype=torch.bool),
                               ordered[..., 1:] != ordered[..., :-1]], dim=-1)
            far = far & torch.empty_like(first).scatter_(-1, order, first)
        num, den, lse = normalised_far(logits.masked_fill(~far, float("-inf")).unsqueeze(-2), values)
        return num.squeeze(-2), den.squeeze(-1), lse.squeeze(-1)

    # -- decoding ---------------------------------------------------------------------------------------------------
    def _start_state(self, k, v, key_buckets, rotations):
        """The decoding state after a prefill of L tokens: the keys and values that have left the window (positions
        below L - W; the ring holds the rest), the prefill's keys as a bucket index (`lsh_sorted` [B, H_k * R, L]:
        each round's key positions in (bucket, position) order; `lsh_starts` [B, H_k * R, buckets + 2]: where each
        bucket's run begins, the padding bucket's included), empty stores for the buckets and positions of the
        tokens decoding adds, and, unless decoding can draw them again, the rotations.

        The index answers a step's question, the K most recent earlier keys of the query's bucket, by reading the
        last K entries of one run: O(K) a head and round, where comparing the query's bucket with every stored key's
        was O(L) (at 32K tokens on SmolLM2's shapes, that search was a third of an `lsh_window` decoding step). It
        holds a position per key, head and round (2 bytes below 32K tokens, 4 above), as the bucket indices it
        replaces held a bucket; with learned buckets a key's bucket is the same in every round, so one round's index
        (and one round's buckets of the decoded tokens) serves them all."""
        key_buckets = self._indexed_rounds(key_buckets)
        batch, heads, rounds, length = key_buckets.shape
        buckets = key_buckets.reshape(batch, heads * rounds, length)
        index_dtype = torch.int16 if length < torch.iinfo(torch.int16).max else torch.int32
        runs = buckets.new_zeros(batch, heads * rounds, math.prod(self.bucket_factors()) + 2)
        runs[..., 1:].scatter_add_(-1, buckets, torch.ones_like(buckets))  # + 1: the padding bucket's run too
        gone = max(length - self.window_size, 0)
        state = dict(lsh_sorted=sort_by_bucket(buckets).to(index_dtype), lsh_starts=runs.cumsum(-1).to(index_dtype),
                     lsh_new_buckets=buckets.new_zeros(batch, heads * rounds, 0, dtype=self.bucket_index_dtype()),
                     lsh_new_positions=buckets.new_zeros(batch, 1, 0, dtype=torch.int32),
                     lsh_keys=with_spare_tokens(k[:, :, :gone]), lsh_values=with_spare_tokens(v[:, :, :gone]))
        if rotations is not None and not self.rotations_recomputable():  # (learned buckets draw none)
            state["lsh_rotations"] = rotations
        return state

    def _recent_keys(self, state, query_buckets, decoded):
        """[B, H, R, n] positions of the K most recent earlier keys in each query's bucket (`query_buckets`
        [B, H, R, 1]), most recent first, -1 where there are fewer: the last K of the bucket's run in the prefill's
        index, after the matches among the `decoded` tokens stored since (all of them later than the prefill's)."""
        batch, heads, rounds, _ = query_buckets.shape
        key_rounds = 1 if self.key_centroids else rounds  # (`_indexed_rounds`)
        key_heads = state["lsh_sorted"].shape[1] // key_rounds
        group, prefill, recent = heads // key_heads, state["lsh_sorted"].shape[-1], self.recent_size

        def per_query_head(x):  # [B, H_k * R | H_k, n] -> [B, H_k, group, R, n], the group's query heads as a view
            return x.view(batch, key_heads, 1, key_rounds, -1).expand(-1, -1, group, rounds, -1)

        wanted = query_buckets.view(batch, key_heads, group, rounds, 1)
        starts = per_query_head(state["lsh_starts"])
        first, end = starts.gather(-1, wanted).long(), starts.gather(-1, wanted + 1).long()
        slot = end - 1 - torch.arange(min(recent, prefill), device=end.device)  # the run's last K, most recent first
        found = per_query_head(state["lsh_sorted"]).gather(-1, slot.clamp(min=0)).long().masked_fill(slot < first, -1)
        if decoded:  # the decoded tokens' most recent matches (their slots are in time order), as positions
            slots = most_recent_in_bucket(per_query_head(state["lsh_new_buckets"][..., :decoded]), wanted, decoded,
                                          recent)
            positions = per_query_head(state["lsh_new_positions"][..., :decoded].expand(-1, key_heads * key_rounds,
                                                                                        -1))
            later = torch.where(slots >= 0, positions.gather(-1, slots.clamp(min=0)).long(), -1)
            found = torch.cat([later, found], -1)
            found = found.topk(min(recent, found.shape[-1]), dim=-1).values
        return found.view(batch, heads, rounds, -1)

    def step(self, x: FarInputs) -> FarOutput:
        """One new token per row: hash its query (and key) with the prefill's rotations, find the most recent earlier
        keys of the query's bucket in the prefill's index and among the tokens decoded since, record the new key's
        buckets and position and the key that leaves the window, and attend to the candidates that are far from the
        token."""
        stored, q, k, seen = dict(x.state), x.q, x.k, x.seen
        position, real = x.position[:, 0], x.valid[:, 0]
        batch, heads, _, dim = q.shape
        factors = self.bucket_factors()
        rotations = stored.get("lsh_rotations")
        if rotations is None and not self.key_centroids:
            rotations = self.draw_rotations(batch, self.num_hashes, factors, q.device)
        not_real = ~real[:, None, None, None]
        if self.member_mean_block is not None:
            *hashed, members = self._member_token(stored, q, k, x)
            stored.update(members)
        else:
            hashed = self._hash_token(q, k, rotations, factors)
        query_buckets, key_buckets = (buckets.masked_fill(not_real, math.prod(factors)) for buckets in hashed)
        decoded = seen - stored["lsh_sorted"].shape[-1]  # tokens stored since the prefill (a host number)
        candidates = self._recent_keys(stored, query_buckets, decoded)
        at = position.new_full((batch,), decoded)
        stored["lsh_new_buckets"] = write_at_rows(
            stored["lsh_new_buckets"], at,
            self._indexed_rounds(key_buckets).reshape(batch, -1, 1).to(stored["lsh_new_buckets"].dtype), decoded + 1)
        stored["lsh_new_positions"] = write_at_rows(
            stored["lsh_new_positions"], at, torch.where(real, position, -1).view(batch, 1, 1).int(), decoded + 1)
        leaving_k, leaving_v, _ = x.leaving  # the key at position - W, if there is one, goes to the store
        slot, room = (position - self.window_size).clamp(min=0), max(seen + 1 - self.window_size, 1)
        stored["lsh_keys"] = write_at_rows(stored["lsh_keys"], slot, leaving_k, room)
        stored["lsh_values"] = write_at_rows(stored["lsh_values"], slot, leaving_v, room)
        index = candidates.reshape(batch, heads, 1, -1)
        safe = index.clamp(0, stored["lsh_keys"].shape[2] - 1).flatten(2)  # a key still in the window: not far
        key_rows = grouped_rows(stored["lsh_keys"], safe)
        # the values' rows are the keys' unless the keys have a head per query head (shared QK)
        value_rows = key_rows if stored["lsh_values"].shape[1] == stored["lsh_keys"].shape[1] else \
            grouped_rows(stored["lsh_values"], safe)
        keys, values = (store.reshape(-1, store.shape[-1]).index_select(0, rows).view(batch, heads, 1, -1,
                                                                                      store.shape[-1])
                        for store, rows in ((stored["lsh_keys"], key_rows), (stored["lsh_values"], value_rows)))
        return FarOutput(*self._far_softmax(q, index, position[:, None, None, None], keys, values), stored)

    # -- reference --------------------------------------------------------------------------------------------------
    def reference(self, x: FarInputs) -> FarOutput:
        """Dense [L, L] form in the tokens' own order: per round, key j is a candidate of query i when LSH's window
        lists it (shared QK: same bucket within K sorted slots before, or within the neighbouring chunks; separate:
        one of the K most recent earlier keys in the query's bucket); the far keys listed in c_ij rounds get the
        logit s_ij + log(c_ij) (the rounds' log-sum-exp combination), or s_ij with the duplicate correction.
        Rotations are drawn as `parallel` draws them, or the buckets come from a replaying `recompute` (saved in
        left-aligned order)."""
        q, k, v, valid, recompute = x.q, x.k, x.v, x.valid, x.recompute
        if recompute is not None and recompute.replaying:
            order = left_align(valid)
            query_buckets, key_buckets = (
                restore_order(recompute.saved[name].transpose(2, 3), order).transpose(2, 3)
                for name in ("buckets", "key_buckets" if "key_buckets" in recompute.saved else "buckets"))
        else:
            query_buckets, key_buckets, _ = self._buckets(q, k, valid, None)
            if self.member_mean_block is not None:
                query_buckets = self._reference_member_probes(q, k, valid, x.position)
        key_buckets = self._per_query_head(key_buckets)
        m, before = self.chunk_length, self.chunks_before
        same = key_buckets[..., None, :] == query_buckets[..., :, None]  # [B, H, R, L(query), L(key)]
        if not self.shared_qk:  # the K most recent: fewer than K keys of the bucket lie between j and i
            earlier = same & torch.ones_like(same[0, 0, 0]).tril(-1) & valid[:, None, None, None, :]
            between = earlier.sum(-1, keepdim=True) - earlier.long().cumsum(-1)
            candidate = earlier & (between < before * m)
        elif self.attend_to == "chunk":
            slots = inverse_permutation(sort_by_bucket(query_buckets))  # [B, H, R, L]
            chunk_gap = slots[..., None, :] // m - slots[..., :, None] // m
            candidate = (chunk_gap >= -before) & (chunk_gap <= 0)
        else:
            slots = inverse_permutation(sort_by_bucket(query_buckets))
            slot_gap = slots[..., None, :] - slots[..., :, None]
            candidate = same & (slot_gap >= -before * m) & (slot_gap <= 0)
        rounds_listing = candidate.sum(dim=2)  # [B, H, L, L]
        if self.duplicate_correction:
            rounds_listing = rounds_listing.clamp(max=1)
        listed = x.far[:, None] & (rounds_listing > 0)
        keys = normalize_keys(k) if self.shared_qk else self.expand_kv(k)
        logits = (q @ keys.transpose(-1, -2)) * self.scale + rounds_listing.to(q.dtype).log()
        return FarOutput(*normalised_far(logits.masked_fill(~listed, float("-inf")), self.expand_kv(v)))


class SeparateQKLSHAttention(LSHFarPart.layer_class):
    """The "lsh" attention with `lsh_shared_qk=False` (what `LSHAttention` builds then): separate query and key
    projections, as a pretrained model has them, hashed apart with the same rotations. Each query attends, under one
    softmax of q·k / √d, to its own key and, in every round, to the K = lsh_num_chunks_before · lsh_chunk_length
    most recent earlier keys of its bucket. That is `lsh_window` with a window of one token (the query's own key, so
    no query is left without a key) and no sinks, so it shares its parallel, decoding and reference forms
    (docs/lsh_attention.md, §7): decoding keeps a KV cache's keys and values plus a bucket index of positions. Causal
    layers only (a key is hashed apart from its query, and only the earlier keys of a bucket are listed).
    `lsh_full_attention_threshold` is the shared-QK layers' rule for queries with few keys besides their own, which
    is penalised there; here a query's own key counts, so the threshold must be 0 (or None)."""

    name = "lsh"
    family_config = "ZooReformerSettings"

    def __init__(self, config, layer_idx: int, causal: bool):
        if not causal:
            raise ValueError("lsh_shared_qk=False: separate-QK 'lsh' layers are for causal (decoder) layers, since a "
                             "query lists only the earlier keys of its bucket; in encoders set lsh_shared_qk=True.")
        if config.lsh_full_attention_threshold not in (None, 0):
            raise ValueError(f"lsh_full_attention_threshold={config.lsh_full_attention_threshold!r} is invalid with "
                             "lsh_shared_qk=False in 'lsh' layers: the threshold gives queries full attention where "
                             "shared QK leaves them few keys besides their own (which it penalises); with separate "
                             "queries and keys every query attends to its own key, so set "
                             "lsh_full_attention_threshold=0 (or None).")
        super().__init__(config, layer_idx, causal)

    @classmethod
    def near_span(cls, config) -> tuple[int, int]:
        return 1, 0  # the near part is the query's own key


LSHAttention.separate_qk_layer = SeparateQKLSHAttention
