"""The near/far rule of every windowed attention, once (positions counted in real tokens; W = window, S = sinks)."""

from __future__ import annotations


# Positions count real tokens. A key at position p is NEAR a (causal) query at position i when it is in the query's
# window (0 <= i - p < W) or is one of the first S tokens (a sink, p < S); every other earlier real key is FAR. The
# exact window part attends to the near keys; a windowed layer's far part (FAVOR+, causal LARA, RA, LSH) to the far
# ones. Every layer, form (parallel, decoding, reference) and mask is written with these functions.
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
