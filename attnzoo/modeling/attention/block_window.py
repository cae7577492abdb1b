"""Block retrieval as the far part of a windowed layer ("block_window"): each query attends exactly to its window and
sinks, and to the far keys of a few blocks chosen by content, under one normalisation (`windowed.WindowedAttention`).

InfLLM ("InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient Context Memory", arXiv
2402.04617, §3.2) keeps a pretrained model's far keys in blocks of consecutive tokens, scores each block by
representative keys, and lets a query read only the top-k blocks, exactly; with every far key at one distance (its
`far_positions="fixed"` here) the model meets no distance it did not train on. Here, with positions counted in real
tokens, W = `window_size`, S = `num_sink_tokens`, b = `block_size`, k = `block_topk` and s = `block_query_size`
(b when not set; a divisor of b):

- far-key block m holds the keys at positions S + m b .. S + (m + 1) b - 1; its representative is its mean key;
- query block t holds the queries at positions t s .. (t + 1) s - 1; it may select the M_t = floor((t s - W - S + 1)
  / b) blocks whose every key is far from its first query, and selects the k of them whose representatives score
  highest against its selection query σ_t = q_{t s} + Σ_{t s - b <= p < t s} q_p (its first query and the b queries
  before it: only earlier tokens, so the layer stays causal and decoding selects as the full forward does);
- query i of block t reads, beyond its window and sinks, every key of the selected blocks and every far key not in
  a selectable block (positions S + M_t b .. i - W: fewer than s + b <= 2b, the keys that left the window since its
  block began), scored q·k / √d and normalised together (`normalised_far`).

The query block sets how recent the selecting tokens are. A prompt's last token, whose logits give the answer's
first token, selects with σ of its own query block; with s = b = 32 and a question of ten tokens at the end of the
block, σ is the block's first query and the block before, filler only, and on SmolLM2 at 16K (teacher-forced) the
key blocks then miss the first layers' selection and the answer's first token loses to " a"; a prompt one token
longer, whose last token opens a block and selects with the question, answers. A smaller s lets the latest tokens
select at the cost of gathering the chosen keys once per s queries instead of once per b.

A query thus reads fewer than (k + 2) b far keys at any length. InfLLM selects per chunk of queries with
representative tokens chosen by the attention they receive; the mean key (as Quest and landmark methods score a
block by one vector) keeps the state to the keys, the values and one sum per block. Where InfLLM's prefill chunks
would let a query's selection depend on later queries of its chunk, σ_t reads only tokens up to the block's first
query.

The parallel form gathers each query block's selected blocks and its tail (blocks M_t and M_t + 1) from the
left-aligned keys as whole blocks and scores its queries against them, in groups of query blocks bounded by
`GATHERED_KEYS` (the whole sequence at 32K tokens would need gigabytes of gathered keys and scores; a group that
fits the CPU's caches runs several times faster than one that does not; off the CPU, `GATHERED_KEYS_OFF_CPU`).
With gradients on, the groups run outside autograd's graph and the backward pass gathers each group again and
differentiates it alone (`_GroupedFarTriple`), so that it holds one group's gathered keys at a time and the graph
holds one node for the far part, not one per operation and group.
Decoding keeps, beside the window's ring, the keys and values that have left the window (as a KV cache does,
once), one key sum per block, the running query sums and the current selection: a new token costs O(number of
blocks · d + (k + 2) b · d).

With `block_key_bits` / `block_value_bits` set, the far keys / values are stored in 8 or 4 bits an entry, one scale
and offset per token and head (`kv_quantisation`): decoding keeps the codes and reads back the gathered ones, and
every form reads all far keys and values, and takes the block sums, as the store holds them (`round_trip`), so
decoding still equals the full forward (up to a key that a step computes a rounding error away from the full
forward's and that rounds to the next level: `kv_quantisation`). The blocks are chosen by the mean of the stored
keys, so a near tie may choose another block than unquantised; each key and value read is within half a
quantisation step of the computed one, and the window and sinks stay exact.
"""

from __future__ import annotations

import math

import torch

