"""Angular locality-sensitive hashing for the Reformer's LSH attention ("Reformer: The Efficient Transformer",
arXiv 2001.04451, §2): bucket counts, hashing, the (bucket, position) sort, and the search for a bucket's most
recent keys that cached decoding does."""

from __future__ import annotations

import math

import torch

#: Above this many buckets the default bucket count is factorised (trax does the same at 128), so the rotation
#: matrix and the rotated vectors stay small.
MAX_UNFACTORISED_BUCKETS = 128


def normalize_keys(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit-length keys k = q / |q| for shared-QK attention, written as trax and transformers do it: the RMS-norm
    times 1/sqrt(d); the eps keeps a zero vector finite."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) / math.sqrt(x.shape[-1])


def default_bucket_factors(length: int, chunk_length: int) -> list[int]:
    """2 * length / chunk_length buckets (§2 of the paper), at least 2 and even; above `MAX_UNFACTORISED_BUCKETS` split
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


def most_recent_in_bucket(stored: torch.Tensor, buckets: torch.Tensor, before, keep: int) -> torch.Tensor:
    """[B, H, R, min(keep, N)] positions of the `keep` most recent keys before position `before` (a 0-d tensor or
    [B, 1, 1, 1]) whose bucket in a round is the new token's `buckets` [B, H, R, 1], most recent first, -1 where
    there are fewer; `stored` [B, H, R, N] holds every cached key's buckets by position. One comparison per cached
    key and round (O(R * N) per token) instead of per-bucket lists of recent keys: an [R, buckets, keep] table per
    head whatever the length, which at the Reformer's default bucket count held more than the keys and values of the
    first thousands of tokens (4.3x a KV cache at 1,024 tokens)."""
    # compared in the stored dtype (int16: no converted copy of every stored index) and ranked as int32 positions
    slots = torch.arange(stored.shape[-1], device=stored.device, dtype=torch.int32)
    listed = torch.where((stored == buckets.to(stored.dtype)) & (slots < before), slots, -1)
    return listed.topk(min(keep, listed.shape[-1]), dim=-1).values.long()
