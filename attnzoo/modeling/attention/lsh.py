"""LSH attention (Reformer, seed 001 §2 and Appendix A), vectorised over batch, heads and hash rounds.

Per hash round r, every position t is hashed by angular LSH, h(x) = argmax([xR; -xR]) for a random rotation R drawn
per round and per (example, head); queries and keys are shared (k = q / |q|), so a query and its key share a bucket.
Positions are sorted by (bucket, position), the sorted sequence is cut into chunks of `lsh_chunk_length`, and each
chunk attends to itself and `lsh_num_chunks_before` (causal) or also `lsh_num_chunks_after` (bidirectional) of its
neighbours in that round, through `chunked.windowed_attention`. Within that window:
- `lsh_window="bucket"` (default): only keys of the query's own bucket (eq. 16) within `before * chunk_length`
  sorted positions before it (and `after * chunk_length` after it). The window slides with the query, so a causal
  query's keys depend on earlier tokens only (strictly causal) and decoding computes the same thing;
- `lsh_window="chunk"`: every key of the window is a candidate (the paper's P~, as in trax and transformers).
  Which earlier keys share a causal query's chunk then also depends on how later tokens hash, so a later token can
  change an earlier output (without any later value being attended).
Causal layers mask keys after the query (by original position); padded keys are never attended (they are hashed
to an extra bucket that sorts last); a token's own key gets the large finite penalty -1e5, so it is used only when
nothing else is allowed. Rounds are combined through their log-sum-exps (eq. 14). With `lsh_duplicate_correction`
the result is exactly a softmax over the union of the rounds' candidate sets: eq. 13-16 lower every score by
log(number of rounds in which that key is a candidate of that query), which `reference_forward` does; the fast
path gets the same softmax by attending to each key of the union in the first round that lists it only
(`WindowMask.round_locations`), which needs half the round comparisons and no logarithms.

Sequences of at most `lsh_full_attention_threshold` tokens get full shared-QK attention (same masks, no hashing).
In causal layers the rule is per position: the first `lsh_full_attention_threshold` positions of any sequence get
full causal attention (they have at most that many keys anyway), later ones LSH; so what a position computes never
depends on how long the sequence is, which keeps cached decoding exact.
Lengths that are not a multiple of the chunk length are padded inside the module and stripped again.

Reversible stacks: the first call stores the buckets and the sort order in `replay`; the backward recomputation
reads them back instead of hashing again (trax/layers/reversible.py: "for training stability").

Decoding with a cache (`LSHCacheLayer`): the rotations drawn at prefill are kept per sequence, so a new token is
hashed exactly like the cached keys. Each round keeps, per bucket, the indices of the `before * chunk_length` most
recent keys of that bucket; a new token attends to its own key and to those keys of its bucket in every round (a
softmax over the union with the duplicate correction, or over the concatenation without it). Per token this costs
O(rounds * chunk_length * head_dim), whatever the context length. This is exactly what `lsh_window="bucket"`
computes for the last token of a causal sequence, so with that window, fixed rotations (`lsh_hash_seed`) and a
fixed bucket count (`lsh_num_buckets`) cached decoding equals the full forward. With `lsh_window="chunk"` the
forward's window also holds the neighbouring buckets' keys that share the chunk, which decoding leaves out.
While the context is at most `lsh_full_attention_threshold` tokens, decoding attends to every cached key, as the
forward does at those positions. A step of several new tokens over a cache (assisted decoding) runs them one after
the other, since each must see the ones before it in its bucket lists.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.configuration.base import _fail, check_int, check_probability
from attnzoo.modeling.attention.base import ZooAttention, check_attention_mask, register_attention
from attnzoo.modeling.attention.chunked import WindowMask, mask_values, pad_to_multiple, windowed_attention
from attnzoo.modeling.cache import SelfManagedCacheLayer

#: Above this many buckets the default bucket count is factorised (trax does the same at 128), so the rotation
#: matrix and the rotated vectors stay small.
MAX_UNFACTORISED_BUCKETS = 128
LSH_WINDOWS = ("chunk", "bucket")


def normalize_keys(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit-length keys k = q / |q| for shared-QK attention, written as trax and transformers do it: the RMS-norm
    times 1/sqrt(d); the eps keeps a zero vector finite."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) / math.sqrt(x.shape[-1])


def default_bucket_factors(length: int, chunk_length: int) -> list[int]:
    """2 * length / chunk_length buckets (seed 001 §2), at least 2 and even; above `MAX_UNFACTORISED_BUCKETS` split
    into two even factors near its square root (their product can exceed the target by a little)."""
    target = max(2, 2 * math.ceil(length / chunk_length))
    if target <= MAX_UNFACTORISED_BUCKETS:
        return [target]
    first = 2 * math.ceil(math.sqrt(target) / 2)
    return [first, 2 * math.ceil(target / first / 2)]


def hash_buckets(vectors: torch.Tensor, rotations: torch.Tensor, factors: list[int]) -> torch.Tensor:
    """Angular LSH: [B, H, L, d] vectors, [B, H, R, d, sum(f/2)] rotations -> [B, H, R, L] buckets.

    Each factor f gets f/2 rotation columns and the bucket digit argmax([xR; -xR]); digits combine in mixed radix.
    """
    rotated = torch.einsum("bhld,bhrdf->bhrlf", vectors.detach(), rotations.to(vectors.dtype))
    buckets, offset, radix = None, 0, 1
    for factor in factors:
        part = rotated[..., offset:offset + factor // 2]
        # argmax over [xR; -xR] without building the concatenation: the largest of max(xR) and -min(xR).
        top, top_index = part.max(dim=-1)
        bottom, bottom_index = part.min(dim=-1)
        digit = torch.where(top >= -bottom, top_index, bottom_index + factor // 2)
        buckets = digit * radix if buckets is None else buckets + digit * radix
        offset += factor // 2
        radix *= factor
    return buckets


def sort_by_bucket(buckets: torch.Tensor) -> torch.Tensor:
    """The permutation sorting [..., L] buckets by (bucket, position): slot -> position."""
    length = buckets.shape[-1]
    positions = torch.arange(length, device=buckets.device)
    # Keys are unique, so any sort gives the stable order.
    return torch.argsort(buckets * length + positions, dim=-1)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """position -> slot, for a slot -> position permutation along the last dim."""
    slots = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, slots)


@register_attention("lsh")
class LSHAttention(ZooAttention):
    """Shared-QK multi-round LSH self-attention; see the module docstring for the exact definition."""

    required_config_fields = ("lsh_chunk_length", "lsh_num_chunks_before", "lsh_num_chunks_after",
                              "lsh_num_buckets", "lsh_num_hashes", "lsh_num_hashes_eval", "lsh_hash_seed",
                              "lsh_full_attention_threshold", "lsh_window", "lsh_duplicate_correction",
                              "lsh_attention_probs_dropout_prob", "reformer_head_size")
    family_config = "ZooReformerConfig"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.head_dim = config.reformer_head_size
        inner = self.num_heads * self.head_dim
        bias = config.attention_bias
        self.query_key = nn.Linear(self.hidden_size, inner, bias=bias)
        self.value = nn.Linear(self.hidden_size, inner, bias=bias)
        self.output = nn.Linear(inner, self.hidden_size, bias=bias)
        self.chunk_length = config.lsh_chunk_length
        self.chunks_before = config.lsh_num_chunks_before
        # A causal query has nothing to see in later chunks of the sorted order that its own chunk cannot show.
        self.chunks_after = 0 if causal else config.lsh_num_chunks_after
        self.num_buckets = config.lsh_num_buckets
        self.num_hashes_train = config.lsh_num_hashes
        self.num_hashes_eval = config.lsh_num_hashes_eval or config.lsh_num_hashes
        self.hash_seed = config.lsh_hash_seed
        self.eval_seed = config.eval_seed
        self.max_positions = config.max_position_embeddings
        threshold = config.lsh_full_attention_threshold
        self.full_attention_threshold = self.chunk_length if threshold is None else threshold
        self.window = config.lsh_window
        self.duplicate_correction = config.lsh_duplicate_correction
        rate = config.lsh_attention_probs_dropout_prob
        self.dropout = config.attention_probs_dropout_prob if rate is None else rate
        #: how many times `hash_vectors` ran (tests check the reversible backward reuses the forward's buckets)
        self.hash_calls = 0

    @classmethod
    def check_config(cls, config) -> None:
        for name in ("lsh_chunk_length", "lsh_num_hashes"):
            check_int(config, name, 1, "set a positive integer.")
        for name in ("lsh_num_chunks_before", "lsh_num_chunks_after"):
            check_int(config, name, 0, "set a non-negative integer (0 = no neighbouring chunks).")
        check_int(config, "lsh_num_hashes_eval", 1, "set a positive integer, or None to use lsh_num_hashes.",
                  optional=True)
        buckets = config.lsh_num_buckets
        factors = [buckets] if isinstance(buckets, int) and not isinstance(buckets, bool) else buckets
        if buckets is not None and (not isinstance(factors, list | tuple) or not factors or any(
                not isinstance(f, int) or isinstance(f, bool) or f < 2 or f % 2 for f in factors)):
            _fail("lsh_num_buckets", buckets, "set an even integer >= 2, a list of such factors, or None for "
                                              "2 * length / lsh_chunk_length.")
        check_int(config, "lsh_hash_seed", 0, "set a non-negative integer, or None to draw from the global RNG.",
                  optional=True)
        check_int(config, "lsh_full_attention_threshold", 0, "set a non-negative integer (0 = always hash), or None "
                                                             "for lsh_chunk_length.", optional=True)
        if config.lsh_window not in LSH_WINDOWS:
            _fail("lsh_window", config.lsh_window, f"use one of {LSH_WINDOWS}.")
        check_probability(config, "lsh_attention_probs_dropout_prob", optional=True)

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
        """[batch, heads, rounds, head_dim, sum(f/2)] Gaussian rotations, drawn in float32 whatever the model's dtype
        (so a bf16 model hashes like its float32 original). With a seed (`rotation_seed`, plus the layer index so
        layers differ) they come from a generator: `lsh_hash_seed` gives every example its own rotations as training
        does; the evaluation seed gives the whole batch one set, so an example's output does not depend on the batch
        it is in. Without a seed they come from the global RNG, one set per example."""
        seed = self.rotation_seed()
        shared = self.hash_seed is None and seed is not None
        shape = (1 if shared else batch, self.num_heads, num_hashes, self.head_dim, sum(f // 2 for f in factors))
        if seed is None:
            return torch.randn(shape, device=device)
        generator = torch.Generator(device=device).manual_seed(seed + self.layer_idx)
        rotations = torch.randn(shape, device=device, generator=generator)
        return rotations.expand(batch, -1, -1, -1, -1) if shared else rotations

    def hash_vectors(self, qk, rotations, factors, valid) -> torch.Tensor:
        """[B, H, R, L] buckets of the shared-QK vectors; padded positions (valid False) get the extra bucket."""
        self.hash_calls += 1
        buckets = hash_buckets(qk, rotations, factors)
        if valid is not None:
            buckets = buckets.masked_fill(~valid[:, None, None, :], math.prod(factors))
        return buckets

    def _project(self, hidden_states):
        return self.split_heads(self.query_key(hidden_states)), self.split_heads(self.value(hidden_states))

    @property
    def dropout_rate(self) -> float:
        return self.dropout if self.training else 0.0

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, hidden_states, attention_mask=None, past_key_values=None, replay=None, grid_size=None):
        batch, length, _ = hidden_states.shape
        cache = past_key_values.layers[self.layer_idx] if past_key_values is not None else None
        past = cache.get_seq_length() if cache is not None else 0
        key_mask = check_attention_mask(attention_mask, batch, past + length)
        qk, v = self._project(hidden_states)
        if past > 0:
            out = cache.decode(self, qk, v, None if key_mask is None else key_mask[:, past:])
        else:
            out = self._attend(qk, v, key_mask, replay, cache)
        return self.output(self.merge_heads(out))

    def _attend(self, qk, v, key_mask, replay, cache):
        """Attention over a whole sequence (no cached prefix); fills `cache` (prefill) when given."""
        batch, _, length, _ = qk.shape
        full = length <= self.full_attention_threshold
        # Inside a reversible recomputation (`replay` given) the backward follows at once: keep the probabilities.
        save_probs = replay is not None
        if full and cache is None:
            return self.full_attention(qk, v, key_mask)
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool, device=qk.device)
        valid = pad_to_multiple(valid, self.chunk_length, dim=1, value=False)
        factors = self.bucket_factors()
        qk_padded = pad_to_multiple(qk, self.chunk_length, dim=2)
        v_padded = pad_to_multiple(v, self.chunk_length, dim=2)
        if replay is not None and "buckets" in replay:
            buckets, order = replay["buckets"], replay["order"]
            if self.rotation_seed() is None:
                # Draw (and drop) the rotations again so the global RNG advances exactly as in the first call and
                # every later draw in this branch (dropout) repeats too.
                self.draw_rotations(batch, buckets.shape[2], factors, qk.device)
        else:
            rotations = self.draw_rotations(batch, self.num_hashes, factors, qk.device)
            buckets = self.hash_vectors(qk_padded, rotations, factors, valid)
            order = sort_by_bucket(buckets)
            if replay is not None:
                replay["buckets"], replay["order"] = buckets, order
            if cache is not None:
                cache.prefill(self, qk, v, buckets[..., :length], rotations, factors, valid[:, :length])
        if full:
            return self.full_attention(qk, v, key_mask)
        out = self.lsh_attention(qk_padded, v_padded, buckets, order, math.prod(factors), save_probs)[:, :, :length]
        threshold = self.full_attention_threshold
        if self.causal and threshold > 0:
            # Causal layers: the first `threshold` positions attend fully (to at most `threshold` keys).
            head = self.full_attention(qk[:, :, :threshold], v[:, :, :threshold],
                                       None if key_mask is None else key_mask[:, :threshold])
            out = torch.cat([head, out[:, :, threshold:]], dim=2)
        return out

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

    def lsh_attention(self, qk, v, buckets, order, num_buckets, save_probs=False):
        """Chunked multi-round attention over [B, H, Lp, d] vectors (Lp a multiple of the chunk length), given the
        [B, H, R, Lp] buckets (padding in bucket `num_buckets`) and their sort order."""
        batch, heads, padded, dim = qk.shape
        rounds = buckets.shape[2]
        m, before, after = self.chunk_length, self.chunks_before, self.chunks_after
        chunks = padded // m
        flat_order = order.reshape(batch, heads, rounds * padded, 1).expand(-1, -1, -1, dim)
        q_sorted = qk.gather(2, flat_order).view(batch * heads * rounds, chunks, m, dim)
        v_sorted = v.gather(2, flat_order).view(batch * heads * rounds, chunks, m, dim)
        sorted_buckets = buckets.gather(-1, order)
        slots = inverse_permutation(order)  # [B, H, R, Lp]: where each position sits in each round's sorted order

        def chunked(x):
            return x.reshape(batch * heads * rounds, chunks, m, *x.shape[4:])

        groups = chunked(sorted_buckets) if self.window == "bucket" else None
        round_locations, round_band = None, (0, 0)
        if self.duplicate_correction and rounds > 1:
            # Where every position sits in every round, read in each round's sorted order: [B, H, R, Lp, R'].
            if self.window == "chunk":
                locations, round_band = slots // m, (-before, after)
            else:
                locations, round_band = buckets * (2 * padded) + slots, (-before * m, after * m)
            per_position = locations.transpose(2, 3)  # [B, H, Lp, R']
            index = order.reshape(batch, heads, rounds * padded, 1).expand(-1, -1, -1, rounds)
            round_locations = chunked(per_position.gather(2, index).view(batch, heads, rounds, padded, rounds))
        mask = WindowMask(positions=chunked(order), valid=chunked(sorted_buckets != num_buckets), before=before,
                          after=after, causal=self.causal, self_penalty=True, groups=groups,
                          group_band=(-before * m, after * m), round_locations=round_locations,
                          round_band=round_band)
        out, lse = windowed_attention(q_sorted, normalize_keys(q_sorted), v_sorted, mask, 1.0, self.dropout_rate,
                                      save_probs)
        # Undo the sort of every round with one gather, then weight the rounds by softmax(lse) (eq. 14).
        flat_slots = (slots + torch.arange(rounds, device=qk.device)[:, None] * padded).reshape(
            batch, heads, rounds * padded)
        out = out.reshape(batch, heads, rounds * padded, dim).gather(2, flat_slots[..., None].expand(-1, -1, -1, dim))
        out = out.view(batch, heads, rounds, padded, dim)
        if rounds == 1:
            return out[:, :, 0]
        lse = lse.reshape(batch, heads, rounds * padded).gather(2, flat_slots).view(batch, heads, rounds, padded)
        weights = torch.softmax(lse, dim=2).unsqueeze(-1)
        return (out * weights).sum(dim=2)

    # -- reference ------------------------------------------------------------------------------------------
    def reference_forward(self, hidden_states, attention_mask=None, past_key_values=None, replay=None,
                          grid_size=None):
        """The same attention written out with dense [L, L] masks per round (no chunk layout, no sort tricks).

        Rotations are drawn exactly as `forward` draws them (same RNG use), or the buckets come from `replay`.
        """
        batch, length, _ = hidden_states.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        qk, v = self._project(hidden_states)
        valid = key_mask if key_mask is not None else torch.ones(batch, length, dtype=torch.bool, device=qk.device)
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

        factors = self.bucket_factors()
        if replay is not None and "buckets" in replay:
            buckets = replay["buckets"][..., :length]
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
            if self.window == "chunk":
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
        if self.causal:  # the first `full_attention_threshold` positions attend fully
            out = torch.where((positions < self.full_attention_threshold)[:, None], full_out, out)
        return self.output(self.merge_heads(out))

    def new_cache_layer(self):
        return LSHCacheLayer()


class LSHCacheLayer(SelfManagedCacheLayer):
    """Decoding state of one LSH layer: shared-QK vectors and values of every cached token (in buffers that grow
    by doubling), their buckets, the rotations of each sequence, and per (sequence, head, round, bucket) the
    indices of the most recent keys (see the module docstring)."""

    is_croppable = True

    # -- state ----------------------------------------------------------------------------------------------
    def _tensors(self) -> list[str]:
        return ["_key_buffer", "_value_buffer", "_bucket_buffer", "_valid_buffer", "rotations", "recent"]

    def _views(self):
        self.keys = self._key_buffer[:, :, :self.length]
        self.values = self._value_buffer[:, :, :self.length]

    def prefill(self, attn: LSHAttention, qk, v, buckets, rotations, factors, valid) -> None:
        self.lazy_initialization(qk, v)
        self.length = qk.shape[2]
        self.factors, self.num_buckets = list(factors), math.prod(factors)
        self.recent_size = attn.chunks_before * attn.chunk_length
        capacity = max(16, 2 * self.length)
        self._key_buffer = _grown(qk.detach(), capacity, dim=2)
        self._value_buffer = _grown(v.detach(), capacity, dim=2)
        self._bucket_buffer = _grown(buckets, capacity, dim=3)
        self._valid_buffer = _grown(valid, capacity, dim=1)
        self.rotations = rotations
        self.recent = self._recent_from_buckets(buckets)
        self._views()

    def _recent_from_buckets(self, buckets: torch.Tensor) -> torch.Tensor:
        """[B, H, R, buckets + 1, K] indices of each bucket's K most recent keys, oldest first, -1 where fewer."""
        batch, heads, rounds, length = buckets.shape
        k, num = self.recent_size, self.num_buckets + 1
        order = sort_by_bucket(buckets)
        sorted_buckets = buckets.gather(-1, order).contiguous()
        bucket_end = torch.searchsorted(sorted_buckets, sorted_buckets, right=True)
        from_end = bucket_end - 1 - torch.arange(length, device=buckets.device)
        keep = from_end < k
        column = torch.where(keep, sorted_buckets * k + (k - 1 - from_end), num * k)  # num * k: a dropped slot
        recent = buckets.new_full((batch, heads, rounds, num * k + 1), -1)
        recent.scatter_(-1, column, torch.where(keep, order, -1))
        return recent[..., :-1].reshape(batch, heads, rounds, num, k)

    def _append(self, qk, v, buckets, valid) -> None:
        if self.length + 1 > self._key_buffer.shape[2]:
            capacity = 2 * self._key_buffer.shape[2]
            self._key_buffer = _grown(self._key_buffer, capacity, dim=2)
            self._value_buffer = _grown(self._value_buffer, capacity, dim=2)
            self._bucket_buffer = _grown(self._bucket_buffer, capacity, dim=3)
            self._valid_buffer = _grown(self._valid_buffer, capacity, dim=1)
        t = self.length
        self._key_buffer[:, :, t:t + 1] = qk
        self._value_buffer[:, :, t:t + 1] = v
        self._bucket_buffer[..., t:t + 1] = buckets
        self._valid_buffer[:, t:t + 1] = valid
        self.length += 1
        self._views()

    def decode(self, attn: LSHAttention, qk, v, new_mask) -> torch.Tensor:
        """Attention of new tokens (one at a time: each must see the ones before it) over the cache."""
        outs = []
        for i in range(qk.shape[2]):  # usually one token; more only for multi-token steps (assisted decoding)
            valid = new_mask[:, i:i + 1] if new_mask is not None else torch.ones(
                qk.shape[0], 1, dtype=torch.bool, device=qk.device)
            outs.append(self._decode_one(attn, qk[:, :, i:i + 1], v[:, :, i:i + 1], valid))
        return torch.cat(outs, dim=2)

    def _decode_one(self, attn: LSHAttention, qk, v, valid) -> torch.Tensor:
        batch, heads, _, dim = qk.shape
        t = self.length
        buckets = hash_buckets(qk, self.rotations, self.factors)  # [B, H, R, 1]
        buckets = buckets.masked_fill(~valid[:, None, None, :], self.num_buckets)
        # Every token joins its buckets' recent lists, also while attention is still full, for the later tokens.
        rounds, k = buckets.shape[2], self.recent_size
        bucket_rows = buckets[..., None].expand(batch, heads, rounds, 1, k)
        previous = self.recent.gather(3, bucket_rows)  # [B, H, R, 1, K], before this token is added
        self.recent.scatter_(3, bucket_rows, torch.cat(
            [previous[..., 1:], previous.new_full((batch, heads, rounds, 1, 1), t)], dim=-1))
        self._append(qk, v, buckets, valid)
        if t + 1 <= attn.full_attention_threshold:
            keys, values = self.keys, self.values
            index = torch.arange(t + 1, device=qk.device).expand(batch, heads, t + 1)
            present = self._valid_buffer[:, None, :t + 1].expand(batch, heads, t + 1)
            counts = None
        else:
            candidates = torch.cat([previous[:, :, :, 0], previous.new_full((batch, heads, rounds, 1), t)], dim=-1)
            index = candidates.reshape(batch, heads, -1)  # [B, H, R * (K + 1)]
            present = index >= 0
            gather_index = index.clamp(min=0)[..., None].expand(-1, -1, -1, dim)
            keys = self._key_buffer.gather(2, gather_index)
            values = self._value_buffer.gather(2, gather_index)
            # The union over rounds counts a key once: log(number of rounds listing it), as eq. 16 does.
            counts = (index[..., :, None] == index[..., None, :]).sum(-1) if attn.duplicate_correction else None
        scores = (qk @ normalize_keys(keys).transpose(-1, -2)).squeeze(2)  # [B, H, n]
        masked_value, self_value = mask_values(scores.dtype)
        if counts is not None:
            scores = scores - counts.to(scores.dtype).log()
        scores = scores.masked_fill(~present, masked_value).masked_fill(index == t, self_value)
        return torch.softmax(scores, dim=-1).unsqueeze(2) @ values

    # -- generation utilities ----------------------------------------------------------------------------------
    def _map(self, fn) -> None:
        if self.length == 0:
            return
        for name in self._tensors():
            setattr(self, name, fn(getattr(self, name)))
        self._views()

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
        """Remove the last -n tokens for n = `tokens_to_remove` < 0, as transformers' cache layers do (a positive
        value, the legacy "final size", is refused there and here)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove.")
        if self.length == 0 or tokens_to_remove == 0:
            return
        new_length = self.length + tokens_to_remove
        self.length = max(new_length, 0)
        self.recent = self._recent_from_buckets(self._bucket_buffer[..., :self.length])
        self._views()

    def offload(self):
        self._map(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.length and self._key_buffer.device != self.device:
            self._map(lambda x: x.to(self.device, non_blocking=True))


def _grown(x: torch.Tensor, capacity: int, dim: int) -> torch.Tensor:
    """x copied into a buffer of `capacity` along `dim` (the tail is unused space)."""
    shape = list(x.shape)
    shape[dim] = capacity
    buffer = x.new_zeros(shape)
    buffer.narrow(dim, 0, x.shape[dim]).copy_(x)
    return buffer