from attnzoo.modeling.attention.kv_quantisation import dequantise, quantise, round_trip
from attnzoo.modeling.attention.lsh import gather_grouped, grouped_rows
from attnzoo.modeling.attention.windowed import FarInputs, FarOutput, FarPart, normalised_far, register_far_part
from attnzoo.modeling.cache import with_room, with_spare_tokens, write_at_rows

#: keys (and as many values) one group of query blocks gathers at once in the parallel form: a bound that keeps the
#: gathered keys, values and scores of a group in the CPU's caches (on SmolLM2's shapes at 16K tokens, groups of
#: 2^14 gathered keys ran the far part several times faster than groups of 2^22, which live in memory)
GATHERED_KEYS = 1 << 14
#: the same bound off the CPU: a GPU gains nothing from cache-sized groups and would pay each group's launches (at
#: 128K tokens, 2^14 keys a group would be some 10^4 groups a layer)
GATHERED_KEYS_OFF_CPU = 1 << 22

#: the decoding state's entries of the far keys and values: (the vectors, or their codes; their ranges when quantised)
STORES = {"key": ("block_keys", "block_key_ranges"), "value": ("block_values", "block_value_ranges")}


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


class _GroupedFarTriple(torch.autograd.Function):
    """`BlockFarPart._groups` with gradients: the forward pass runs outside autograd's graph and keeps only its
    inputs; the backward pass gathers each group's blocks again, differentiates that group alone and adds its key and
    value gradients into the blocks' rows.

    Activation checkpointing per group (`torch.utils.checkpoint`) kept no gathered keys either, but left the graph
    nodes of each group's operations alive until the backward pass: small allocations made between each group's
    megabytes of gathered keys, which on glibc's allocator kept the freed megabytes from being reused (gigabytes a
    layer at a few thousand tokens on converted SmolLM2, where each group gathers some 5 MB)."""

    @staticmethod
    def forward(ctx, part, group, q_blocks, key_blocks, value_blocks, read, chosen, tail_ok):
        ctx.part, ctx.group = part, group
        device = q_blocks.device.type  # the backward pass recomputes under the forward's autocast, as it computed
        ctx.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                            dtype=torch.get_autocast_dtype(device))
        ctx.save_for_backward(q_blocks, key_blocks, value_blocks, read, chosen, tail_ok)
        num, den, lse = part._groups(group, q_blocks, key_blocks, value_blocks, read, chosen, tail_ok)
        ctx.mark_non_differentiable(den)
        return num, den, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_num, _grad_den, grad_lse):
        q_blocks, key_blocks, value_blocks, read, chosen, tail_ok = ctx.saved_tensors
        wanted = ctx.needs_input_grad[2:5]  # q_blocks, key_blocks, value_blocks
        # every query block's gradient is written once; the blocks' rows accumulate over the groups that read them
        grads = [make(x) if want else None for x, want, make in zip(
            (q_blocks, key_blocks, value_blocks), wanted, (torch.empty_like, torch.zeros_like, torch.zeros_like),
            strict=True)]
        blocks = key_blocks.detach(), value_blocks.detach()
        for t in range(0, q_blocks.shape[2], ctx.group):
            span = slice(t, t + ctx.group)
            index = read[:, :, span].flatten(2)
            rows = grouped_rows(key_blocks, index)  # the rows of the blocks its key and value gradients go to
            with torch.enable_grad(), torch.autocast(**ctx.autocast):
                q = q_blocks[:, :, span].detach().requires_grad_(wanted[0])
                keys, values = (gather_grouped(x, index, rows).requires_grad_(want)
                                for x, want in zip(blocks, wanted[1:], strict=True))
                num, _, lse = ctx.part._attend_gathered(q, keys, values, chosen[:, :, span], tail_ok[span])
                inputs = [x for x, want in zip((q, keys, values), wanted, strict=True) if want]
                outputs = [(x, grad[:, :, span]) for x, grad in ((num, grad_num), (lse, grad_lse))
                           if x.requires_grad]  # lse does not depend on the values
                found = iter(torch.autograd.grad([x for x, _ in outputs], inputs, [grad for _, grad in outputs]))
            if wanted[0]:
                grads[0][:, :, span] = next(found)
            for i in (1, 2):
                if wanted[i]:
                    grads[i].view(-1, grads[i].shape[-1]).index_add_(0, rows, next(found).flatten(0, 2))
        return None, None, *grads, None, None, None


