"""Block retrieval as the far part of a windowed layer ("block_window"): each query attends exactly to its window and
sinks, and to the far keys of a few blocks chosen by content, under one normalisation (`windowed.WindowedAttention`).

InfLLM ("InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient Context Memory", arXiv
2402.04617, §3.2) keeps a pretrained model's far keys in blocks of consecutive tokens, scores each block by
representative keys, and lets a query read only the top-k blocks, exactly; with every far key at one distance (its
`far_positions="fixed"` here) the model meets no distance it did not train on. Here, with positions counted in real
tokens, W = `window_size`, S = `num_sink_tokens`, b = `block_size` and k = `block_topk`:

- far-key block m holds the keys at positions S + m b .. S + (m + 1) b - 1; its representative is its mean key;
- query block t holds the queries at positions t b .. (t + 1) b - 1; it may select the M_t = floor((t b - W - S + 1)
  / b) blocks whose every key is far from its first query, and selects the k of them whose representatives score
  highest against its selection query σ_t = q_{t b} + Σ_{t b - b <= p < t b} q_p (its first query and the block
  before it: only earlier tokens, so the layer stays causal and decoding selects as the full forward does);
- query i of block t reads, beyond its window and sinks, every key of the selected blocks and every far key not in
  a selectable block (positions S + M_t b .. i - W: fewer than 2b, the keys that left the window since its block
  began), scored q·k / √d and normalised together (`normalised_far`).

A query thus reads at most (k + 2) b far keys at any length. InfLLM selects per chunk of queries with
representative tokens chosen by the attention they receive; the mean key (as Quest and landmark methods score a
block by one vector) keeps the state to the keys, the values and one sum per block. Where InfLLM's prefill chunks
would let a query's selection depend on later queries of its chunk, σ_t reads only tokens up to the block's first
query.

The parallel form gathers each query block's selected blocks and its tail from the left-aligned keys and scores its
queries against them, in groups of query blocks bounded by `BLOCK_PAIRS` (memory: at 32K tokens the whole sequence
would need gigabytes of gathered keys and scores). Decoding keeps, beside the window's ring, the keys and values that
have left the window (as a KV cache does, once), one key sum per block, the running query sums and the current
selection: a new token costs O(number of blocks · d + (k + 2) b · d).
"""

from __future__ import annotations

import math

import torch

from attnzoo.modeling.attention.lsh import gather_grouped
from attnzoo.modeling.attention.windowed import FarInputs, FarOutput, FarPart, normalised_far, register_far_part
from attnzoo.modeling.cache import with_room, with_spare_tokens, write_at_rows

#: (query, key) scores one group of query blocks computes at once in the parallel form: a memory bound (256 MB of
#: float32 scores, and as many gathered keys and values per head width of 64)
BLOCK_PAIRS = 1 << 26


def selectable_blocks(block_start: torch.Tensor, window: int, sinks: int, size: int) -> torch.Tensor:
    """M: the far-key blocks a query block starting at real position `block_start` may select, those whose every key
    is far from its first query (S + (m + 1) b - 1 <= start - W)."""
    return torch.div(block_start - window - sinks + 1, size, rounding_mode="floor").clamp(min=0)


