"""Every far key, exactly, as the far part of a windowed layer ("dense_window"): each query attends to its window and
sinks (`window_size`, `num_sink_tokens`) and to every earlier key beyond them, scored q·k / √d and normalised with
the window under one softmax (`windowed.WindowedAttention`).

With `far_positions="rotary"` (the default) this is exact causal softmax attention, split in two. What it is for is
the other far views: with `far_positions="fixed"` every far key sits at distance `window_size` (LM-Infinite, arXiv
2308.16137, §3, caps every distance at the training length; InfLLM, arXiv 2402.04617, §3.2, reads its far blocks at
one distance), with "grouped" at Self-Extend's grouped distances (arXiv 2401.01325, §3). A pretrained rotary model
then meets no distance it did not train on, and nothing is selected: the far part is the selecting far parts'
reference ("block_window", "lsh_window"), which shows what selection buys: as the prompt grows, the far keys
outnumber the window and the sinks, and with nothing selected their share of the softmax grows with their number,
while their cost and state grow as exact attention's (`benchmarks/pretrained_long_context.py` measures it on
SmolLM2 as `dense_fixed`).

It costs what exact attention costs, O(L²) scores a layer, and its decoding state holds every key that has left the
window, as a KV cache does. The parallel form scores groups of queries against the far keys the group's last query
reads (`SCORES_PER_GROUP` scores at a time), so that inference holds one group's scores at a time; with gradients
the graph keeps every group's probabilities, as exact attention without a fused kernel does.
"""

from __future__ import annotations

import math

import torch

from attnzoo.modeling.attention.windowed import FarInputs, FarOutput, FarPart, normalised_far, register_far_part
from attnzoo.modeling.cache import with_spare_tokens, write_at_rows

#: scores (batch x heads x queries x far keys) one group of queries holds in the parallel form, on the CPU (on
#: SmolLM2's shapes at 8K tokens, one thread, groups of 2^22 scores ran the far part faster than groups of 2^20 and
#: as fast as 2^23; the whole sequence at once would hold L² scores a head); off the CPU,
#: `SCORES_PER_GROUP_OFF_CPU` (a GPU gains nothing from small groups and would pay each group's launches)
SCORES_PER_GROUP = 1 << 22
SCORES_PER_GROUP_OFF_CPU = 1 << 27


@register_far_part("dense")
class DenseFarPart(FarPart):
    """Every far key, exactly; see the module docstring."""

    plain_kind = "full"

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor):
        """The far triple of queries q [B, H, Q, d] over keys k, v [B, kv, K, d|e] where `allowed` [B or 1, 1, Q, K]
        (the same for every head): [B, H, Q, e], [B, H, Q] twice. The query heads of a key-value head are scored
        as one matrix of g Q rows (one matmul against the head's keys, not a broadcast one, which would copy the
        keys for each query head)."""
        batch, heads, queries, dim = q.shape
        group = heads // self.num_kv_heads
        rows = q.reshape(batch, self.num_kv_heads, group * queries, dim)  # heads kv-major: h = kv * g + j
        logits = (rows @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # [B, kv, g Q, K]
        allowed = allowed.expand(-1, -1, queries, -1).repeat(1, 1, group, 1)  # [B or 1, 1, g Q, K]
        num, den, lse = normalised_far(logits.masked_fill(~allowed, float("-inf")), v)
        return num.reshape(batch, heads, queries, -1), den.reshape(batch, heads, queries), lse.reshape(
            batch, heads, queries)

    # -- the parallel form ------------------------------------------------------------------------------------------
    def parallel(self, x: FarInputs) -> FarOutput:
        q, k, v = x.q, x.k, x.v
        batch, heads, length, _ = q.shape
        window, sinks = self.window_size, self.sinks
        bound = SCORES_PER_GROUP if q.device.type == "cpu" else SCORES_PER_GROUP_OFF_CPU
        group = max(1, bound // max(1, batch * heads * max(length - window - sinks + 1, 1)))
        positions = torch.arange(length, device=q.device)
        parts = []
        for start in range(0, length, group):  # host bounds only: no device sync
            stop = min(start + group, length)
            reach = stop - window  # the far keys of the group's last query: positions sinks .. stop - 1 - W
            if reach <= sinks:  # no query of the group has a far key yet
                parts.append((q.new_zeros(batch, heads, stop - start, v.shape[-1]),
                              q.new_ones(batch, heads, stop - start),
                              q.new_full((batch, heads, stop - start), float("-inf"))))
                continue
            keys = positions[sinks:reach]
            allowed = keys <= positions[start:stop, None] - window  # [Q, K]; real: left-aligned rows
            parts.append(self._attend(q[:, :, start:stop], k[:, :, sinks:reach], v[:, :, sinks:reach],
                                      allowed[None, None]))
        num, den, lse = (torch.cat(part, 2) for part in zip(*parts, strict=True))
        state = self._start_state(x.k, x.v) if x.keep_state else None
        return FarOutput(num, den, lse, state)

    # -- decoding ---------------------------------------------------------------------------------------------------
    def _start_state(self, k: torch.Tensor, v: torch.Tensor) -> dict:
        """The keys and values that have left the window (positions below L - W of the left-aligned rows; the ring
        holds the rest), with spare slots for the steps to come."""
        gone = max(k.shape[2] - self.window_size, 0)
        return {"far_keys": with_spare_tokens(k[:, :, :gone]), "far_values": with_spare_tokens(v[:, :, :gone])}

    def step(self, x: FarInputs) -> FarOutput:
        """One new token per row: the key leaving its window joins the far keys (at its real position minus W); the
        token reads every far key, sinks .. its position - W."""
        stored, position = dict(x.state), x.position[:, 0]
        leaving_k, leaving_v, _ = x.leaving
        slot, room = (position - self.window_size).clamp(min=0), max(x.seen + 1 - self.window_size, 1)
        stored["far_keys"] = write_at_rows(stored["far_keys"], slot, leaving_k, room)
        stored["far_values"] = write_at_rows(stored["far_values"], slot, leaving_v, room)
        slots = torch.arange(stored["far_keys"].shape[2], device=position.device)
        allowed = (slots >= self.sinks) & (slots <= (position - self.window_size)[:, None])  # [B, N]
        return FarOutput(*self._attend(x.q, stored["far_keys"], stored["far_values"], allowed[:, None, None]),
                         stored)

    # -- reference --------------------------------------------------------------------------------------------------
    def reference(self, x: FarInputs) -> FarOutput:
        """One softmax over each query's far keys (`far` [B, L, L], the window rule's) in the tokens' own order."""
        logits = (x.q @ self.expand_kv(x.k).transpose(-1, -2)) / math.sqrt(self.head_dim)
        return FarOutput(*normalised_far(logits.masked_fill(~x.far[:, None], float("-inf")), self.expand_kv(x.v)))