@register_far_part("block")
class BlockFarPart(FarPart):
    """Block retrieval beyond the window; see the module docstring."""

    family_config = "ZooBlockRetrievalSettings"

    def __init__(self, layer, config):
        super().__init__(layer, config)
        self.size, self.topk = config.block_size, config.block_topk
        self.query_size = config.block_query_size or config.block_size
        self.lookback = self.size // self.query_size  # query blocks before a block's first query that select
        self.bits = {"key": config.block_key_bits, "value": config.block_value_bits}

    def _as_read(self, what: str, x: torch.Tensor) -> torch.Tensor:
        """Keys or values x (`what`: "key" or "value") as the far part reads them: as its store holds them."""
        return round_trip(x, self.bits[what])

    def _stored(self, what: str, x: torch.Tensor) -> dict:
        """The state entries that hold keys or values x [B, kv, N, e]: x itself, or its codes and ranges."""
        name, ranges = STORES[what]
        if self.bits[what] is None:
            return {name: x}
        codes, scales = quantise(x, self.bits[what])
        return {name: codes, ranges: scales}

    def _read_stored(self, stored: dict, what: str, index: torch.Tensor) -> torch.Tensor:
        """The keys or values of the state `stored` at index [B, H, n] -> [B, H, n, e] (`gather_grouped`)."""
        name, ranges = STORES[what]
        x = gather_grouped(stored[name], index)
        if self.bits[what] is None:
            return x
        return dequantise(x, gather_grouped(stored[ranges], index), self.bits[what])

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
        q, k, v = x.q, self._as_read("key", x.k), self._as_read("value", x.v)
        batch, heads, length, dim = q.shape
        size, window, sinks, qsize = self.size, self.window_size, self.sinks, self.query_size
        query_blocks = -(-length // qsize)
        padded = query_blocks * qsize
        q_blocks = torch.nn.functional.pad(q, (0, 0, 0, padded - length)).view(batch, heads, query_blocks, qsize, dim)
        block_sums = q_blocks.sum(3)
        selection_query = q_blocks[:, :, :, 0] + self._sums_before(block_sums)  # σ_t [B, H, T, d]

        # every far key in whole blocks, with 2 zero blocks past the last so that a tail block always exists
        key_blocks, value_blocks = (self._far_blocks(x_, 2) for x_ in (k, v))  # [B, kv, n + 2, b * d|e]
        key_sums = key_blocks.view(*key_blocks.shape[:3], size, dim).sum(3)  # the 2 spare blocks: never selectable
        reps = self.expand_kv(key_sums) / size
        starts = torch.arange(query_blocks, device=q.device) * qsize
        selectable = selectable_blocks(starts, window, sinks, size)  # [T]
        chosen_blocks, chosen = top_blocks(selection_query @ reps.transpose(-1, -2), selectable, self.topk)

        # the tail (far keys past the selectable blocks) is blocks M_t and M_t + 1: every key a query block reads
        # is in k + 2 whole blocks, gathered as rows of b keys
        read = torch.cat([chosen_blocks, (selectable + torch.arange(2, device=q.device)[:, None]).T.expand(
            batch, heads, -1, -1)], -1)  # [B, H, T, k + 2]
        read = read.clamp(0, key_blocks.shape[2] - 1)
        positions = torch.arange(padded, device=q.device).view(query_blocks, qsize)
        tail = sinks + selectable[:, None] * size + torch.arange(2 * size, device=q.device)  # [T, 2b]
        tail_ok = tail.unsqueeze(-2) <= (positions - window).unsqueeze(-1)  # [T, s, 2b]
        bound = GATHERED_KEYS if q.device.type == "cpu" else GATHERED_KEYS_OFF_CPU
        group = max(1, bound // (batch * heads * read.shape[-1] * size))
        inputs = (q_blocks, key_blocks, value_blocks, read, chosen, tail_ok)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            num, den, lse = _GroupedFarTriple.apply(self, group, *inputs)
        else:
            num, den, lse = self._groups(group, *inputs)
        num, den, lse = (x.flatten(2, 3)[:, :, :length] for x in (num, den, lse))
        state = self._start_state(q_blocks, x.k, x.v, k, x.n_real, chosen_blocks, chosen) if x.keep_state else None
        return FarOutput(num, den, lse, state)

    def _sums_before(self, block_sums):
        """[B, H, T, d]: for each query block, the sum of the b queries before it (the `lookback` query blocks before
        it in `block_sums` [B, H, T, d], zero before the first)."""
        lookback, blocks = self.lookback, block_sums.shape[2]
        earlier = torch.nn.functional.pad(block_sums, (0, 0, lookback, 0))[:, :, :blocks + lookback - 1]
        if lookback == 1:
            return earlier
        return earlier.unfold(2, lookback, 1).sum(-1)

    def _key_block_sums(self, k, real_far=None):
        """[B, kv, n, d] sums of the keys of each far-key block (positions S + m b ..), over `real_far` [B, L] keys
        only when given."""
        if real_far is not None:
            k = k * real_far[:, None, :, None]
        blocks = self._far_blocks(k, int(k.shape[2] <= self.sinks))  # one block of zeros when none is far yet
        return blocks.view(*blocks.shape[:3], self.size, k.shape[-1]).sum(3)

    def _far_blocks(self, x, spare: int):
        """x [B, kv, L, e] from the first far position on, zero-padded into whole blocks with `spare` more: [B, kv,
        n + spare, b * e] (a block per row, for `gather_grouped`)."""
        batch, kv_heads, _, width = x.shape
        far = x[:, :, self.sinks:]
        blocks = -(-far.shape[2] // self.size) + spare
        far = torch.nn.functional.pad(far, (0, 0, 0, blocks * self.size - far.shape[2]))
        return far.reshape(batch, kv_heads, blocks, self.size * width)

    def _groups(self, group, q_blocks, key_blocks, value_blocks, read, chosen, tail_ok):
        """The far triple of every query block, `group` query blocks at a time (`_attend`): [B, H, T, s, e], [B, H,
        T, s] twice."""
        outputs = [self._attend(q_blocks[:, :, t:t + group], key_blocks, value_blocks, read[:, :, t:t + group],
                                chosen[:, :, t:t + group], tail_ok[t:t + group])
                   for t in range(0, q_blocks.shape[2], group)]
        return tuple(torch.cat(parts, 2) for parts in zip(*outputs, strict=True))

    def _attend(self, q_blocks, key_blocks, value_blocks, read, chosen, tail_ok):
        """The far triple of query blocks q_blocks [B, H, G, s, d] over the far-key blocks `read` [B, H, G, k + 2]
        (rows of key_blocks, value_blocks [B, kv, n, b * ·]; the last two: the tail), the first k where `chosen`
        [B, H, G, k], the tail's keys where `tail_ok` [G, s, 2b]."""
        keys, values = (gather_grouped(blocks, read.flatten(2)) for blocks in (key_blocks, value_blocks))
        return self._attend_gathered(q_blocks, keys, values, chosen, tail_ok)

    def _attend_gathered(self, q_blocks, keys, values, chosen, tail_ok):
        """`_attend` from the gathered blocks keys, values [B, H, G (k + 2), b * ·]."""
        batch, heads, group, qsize, dim = q_blocks.shape
        keys = keys.view(batch, heads, group, -1, dim)
        values = values.view(batch, heads, group, keys.shape[3], -1)
        logits = (q_blocks @ keys.transpose(-1, -2)) / math.sqrt(self.head_dim)  # [B, H, G, s, (k + 2) b]
        block_ok = chosen.repeat_interleave(self.size, -1)[:, :, :, None]  # [B, H, G, 1, k b]
        allowed = torch.cat([block_ok.expand(-1, -1, -1, qsize, -1),
                             tail_ok.expand(batch, heads, -1, -1, -1)], -1)
        return normalised_far(logits.masked_fill(~allowed, float("-inf")), values)

    # -- decoding ---------------------------------------------------------------------------------------------------
    def _start_state(self, q_blocks, k, v, k_read, n_real, chosen_blocks, chosen):
        """The keys and values that have left the window (positions below L - W; the ring holds the rest), as stored,
        the key sums of the far keys each row's last token saw (of `k_read`, the keys as read), the query sums of its
        block and the block before, and the selection its block made."""
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
        current = last.clamp(min=0) // self.query_size  # the query block of each row's last token
        rows = torch.arange(batch, device=k.device)
        has_tokens = (n_real > 0)[:, None, None]
        cur = torch.where(has_tokens, real_sums[rows, :, current], 0.0)
        earlier = current[:, None] - self.lookback + torch.arange(self.lookback, device=k.device)  # [B, r], oldest 1st
        prev = real_sums[rows[:, None], :, earlier.clamp(min=0)].transpose(1, 2)  # [B, H, r, d]
        prev = torch.where(has_tokens[..., None] & (earlier >= 0)[:, None, :, None], prev, 0.0)
        stores = {**self._stored("key", k[:, :, :gone]), **self._stored("value", v[:, :, :gone])}
        return dict({name: with_spare_tokens(x) for name, x in stores.items()},
                    block_key_sums=with_spare_tokens(self._key_block_sums(k_read, real_far)),
                    block_query_sum=cur, block_query_sums_before=prev,
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
        for name, x_ in {**self._stored("key", leaving_k), **self._stored("value", leaving_v)}.items():
            stored[name] = write_at_rows(stored[name], slot, x_, room)
        leaving_k = self._as_read("key", leaving_k)

        needed = max((seen - window - sinks) // size + 1, 1)
        sums = with_room(stored["block_key_sums"], needed)  # before reading the joining key's block
        block = torch.div((position - window - sinks).clamp(min=0), size, rounding_mode="floor")
        current = sums.gather(2, block.view(-1, 1, 1, 1).expand(-1, sums.shape[1], 1, sums.shape[3]))
        stored["block_key_sums"] = sums = write_at_rows(sums, block, current + leaving_k * joins[:, None, None, None],
                                                        needed)

        query = q[:, :, 0]  # [B, H, d]
        opens = (real & (position % self.query_size == 0))[:, None, None]
        earlier = stored["block_query_sums_before"]  # [B, H, r, d]: the last r finished query blocks' sums
        shifted = torch.cat([earlier[:, :, 1:], stored["block_query_sum"][:, :, None]], 2)
        stored["block_query_sums_before"] = earlier = torch.where(opens[..., None], shifted, earlier)
        stored["block_query_sum"] = torch.where(opens, 0.0, stored["block_query_sum"]) + query * real[:, None, None]
        block_start = position - position % self.query_size
        selectable = selectable_blocks(block_start, window, sinks, size)  # [B]
        reps = self.expand_kv(sums) / size
        new_blocks, new_chosen = top_blocks((reps @ (earlier.sum(2) + query).unsqueeze(-1)).squeeze(-1),
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
        keys = self._read_stored(stored, "key", index)  # [B, H, n, d]
        values = self._read_stored(stored, "value", index)
        logits = (keys @ query.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.head_dim)
        return FarOutput(*normalised_far(logits.masked_fill(~allowed, float("-inf")).unsqueeze(-2), values), stored)

    # -- reference --------------------------------------------------------------------------------------------------
    def reference(self, x: FarInputs) -> FarOutput:
        """Dense [L, L] form in the tokens' own order, positions counted in real tokens: each query's selection query
        and each block's mean key as masked sums, the chosen blocks by `topk` over every block, and the far keys it
        reads as a mask (`far` [B, L, L], the window rule's) -> one softmax over them."""
        q, k, v, valid, far = x.q, self._as_read("key", x.k), self._as_read("value", x.v), x.valid, x.far
        size, window, sinks, qsize = self.size, self.window_size, self.sinks, self.query_size
        position = valid.long().cumsum(-1) - 1  # [B, L]
        start = position - position % qsize  # each query's block start
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
