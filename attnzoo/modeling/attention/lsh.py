"""LSH attention ("Reformer: The Efficient Transformer", Kitaev, Kaiser and Levskaya, arXiv 2001.04451, §2 and
Appendix A), vectorised over batch, heads and hash rounds.

Queries and keys are shared (k = q / |q|). In each hash round every position is hashed by angular LSH
(`lsh_hashing`), positions are sorted by (bucket, position), the sorted sequence is cut into chunks, and each chunk
attends to its neighbouring chunks through `attnzoo.ops.chunked_attention`; which keys among them a query may use is
set by `lsh_attend_to` (see `ZooReformerConfig`). A query's own key gets a large finite penalty, so it is used only
when nothing else is. Rounds are combined through their log-sum-exps, with the duplicate correction computed by
attending each key of the union in the first round that lists it. Short sequences (and, in causal layers, the first
`lsh_full_attention_threshold` positions) get full shared-QK attention. A reversible recomputation reuses the
forward's buckets. Decoding keeps what a KV cache keeps (every token's key and its unrepeated value) plus each key's
buckets as small integers, and finds a new token's candidates by comparing its buckets with the stored ones: a new
token costs O(rounds * (n + chunk_length * head_dim)) for n cached tokens, and equals the full forward with the
"bucket" window. The derivations and the exactness arguments are in docs/lsh_attention.md.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from attnzoo.modeling.attention.base import check_attention_mask, register_attention
from attnzoo.modeling.attention.chunked_attention import ChunkedAttention
from attnzoo.modeling.attention.counter_random import counter_normal
from attnzoo.modeling.attention.lsh_hashing import (
    default_bucket_factors,
    hash_buckets,
    inverse_permutation,
    most_recent_in_bucket,
    normalize_keys,
    sort_by_bucket,
)
from attnzoo.modeling.cache import StaticTokenBufferLayer, TokenBufferLayer
from attnzoo.ops.chunked_attention import ChunkMask, chunked_attention, mask_values, pad_to_multiple
from attnzoo.ops.triton_utils import resolve_backend


def new_token_index(cache: TokenBufferLayer, device) -> torch.Tensor:
    """The cache index a new token gets (the count of cached ones) as a 0-d long tensor of its own: a static slot's
    count is a tensor that `append()` moves on in place, so it is copied before the token is appended."""
    return torch.as_tensor(cache.get_seq_length(), device=device).clone()


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, d], index [B, H, n] -> [B, H, n, d] with out[b, h, i] = x[b, h, index[b, h, i]]: what
    `x.gather(2, index[..., None].expand(-1, -1, -1, d))` gives, bit for bit (gradient included), but as one
    `index_select` of whole d-vectors, several times faster on the CPU than an elementwise gather. Reads x in
    place when it is contiguous or a transposed [B, L, H, d] one (as `split_heads` gives), else copies it once."""
    batch, heads, length, dim = x.shape
    b = torch.arange(batch, device=x.device)[:, None, None]
    h = torch.arange(heads, device=x.device)[None, :, None]
    if not x.is_contiguous() and x.transpose(1, 2).is_contiguous():
        rows = (b * length + index) * heads + h  # rows of the [B, L, H] layout
        flat = x.transpose(1, 2).reshape(-1, dim)
    else:
        rows = (b * heads + h) * length + index
        flat = x.reshape(-1, dim)
    return flat.index_select(0, rows.reshape(-1)).view(*index.shape, dim)