def top_blocks(scores: torch.Tensor, selectable: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, chosen) [..., k]: the `topk` highest of `scores` [..., n] among the first `selectable` [...] blocks
    (broadcast); `chosen` is False where fewer were selectable."""
    blocks = torch.arange(scores.shape[-1], device=scores.device)
    scores = scores.masked_fill(blocks >= selectable.unsqueeze(-1), float("-inf"))
    if scores.shape[-1] < topk:
        scores = torch.nn.functional.pad(scores, (0, topk - scores.shape[-1]), value=float("-inf"))
    best = scores.topk(topk, dim=-1)
    return best.indices, torch.isfinite(best.values)


@register_far_part("block")
class BlockFarPart(FarPart):
    """Block retrieval beyond the window; see the module docstring."""

    family_config = "ZooBlockRetrievalSettings"

    def __init__(self, layer, config):
        super().__init__(layer, config)
        self.size, self.topk = config.block_size, config.block_topk

    def _key_positions(self, chosen_blocks, chosen, tail_start):
        """(positions [..., k b] of the chosen blocks' keys, which of them are read, positions [..., 2b] of the tail
        from `tail_start` [...]); the caller allows a tail key up to each query's latest far position."""
        size = self.size
        offsets = torch.arange(size, device=chosen_blocks.device)
        in_blocks = (self.sinks + chosen_blocks.unsqueeze(-1) * size + offsets).flatten(-2)
        block_ok = chosen.unsqueeze(-1).expand(*chosen.shape, size).flatten(-2)
        return in_blocks, block_ok, tail_start.unsqueeze(-1) + torch.arange(2 * size, device=tail_start.device)

    # -- the parallel form ------------------------------------------------------------------------------------------
    def parallel(self, x: FarInputs) -> FarOutput:
        q, k, v = x.q, x.k, x.v
        batch, heads, length, dim = q.shape
        size, window, sinks = self.size, self.window_size, self.sinks
        query_blocks = -(-length // size)
        padded = query_blocks * size
        q_blocks = torch.nn.functional.pad(q, (0, 0, 0, padded - length)).view(batch, heads, query_blocks, size, dim)
        block_sums = q_blocks.sum(3)
        before = torch.cat([torch.zeros_like(block_sums[:, :, :1]), block_sums[:, :, :-1]], 2)
        selection_query = q_blocks[:, :, :, 0] + before  # σ_t [B, H, T, d]

        key_sums = self._key_block_sums(k)  # [B, kv, n, d]
        reps = self.expand_kv(key_sums) / size
        starts = torch.arange(query_blocks, device=q.device) * size
        selectable = selectable_blocks(starts, window, sinks, size)  # [T]
        chosen_blocks, chosen = top_blocks(selection_query @ reps.transpose(-1, -2), selectable, self.topk)

        positions = torch.arange(padded, device=q.device).view(query_blocks, size)
        in_blocks, block_ok, tail = self._key_positions(chosen_blocks, chosen, sinks + selectable * size)
        tail_ok = tail.unsqueeze(-2) <= (positions - window).unsqueeze(-1)  # [T, b, 2b]
        index = torch.cat([in_blocks, tail.expand(batch, heads, -1, -1)], -1)  # [B, H, T, n]
        allowed = torch.cat([block_ok.unsqueeze(-2).expand(-1, -1, -1, size, -1),
                             tail_ok.expand(batch, heads, -1, -1, -1)], -1)  # [B, H, T, b, n]
        index = index.clamp(0, length - 1)
        per_block = heads * size * index.shape[-1]
        group = max(1, BLOCK_PAIRS // max(per_block * batch, 1))
        outputs = [self._attend(q_blocks[:, :, t:t + group], k, v, index[:, :, t:t + group],
                                allowed[:, :, t:t + group]) for t in range(0, query_blocks, group)]
        num, den, lse = (torch.cat(parts, 2).flatten(2, 3)[:, :, :length] for parts in zip(*outputs, strict=True))
        state = self._start_state(q_blocks, k, v, x.n_real, chosen_blocks, chosen) if x.keep_state else None
        return FarOutput(num, den, lse, state)

    def _key_block_sums(self, k, real_far=None):
        """[B, kv, n, d] sums of the keys of each far-key block (positions S + m b ..), over `real_far` [B, L] keys
        only when given."""
        batch, kv_heads, length, dim = k.shape
        far = k[:, :, self.sinks:]
        if real_far is not None:
            far = far * real_far[:, None, self.sinks:, None]
        blocks = max(-(-far.shape[2] // self.size), 1)
        far = torch.nn.functional.pad(far, (0, 0, 0, blocks * self.size - far.shape[2]))
        return far.view(batch, kv_heads, blocks, self.size, dim).sum(3)

    def _attend(self, q_blocks, k, v, index, allowed):
        """The far triple of query blocks q_blocks [B, H, G, b, d] over the keys at `index` [B, H, G, n] (positions
        in k, v [B, kv, L, ·]) where `allowed` [B, H, G, b, n]."""
        batch, heads, group, size, _ = q_blocks.shape
        flat = index.flatten(2)
        keys = gather_grouped(k, flat).view(batch, heads, group, -1, k.shape[-1])
        values = gather_grouped(v, flat).view(batch, heads, group, -1, v.shape[-1])
        logits = (q_blocks @ keys.transpose(-1, -2)) / math.sqrt(self.head_dim)
        return normalised_far(logits.masked_fill(~allowed, float("-inf")), values)

    # -- decoding ---------------------------------------------------------------------------------------------------
    def _start_state(self, q_blocks, k, v, n_real, chosen_blocks, chosen):
        """The keys and values that have left the window (positions below L - W; the ring holds the rest), the key
        sums of the far keys each row's last token saw, the query sums of its block and the block before, and the
        selection its block made."""
        window = self.window_size
        length = k.shape[2]
        gone = max(length - window, 0)
        positions = torch.arange(length, device=k.device)
        last = n_real - 1  # [B]; -1 for a row without real tokens
        real_far = (positions[None] >= self.sinks) & (positions[None] <= (last - window)[:, None])
        batch, heads, blocks, size, dim = q_blocks.shape
        real_query = (torch.arange(blocks * size, device=k.device)[None] <= last[:, None]).view(batch, 1, blocks,
                                                                                               size, 1)
        real_sums = (q_blocks * real_query).sum(3)  # [B, H, T, d]
        current = last.clamp(min=0) // size  # the block of each row's last token
        rows = torch.arange(batch, device=k.device)
        has_tokens = (n_real > 0)[:, None, None]
        cur = torch.where(has_tokens, real_sums[rows, :, current], 0.0)
        prev = torch.where(has_tokens & (current > 0)[:, None, None], real_sums[rows, :, (current - 1).clamp(min=0)],
                           0.0)
        return dict(block_keys=with_spare_tokens(k[:, :, :gone]), block_values=with_spare_tokens(v[:, :, :gone]),
                    block_key_sums=with_spare_tokens(self._key_block_sums(k, real_far)),
                    block_query_sum=cur, block_query_sum_before=prev,
                    block_selection=chosen_blocks[rows, :, current],
                    block_selected=chosen[rows, :, current] & has_tokens)

    def step(self, x: FarInputs) -> FarOutput:
        """One new token per row: its leaving key joins the store and its block's sum; a real token that opens a
        query block selects anew; the token reads the selected blocks and the tail."""
        stored, q, seen = dict(x.state), x.q, x.seen
        position, real = x.position[:, 0], x.valid[:, 0]
        size, window, sinks = self.size, self.window_size, self.sinks
        leaving_k, leaving_v, joins = x.leaving
        slot, room = (position - window).clamp(min=0), max(seen + 1 - window, 1)
        stored["block_keys"] = write_at_rows(stored["block_keys"], slot, leaving_k, room)
        stored["block_values"] = write_at_rows(stored["block_values"], slot, leaving_v, room)

        needed = max((seen - window - sinks) // size + 1, 1)
        sums = with_room(stored["block_key_sums"], needed)  # before reading the joining key's block
        block = torch.div((position - window - sinks).clamp(min=0), size, rounding_mode="floor")
        current = sums.gather(2, block.view(-1, 1, 1, 1).expand(-1, sums.shape[1], 1, sums.shape[3]))
        stored["block_key_sums"] = sums = write_at_rows(sums, block, current + leaving_k * joins[:, None, None, None],
                                                        needed)

        query = q[:, :, 0]  # [B, H, d]
        opens = (real & (position % size == 0))[:, None, None]
        before = torch.where(opens, stored["block_query_sum"], stored["block_query_sum_before"])
        stored["block_query_sum_before"] = before
        stored["block_query_sum"] = torch.where(opens, 0.0, stored["block_query_sum"]) + query * real[:, None, None]
        block_start = position - position % size
        selectable = selectable_blocks(block_start, window, sinks, size)  # [B]
        reps = self.expand_kv(sums) / size
        new_blocks, new_chosen = top_blocks((reps @ (before + query).unsqueeze(-1)).squeeze(-1),
                                            selectable[:, None], self.topk)
        chosen_blocks = torch.where(opens, new_blocks, stored["block_selection"])
        chosen = torch.where(opens, new_chosen, stored["block_selected"])
        stored["block_selection"], stored["block_selected"] = chosen_blocks, chosen

        batch, heads = q.shape[:2]
        in_blocks, block_ok, tail = self._key_positions(chosen_blocks, chosen, sinks + selectable * size)
        tail_ok = tail <= (position - window).unsqueeze(-1)  # [B, 2b]
        index = torch.cat([in_blocks, tail[:, None].expand(-1, heads, -1)], -1)  # [B, H, n]
        allowed = torch.cat([block_ok, tail_ok[:, None].expand(-1, heads, -1)], -1)
        index = index.clamp(0, stored["block_keys"].shape[2] - 1)
        keys = gather_grouped(stored["block_keys"], index)  # [B, H, n, d]
        values = gather_grouped(stored["block_values"], index)
        logits = (keys @ query.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.head_dim)
        return FarOutput(*normalised_far(logits.masked_fill(~allowed, float("-inf")).unsqueeze(-2), values), stored)

    # -- reference --------------------------------------------------------------------------------------------------
    def reference(self, x: FarInputs) -> FarOutput:
        """Dense [L, L] form in the tokens' own order, positions counted in real tokens: each query's selection query
        and each block's mean key as masked sums, the chosen blocks by `topk` over every block, and the far keys it
        reads as a mask (`far` [B, L, L], the window rule's) -> one softmax over them."""
        q, k, v, valid, far = x.q, x.k, x.v, x.valid, x.far
        size, window, sinks = self.size, self.window_size, self.sinks
        position = valid.long().cumsum(-1) - 1  # [B, L]
        start = position - position % size  # each query's block start
        key_pos = position[:, None, :]
        opens_or_before = (key_pos == start[:, :, None]) | ((key_pos >= start[:, :, None] - size) &
                                                            (key_pos < start[:, :, None]))
        reads = (opens_or_before & valid[:, None, :]).to(q.dtype)  # [B, L(query), L(token)]
        selection_query = reads[:, None] @ q  # [B, H, L, d]
        blocks = q.shape[2] // size + 1
        key_block = torch.div(position - sinks, size, rounding_mode="floor")  # [B, L]
        member = (key_block[:, :, None] == torch.arange(blocks, device=q.device)) & valid[:, :, None] & \
            (position >= sinks)[:, :, None]  # [B, L, n]
        reps = self.expand_kv(member.transpose(1, 2).to(k.dtype)[:, None] @ k) / size  # [B, H, n, d]
        selectable = selectable_blocks(start, window, sinks, size)  # [B, L]
        chosen_blocks, chosen = top_blocks(selection_query @ reps.transpose(-1, -2), selectable[:, None], self.topk)
        picked = torch.zeros(*chosen_blocks.shape[:3], blocks + 1, dtype=torch.bool, device=q.device)
        picked.scatter_(-1, torch.where(chosen, chosen_blocks, blocks), True)  # unchosen slots to a spare column
        key_in_picked = picked[..., :blocks].gather(-1, key_block.clamp(min=0)[:, None, None, :].expand(
            -1, q.shape[1], q.shape[2], -1))  # [B, H, L, L]
        in_tail = key_pos >= (sinks + selectable * size)[:, :, None]  # [B, L, L]
        reads_far = far[:, None] & (key_in_picked | in_tail[:, None])
        logits = (q @ self.expand_kv(k).transpose(-1, -2)) / math.sqrt(self.head_dim)
        return FarOutput(*normalised_far(logits.masked_fill(~reads_far, float("-inf")), self.expand_kv(v)))