def grouped_rows(store: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of `store` [B, kv_heads, N, d], flattened to [B * kv_heads * N, d], that each query head reads at
    `index` [B, H, ...] (head h reads key/value head h // (H / kv_heads)): a flat index for `index_select`."""
    batch, kv_heads, length = store.shape[:3]
    heads = index.shape[1]
    group = torch.arange(heads, device=index.device)[None, :, None] // (heads // kv_heads)
    row = torch.arange(batch, device=index.device)[:, None, None] * kv_heads + group
    return (row * length + index.flatten(2)).reshape(-1)


def gather_grouped(store: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """store [B, kv_heads, N, d] read at index [B, H, n] for each query head -> [B, H, n, d], without repeating the
    store (`rows`: `grouped_rows(store, index)`, when the caller has it). Whole rows are copied (`index_select` over
    the flattened store): an element-wise `gather` with the index expanded over d was several times slower."""
    rows = grouped_rows(store, index) if rows is None else rows
    return store.reshape(-1, store.shape[-1]).index_select(0, rows).view(*index.shape[:2], -1, store.shape[-1])


class LSHBuckets:
    """LSH's hashing and its multi-round bucket attention, for the "lsh" attention and the windowed layer's LSH far
    part: the settings (`read_lsh_settings`), the rotations, the buckets, `lsh_attention` and the decoding's bucket
    lists. Users provide `training`, `causal`, `num_heads`, `head_dim`, `layer_idx`, `chunk_length`,
    `chunks_before`, `chunks_after` and `dropout_rate`."""

    #: The `chunked_attention` backend of `lsh_attention` ("auto": the fused Triton kernels on CUDA). The fused
    #: kernels read the `ChunkMask` fields themselves; a user whose `window_mask` returns a mask that allows fewer
    #: keys through an overridden `ChunkMask.disallowed` (only the PyTorch path calls it) sets "torch".
    chunk_backend = "auto"
    #: With the "bucket" window a query's keys lie within `lsh_num_chunks_before` chunk lengths before it and
    #: `lsh_num_chunks_after` after it in the sorted order (the group band), so on the PyTorch path `lsh_attention`
    #: cuts every chunk into this many sub-chunks, each attending as many sub-chunks back and ahead: the same keys and
    #: the same softmax, over windows of (before + 1 / split + after) chunks instead of (before + 1 + after), about
    #: a quarter fewer scores with one chunk back. 1 keeps the chunk grid.
    bucket_window_split = 2

    def read_lsh_settings(self, config) -> None:
        self.num_buckets = config.lsh_num_buckets
        self.num_hashes_train = config.lsh_num_hashes
        self.num_hashes_eval = config.lsh_num_hashes_eval or config.lsh_num_hashes
        self.hash_seed = config.lsh_hash_seed
        self.eval_seed = config.eval_seed
        self.max_positions = config.max_position_embeddings
        self.attend_to = config.lsh_attend_to
        self.duplicate_correction = config.lsh_duplicate_correction

    # -- pieces ---------------------------------------------------------------------------------------------
    @property
    def num_hashes(self) -> int:
        return self.num_hashes_train if self.training else self.num_hashes_eval

    def bucket_factors(self) -> list[int]:
        """The bucket count's factors: `lsh_num_buckets`, or by default 2 * max_position_embeddings / chunk length.
        The count is fixed per model (not per input length), so a position's buckets do not depend on how long the
        sequence is and cached decoding hashes exactly as the full forward does."""
        if self.num_buckets is None:
            return default_bucket_factors(self.max_positions, self.chunk_length)
        return [self.num_buckets] if isinstance(self.num_buckets, int) else list(self.num_buckets)

    def rotation_seed(self) -> int | None:
        """The seed of this forward's rotations: `lsh_hash_seed` when set (training and evaluation), else
        `eval_seed` in evaluation mode; None means the global RNG (training draws new rotations every forward)."""
        if self.hash_seed is not None:
            return self.hash_seed
        return None if self.training else self.eval_seed

    def draw_rotations(self, batch: int, num_hashes: int, factors: list[int], device) -> torch.Tensor:
        """[batch, heads, rounds, head_dim, sum(f/2)] Gaussian rotations, in float32 whatever the model's dtype (so a
        bf16 model hashes like its float32 original). With a seed (`rotation_seed`, plus the layer index so layers
        differ) they are counter-based draws, deterministic and compile-friendly: `lsh_hash_seed` gives every example
        its own rotations as training does; the evaluation seed gives the whole batch one set, so an example's
        output does not depend on the batch it is in. Without a seed they come from the global RNG, one set per
        example."""
        seed = self.rotation_seed()
        shared = self.hash_seed is None and seed is not None
        shape = (1 if shared else batch, self.num_heads, num_hashes, self.head_dim, sum(f // 2 for f in factors))
        if seed is None:
            return torch.randn(shape, device=device)
        rotations = self._seeded_rotations(seed + self.layer_idx, shape, torch.device(device))
        return rotations.expand(batch, -1, -1, -1, -1) if shared else rotations

    def _seeded_rotations(self, seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """`counter_normal(seed, shape)`, kept from the last call in evaluation: decoding draws the evaluation
        rotations again at every step rather than storing them per sequence, and the draw (a hash and a Box-Muller
        transform of every entry) took most of a decoding step's time. Not kept in training (a new seed per forward
        with `lsh_hash_seed` unset) or while compiling (a compiled step computes it in its graph); an inference-mode
        draw is kept apart from a normal one, which autograd may save."""
        if self.training or torch.compiler.is_compiling():
            return counter_normal(seed, shape, device)
        key = (seed, shape, device, torch.is_inference_mode_enabled())
        kept = getattr(self, "_kept_rotations", None)
        if kept is None or kept[0] != key:
            kept = self._kept_rotations = (key, counter_normal(seed, shape, device))
        return kept[1]

    def rotations_recomputable(self) -> bool:
        """Whether the rotations are a function of the seed alone (evaluation with `eval_seed`, no `lsh_hash_seed`):
        decoding then draws them again instead of keeping them (at 1,024 buckets they are larger than the keys of
        the first thousands of tokens)."""
        return self.hash_seed is None and self.rotation_seed() is not None

    def bucket_index_dtype(self) -> torch.dtype:
        """The smallest integer dtype that holds every bucket index, the padding bucket included (what a decoding
        cache stores per key and round)."""
        return torch.int16 if math.prod(self.bucket_factors()) < torch.iinfo(torch.int16).max else torch.int32

    def hash_vectors(self, qk, rotations, factors, valid) -> torch.Tensor:
        """[B, H, R, L] buckets of the shared-QK vectors; padded positions (valid False) get the extra bucket."""
        buckets = hash_buckets(qk, rotations, factors)
        if valid is not None:
            buckets = buckets.masked_fill(~valid[:, None, None, :], math.prod(factors))
        return buckets

    def window_mask(self, **fields) -> ChunkMask:
        """The `ChunkMask` of `lsh_attention`'s chunks, from its fields; a subclass may allow fewer keys."""
        return ChunkMask(**fields)

    def _split_bucket_window(self, x) -> bool:
        """Whether `lsh_attention` cuts its chunks by `bucket_window_split`: "bucket" window, PyTorch path of
        `chunked_attention` on tensors like x, and no attention dropout (whose draws follow the window's shape)."""
        split = self.bucket_window_split
        if self.attend_to != "bucket" or split <= 1 or self.chunk_length % split or self.dropout_rate > 0.0:
            return False
        return self.chunk_backend == "torch" or (
            self.chunk_backend == "auto" and resolve_backend("auto", x, "chunked_attention") == "torch")

    def lsh_attention(self, qk, v, buckets, order, num_buckets, save_probs=False, return_lse=False, keys=None):
        """Chunked multi-round attention over [B, H, Lp, d] vectors (Lp a multiple of the chunk length), given the
        [B, H, R, Lp] buckets (padding in bucket `num_buckets`) and their sort order. With `return_lse`, also the
        [B, H, Lp] log-sum-exp of every query over all its rounds' keys (the log of the output's normaliser).
        `keys`: the vectors the keys are normalised from, when they are not the queries' (queries scaled by
        `far_query_scale`; same buckets)."""
        batch, heads, padded, dim = qk.shape
        rounds = buckets.shape[2]
        m, before, after = self.chunk_length, self.chunks_before, self.chunks_after
        band = (-before * m, after * m)  # the group band of the "bucket" window, in sorted slots
        if self._split_bucket_window(qk):  # the same band, over finer chunks (see `bucket_window_split`)
            split = self.bucket_window_split
            m, before, after = m // split, before * split, after * split
        chunks = padded // m
        flat_order = order.reshape(batch, heads, rounds * padded)
        q_sorted = gather_rows(qk, flat_order).view(batch * heads * rounds, chunks, m, dim)
        v_sorted = gather_rows(v, flat_order).view(batch * heads * rounds, chunks, m, dim)
        sorted_buckets = buckets.gather(-1, order)
        slots = inverse_permutation(order)  # [B, H, R, Lp]: where each position sits in each round's sorted order

        def chunked(x):
            return x.reshape(batch * heads * rounds, chunks, m, *x.shape[4:])

        groups = chunked(sorted_buckets) if self.attend_to == "bucket" else None
        round_locations, round_band = None, (0, 0)
        if self.duplicate_correction and rounds > 1:
            # Where every position sits in every round, read in each round's sorted order: [B, H, R, Lp, R'].
            if self.attend_to == "chunk":
                locations, round_band = slots // m, (-before, after)
            else:
                locations, round_band = buckets * (2 * padded) + slots, band
            per_position = locations.transpose(2, 3)  # [B, H, Lp, R']
            index = order.reshape(batch, heads, rounds * padded, 1).expand(-1, -1, -1, rounds)
            round_locations = chunked(per_position.gather(2, index).view(batch, heads, rounds, padded, rounds))
        mask = self.window_mask(positions=chunked(order), valid=chunked(sorted_buckets != num_buckets), before=before,
                                after=after, causal=self.causal, self_penalty=True, groups=groups,
                                group_band=band, round_locations=round_locations, round_band=round_band)
        k_sorted = q_sorted if keys is None else gather_rows(keys, flat_order).view_as(q_sorted)
        out, lse = chunked_attention(q_sorted, normalize_keys(k_sorted), v_sorted, mask, 1.0, self.dropout_rate,
                                      save_probs, backend=self.chunk_backend)
        # Undo the sort of every round with one gather, then weight the rounds by softmax(lse) (Appendix A).
        flat_slots = (slots + torch.arange(rounds, device=qk.device)[:, None] * padded).reshape(
            batch, heads, rounds * padded)
        out = gather_rows(out.reshape(batch, heads, rounds * padded, dim), flat_slots)
        out = out.view(batch, heads, rounds, padded, dim)
        if rounds == 1 and not return_lse:
            return out[:, :, 0]
        lse = lse.reshape(batch, heads, rounds * padded).gather(2, flat_slots).view(batch, heads, rounds, padded)
        if rounds == 1:
            return out[:, :, 0], lse[:, :, 0]
        weights = torch.softmax(lse, dim=2).unsqueeze(-1)
        combined = (out * weights).sum(dim=2)
        return (combined, lse.logsumexp(dim=2)) if return_lse else combined

    @property
    def recent_size(self) -> int:
        """Keys per bucket a new token can see in a round: its window reaches chunks_before chunks back."""
        return self.chunks_before * self.chunk_length


@register_attention("lsh")
class LSHAttention(LSHBuckets, ChunkedAttention):
    """Shared-QK multi-round LSH self-attention; see the module docstring. With `lsh_shared_qk=False` the layer built
    is `lsh_window.SeparateQKLSHAttention` (separate queries and keys, causal layers)."""

    #: the layer built for `lsh_shared_qk=False`: set by `lsh_window` (which builds on this module, so this module
    #: cannot import it), always imported with the package and with a checkpoint's code
    separate_qk_layer: ClassVar[type | None] = None

    def __new__(cls, config=None, *args, **kwargs):
        # copy.deepcopy and pickle call __new__ with no arguments, and then restore the instance's state
        if cls is LSHAttention and config is not None and not config.lsh_shared_qk:
            if cls.separate_qk_layer is None:
                raise ValueError("lsh_shared_qk=False: the separate-QK layer is defined in "
                                 "attnzoo.modeling.attention.lsh_window, which is not imported; import it.")
            return cls.separate_qk_layer(config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal, chunk_length=config.lsh_chunk_length,
                         chunks_before=config.lsh_num_chunks_before, chunks_after=config.lsh_num_chunks_after,
                         dropout=config.lsh_attention_probs_dropout_prob)
        # Shared QK has one head per query head; grouped-query models group the values only.
        self.query_key, self.value = self.projection(), self.projection(key_value=True)
        self.output = self.projection(into_heads=False)
        self.read_lsh_settings(config)
        threshold = config.lsh_full_attention_threshold
        self.full_attention_threshold = self.chunk_length if threshold is None else threshold

    def _project(self, hidden_states, position_ids=None, past: int = 0):
        """The shared query-key vectors (rotated in rotary models, before hashing: buckets then group vectors that
        are close in content and position alike) and the values, one per key-value head (`expand_kv` repeats them
        for their query-head groups where they are attended; the decoding cache keeps them unrepeated)."""
        qk = self.split_heads(self.query_key(hidden_states))
        qk = self.rotate(qk, self.rotation(position_ids, past, qk.shape[2], qk.device, qk.dtype))
        return qk, self.split_heads(self.value(hidden_states))

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, hidden_states, attention_mask=None, cache=None, recompute=None, position_ids=None):
        slot, past, decoding, key_mask = self.cached_inputs(hidden_states, attention_mask, cache)
        qk, v = self._project(hidden_states, position_ids, past)
        if decoding:
            out = self._decode(qk, v, key_mask, slot)
        else:
            out = self._attend(qk, v, key_mask, recompute, slot)
        return self.output(self.merge_heads(out))

    def _attend(self, qk, v, key_mask, recompute, cache):
        """Attention over a whole sequence (no cached prefix); fills `cache` (prefill) when given."""
        batch, heads, length, _ = qk.shape
        full = length <= self.full_attention_threshold
        grouped_v, v = v, self.expand_kv(v)
        if full and cache is None:
            return self.full_attention(qk, v, key_mask)
        replaying = recompute is not None and recompute.replaying
        valid = pad_to_multiple(self.all_real(key_mask, batch, length, qk.device), self.chunk_length, dim=1,
                                value=False)
        factors = self.bucket_factors()
        qk_padded = pad_to_multiple(qk, self.chunk_length, dim=2)
        v_padded = pad_to_multiple(v, self.chunk_length, dim=2)
        if replaying:  # the backward's recomputation reuses the forward's buckets
            buckets, order = recompute.saved["buckets"], recompute.saved["order"]
            if self.rotation_seed() is None:
                # Draw (and drop) the rotations again so the global RNG advances exactly as in the first call and
                # every later draw in this branch (dropout) repeats too.
                self.draw_rotations(batch, buckets.shape[2], factors, qk.device)
        else:
            rotations = self.draw_rotations(batch, self.num_hashes, factors, qk.device)
            buckets = self.hash_vectors(qk_padded, rotations, factors, valid)
            order = sort_by_bucket(buckets)
            if recompute is not None:
                recompute.saved.update(buckets=buckets, order=order)
            if cache is not None:
                # What a KV cache holds (keys and unrepeated values) plus each key's buckets as small indices
                # [B, H * R, L]; the rotations only when decoding cannot draw them again from the seed.
                buckets_real = buckets[..., :length].reshape(batch, heads * buckets.shape[2], length)
                sequence = {} if self.rotations_recomputable() else {"rotations": rotations}
                cache.start({"keys": (qk, 2), "values": (grouped_v, 2),
                             "buckets": (buckets_real.to(self.bucket_index_dtype()), 2),
                             "valid": (valid[:, :length], 1)}, **sequence,
                            lead=(valid[:, :length].long().cumsum(-1) == 0).sum(-1))
        if full:
            return self.full_attention(qk, v, key_mask)
        # On a recomputation the backward follows at once: keeping the probabilities costs no peak memory.
        out = self.lsh_attention(qk_padded, v_padded, buckets, order, math.prod(factors), save_probs=replaying)
        out = out[:, :, :length]
        if self.full_attention_threshold > 0 and (self.causal or key_mask is not None):
            out = self._threshold_positions_attend_fully(qk, v, key_mask, out)
        return out

    def _threshold_positions_attend_fully(self, qk, v, key_mask, out):
        """The full-attention rule of `lsh_full_attention_threshold` T, by real-token position (so a padded row gets
        what it would alone): in causal layers the first T real positions of every row attend fully (to at most T
        keys); in bidirectional layers a row of at most T real tokens attends fully. Either way the positions lie in
        the window of T positions from the row's first real token (real tokens are contiguous), so full attention
        over that window is cheap and needs no host sync; it replaces the hashed output there."""
        batch, heads, length, dim = qk.shape
        threshold = min(self.full_attention_threshold, length)
        valid = self.all_real(key_mask, batch, length, qk.device)
        n_real = valid.sum(-1)
        first = (valid.long().cumsum(-1) == 0).sum(-1)  # leading padding
        index = (first[:, None] + torch.arange(threshold, device=qk.device)).clamp(max=length - 1)  # [B, T]
        in_window = valid.gather(1, index) & (torch.arange(threshold, device=qk.device) < n_real[:, None])
        gather = index[:, None, :, None].expand(batch, heads, threshold, dim)
        window_out = self.full_attention(qk.gather(2, gather), v.gather(2, gather), in_window)
        # Added (not written) back: the window's masked slots add zeros wherever their clamped index points.
        full = torch.zeros_like(out).scatter_add(2, gather, window_out * in_window[:, None, :, None])
        covered = torch.zeros_like(valid).scatter_add(1, index, in_window)
        if not self.causal:
            covered = covered & (n_real <= self.full_attention_threshold)[:, None]
        return torch.where(covered[:, None, :, None], full, out)

    def full_attention(self, qk, v, key_mask):
        """Shared-QK attention over the whole sequence: the same masks, no hashing, one SDPA call.

        A query's own key gets the large finite penalty (added to its score, which is then negligible), so it is
        used only when nothing else is allowed; a query with no allowed key at all (padding) outputs zeros."""
        batch, heads, length, dim = qk.shape
        allowed = torch.ones(length, length, dtype=torch.bool, device=qk.device)
        if self.causal:
            allowed = allowed.tril()
        allowed = allowed.expand(batch, 1, length, length)
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, None, :].bool()
        has_key = allowed.any(-1, keepdim=True)  # [B, 1, L, 1]
        own_key = torch.eye(length, dtype=torch.bool, device=qk.device)
        bias = torch.zeros(allowed.shape, dtype=qk.dtype, device=qk.device).masked_fill(~allowed, float("-inf"))
        bias = bias.masked_fill(own_key & allowed, mask_values(qk.dtype)[1]).masked_fill(~has_key, 0.0)
        out = F.scaled_dot_product_attention(qk, normalize_keys(qk), v, attn_mask=bias, dropout_p=self.dropout_rate,
                                             scale=1.0)
        return out * has_key

    # -- decoding -------------------------------------------------------------------------------------------
    def new_cache_layer(self):
        return TokenBufferLayer()

    def new_static_cache_layer(self, max_cache_len: int):
        return StaticTokenBufferLayer(max_cache_len)

    def _decode(self, qk, v, new_mask, cache: TokenBufferLayer) -> torch.Tensor:
        """Attention of new tokens over the cache. Several new tokens (a step of assisted decoding) run one after
        the other, since each must see the ones before it in its buckets; generate() sends one."""
        outs = []
        for i in range(qk.shape[2]):
            valid = new_mask[:, i:i + 1] if new_mask is not None else self.all_real(None, qk.shape[0], 1, qk.device)
            outs.append(self._decode_one(qk[:, :, i:i + 1], v[:, :, i:i + 1], valid, cache))
        return torch.cat(outs, dim=2)

    def _decode_one(self, qk, v, valid, cache: TokenBufferLayer) -> torch.Tensor:
        """One new token: find the recent keys of its buckets, then attend to its own key and to those keys in every
        round (a softmax over the union with the duplicate correction)."""
        batch, heads, _, _ = qk.shape
        t = new_token_index(cache, qk.device)
        listed = self.join_buckets(qk, v, valid, cache)
        out = self._attend_to_cached(qk, listed.reshape(batch, heads, -1), t, cache, self.duplicate_correction)
        threshold = self.full_attention_threshold
        # The first `threshold` real positions of a row attend fully (as the forward does). A row's first real token
        # came in the prefill, so past `prefill length + threshold` no row is below the threshold: no check needed.
        # A static slot's count is a device tensor that a decode step must not read: it always takes the check.
        static = isinstance(cache, StaticTokenBufferLayer)
        if threshold > 0 and (static or t < cache.start_length + threshold):
            lead = cache.sequence["lead"]
            window = lead[:, None, None] + torch.arange(threshold, device=qk.device)  # [B, 1, T]
            window = torch.where(window <= t, window, -1).expand(batch, heads, threshold)
            full = self._attend_to_cached(qk, window, t, cache, correction=False)
            out = torch.where((t - lead < threshold)[:, None, None, None], full, out)
        return out

    def join_buckets(self, qk, v, valid, cache: TokenBufferLayer) -> torch.Tensor:
        """Hash one new token (cache index t) with the prefill's rotations, find the K most recent earlier keys of
        its bucket in every round among the cached buckets, and add the token to the cache; returns [B, H, R, K + 1]:
        their cache indices (-1 where there are fewer), then t itself. With the "bucket" window these are exactly
        the keys the full forward lists for the token: in the (bucket, position) order a causal query's window
        reaches K slots back, which inside its bucket are its K most recent bucket-mates."""
        batch, heads, _, _ = qk.shape
        t = new_token_index(cache, qk.device)
        factors = self.bucket_factors()
        rotations = cache.sequence.get("rotations")
        if rotations is None:
            rotations = self.draw_rotations(batch, self.num_hashes, factors, qk.device)
        buckets = hash_buckets(qk, rotations, factors)  # [B, H, R, 1]
        buckets = buckets.masked_fill(~valid[:, None, None, :], math.prod(factors))
        rounds = buckets.shape[2]
        stored = cache.tokens("buckets")
        previous = most_recent_in_bucket(stored.view(batch, heads, rounds, stored.shape[-1]), buckets, t,
                                         self.recent_size)
        cache.append(keys=qk, values=v, buckets=buckets.reshape(batch, heads * rounds, 1).to(stored.dtype),
                     valid=valid)
        return torch.cat([previous, t.expand(batch, heads, rounds, 1)], dim=-1)

    def _attend_to_cached(self, qk, index, t, cache: TokenBufferLayer, correction: bool) -> torch.Tensor:
        """Shared-QK attention of the new token (cache index t) over the cached keys at `index` [B, H, n] (-1: none),
        its own key penalised; with `correction`, a key listed in several rounds counts once: log(number of rounds
        listing it) (Appendix A). The values are read from their key-value head (`gather_grouped`)."""
        dim = qk.shape[-1]
        safe = index.clamp(min=0)
        present = (index >= 0) & cache.tokens("valid").gather(1, safe.flatten(1)).view_as(safe)
        keys = cache.tokens("keys").gather(2, safe[..., None].expand(-1, -1, -1, dim))
        # the whole buffer (its spare rows are never indexed): a view of its first tokens would be copied to flatten
        values = gather_grouped(cache.buffers["values"], safe)
        scores = (qk @ normalize_keys(keys).transpose(-1, -2)).squeeze(2)  # [B, H, n]
        masked_value, self_value = mask_values(scores.dtype)
        if correction:
            counts = (index[..., :, None] == index[..., None, :]).sum(-1)
            scores = scores - counts.to(scores.dtype).log()
        scores = scores.masked_fill(~present, masked_value).masked_fill(index == t, self_value)
        return torch.softmax(scores, dim=-1).unsqueeze(2) @ values

    # -- reference ------------------------------------------------------------------------------------------
    def reference_forward(self, hidden_states, attention_mask=None, cache=None, recompute=None, position_ids=None):
        """The same attention written out with dense [L, L] masks per round (no chunk layout, no sort tricks), and
        the duplicate correction as the paper writes it: every score lowered by log(number of rounds in which the
        key is a candidate of the query) (Appendix A).

        Rotations are drawn exactly as `forward` draws them (same RNG use), or the buckets come from a replaying
        `recompute`.
        """
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        qk, v = self._project(hidden_states, position_ids)
        v = self.expand_kv(v)
        valid = self.all_real(key_mask, batch, length, qk.device)
        keys = normalize_keys(qk)
        scores = qk @ keys.transpose(-1, -2)  # [B, H, L, L]
        positions = torch.arange(length, device=qk.device)
        allowed = valid[:, None, None, :].expand(batch, 1, length, length)
        if self.causal:
            allowed = allowed & (positions[None, :] <= positions[:, None])
        is_self = positions[None, :] == positions[:, None]
        masked_value, self_value = mask_values(scores.dtype)
        full_scores = scores.masked_fill(~allowed, masked_value).masked_fill(is_self, self_value)
        full_out = full_scores.softmax(-1) @ v
        if length <= self.full_attention_threshold:
            return self.output(self.merge_heads(full_out))
        # The full-attention rule counts real tokens: positions within a row, and a row's length.
        real_position = (valid.long().cumsum(-1) - 1)[:, None, :, None]
        short_row = (valid.sum(-1) <= self.full_attention_threshold)[:, None, None, None]

        factors = self.bucket_factors()
        if recompute is not None and recompute.replaying:
            buckets = recompute.saved["buckets"][..., :length]
        else:
            rotations = self.draw_rotations(batch, self.num_hashes, factors, qk.device)
            buckets = hash_buckets(qk, rotations, factors).masked_fill(~valid[:, None, None, :], math.prod(factors))
        # Slots of the (bucket, position) order; chunk padding would sort after every real slot, so it changes none.
        slots = inverse_permutation(sort_by_bucket(buckets))  # [B, H, R, L]
        m, before = self.chunk_length, self.chunks_before
        after = self.chunks_after
        candidate = []  # per round: [B, H, L, L] "key j is in query i's window in round r"
        for r in range(buckets.shape[2]):
            s, b = slots[:, :, r], buckets[:, :, r]
            if self.attend_to == "chunk":
                gap = s[..., None, :] // m - s[..., :, None] // m
                candidate.append((gap >= -before) & (gap <= after))
            else:
                gap = s[..., None, :] - s[..., :, None]
                same = b[..., None, :] == b[..., :, None]
                candidate.append(same & (gap >= -before * m) & (gap <= after * m))
        candidate = torch.stack(candidate, dim=2)  # [B, H, R, L, L]
        allowed_r = candidate & allowed[:, :, None]
        count = candidate.sum(dim=2, keepdim=True).clamp(min=1).to(scores.dtype)
        scores_r = scores[:, :, None].expand_as(allowed_r)
        if self.duplicate_correction:
            scores_r = scores_r - count.log()
        scores_r = scores_r.masked_fill(~allowed_r, masked_value).masked_fill(is_self, self_value)
        lse = scores_r.logsumexp(-1)  # [B, H, R, L]
        out_r = (scores_r - lse[..., None]).exp() @ v[:, :, None]
        out = (out_r * lse.softmax(dim=2)[..., None]).sum(dim=2)
        if self.causal:  # the first `full_attention_threshold` real positions attend fully
            out = torch.where(real_position < self.full_attention_threshold, full_out, out)
        else:  # a row of at most `full_attention_threshold` real tokens attends fully
            out = torch.where(short_row, full_out, out)
        return self.output(self.merge_heads(out))

