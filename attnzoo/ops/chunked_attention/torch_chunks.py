"""Chunked attention with neighbouring-chunk windows: the batching device shared by LSH and local attention.

Queries come in chunks of `m` consecutive positions of some order (the hash-sorted order for LSH, the sequence
for local attention); each chunk attends to the keys of its own chunk, of `before` chunks before it and of `after`
chunks after it (Reformer, arXiv 2001.04451, §2 and Figure 2d). Which of those keys a query may really use is described
by a `ChunkMask` of small per-position integer tensors, from which the dense [m, window] masks are built on demand.

`chunked_attention` (through the autograd Function `ChunkedAttentionFunction`) returns the output and the log-sum-exp of
every query, with the gradients of both (LSH combines hash rounds through the log-sum-exp, Reformer Appendix A).
Its backward either recomputes the scores (the [chunks, m, window] tensors then exist only transiently, as in flash
attention) or, with `save_probs`, keeps the probabilities: the reversible stack recomputes a layer and
backpropagates through it at once, so there keeping them costs no extra peak memory and saves a recomputation.

Masked scores are -inf and a query's own key (shared-QK) gets the large finite penalty -1e5 (as trax does),
so a token attends to itself only when nothing else is allowed; a row with no allowed key at all (padding) gets
zero probabilities and a log-sum-exp of -1e9, so everything stays finite. (A large finite value for the masked
scores would give the same numbers, but exp() of very negative inputs is several times slower on CPU.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: (masked, self) score values: the floor of a row's log-sum-exp when nothing is allowed, and the penalty of a
#: query's own key. Half precision needs values it can represent.
MASK_VALUES = {torch.float16: (-1e4, -1e3)}
DEFAULT_MASK_VALUES = (-1e9, -1e5)


def mask_values(dtype: torch.dtype) -> tuple[float, float]:
    """(masked, self) score values for a dtype."""
    return MASK_VALUES.get(dtype, DEFAULT_MASK_VALUES)


def neighbour_chunks(x: torch.Tensor, before: int, after: int, fill=0, rest_dims: int = 0) -> torch.Tensor:
    """[..., C, m, *rest] chunks (`rest_dims` trailing feature dims) -> [..., C, (before + 1 + after) * m, *rest]:
    each chunk's neighbourhood, from `before` chunks back to `after` ahead, with `fill` beyond the ends (no
    wrap-around). Used for the per-position mask inputs; keys and values use `_flat_windows` views."""
    if before == 0 and after == 0:
        return x
    chunk_dim = x.dim() - 2 - rest_dims
    item_dim = chunk_dim + 1
    num_chunks, m = x.shape[chunk_dim], x.shape[item_dim]
    shape = list(x.shape)
    shape[item_dim] = (before + 1 + after) * m
    out = x.new_empty(shape)
    # Block `offset` of chunk c is chunk c + offset - before: one copy of each block, `fill` past the ends.
    for offset in range(before + 1 + after):
        shift = offset - before
        block = out.narrow(item_dim, offset * m, m)
        lo, hi = max(0, -shift), min(num_chunks, num_chunks - shift)
        if hi > lo:
            block.narrow(chunk_dim, lo, hi - lo).copy_(x.narrow(chunk_dim, lo + shift, hi - lo))
        if lo > 0:
            block.narrow(chunk_dim, 0, min(lo, num_chunks)).fill_(fill)
        if hi < num_chunks:
            block.narrow(chunk_dim, max(hi, 0), num_chunks - max(hi, 0)).fill_(fill)
    return out


@dataclass
class ChunkMask:
    """Which window keys each query may attend to, from per-position tensors in chunk layout.

    Shapes use N (flattened batch dims), C chunks of m queries, and W = (before + 1 + after) * m window keys.
    - positions [N, C, m]: original sequence positions (causality).
    - valid [N, C, m]: real keys (False for padding).
    - causal: a query sees keys at positions <= its own.
    - self_penalty: a query's own key (the diagonal of its own chunk's block) gets the self value instead of its
      score (shared-QK attention).
    - groups [N, C, m] with group_band=(lo, hi): a query sees only keys of its own group (bucket) whose offset in the
      window order (key slot - query slot) lies in [lo, hi] (LSH's "bucket" window).
    - round_locations [N, C, m, R] with round_band=(lo, hi), for rows of R hash rounds (N = groups * R, the round
      innermost): a key is a candidate of the query in round r when lo <= loc_r(key) - loc_r(query) <= hi; a
      row of round r drops the keys that were candidates of its query in an earlier round. Every key of the union
      of the rounds' candidate sets is then attended in exactly one round, the first that lists it, so combining
      the rounds by their log-sum-exps is one softmax over the union: what subtracting log(number of rounds listing
      the key) computes (LSH's duplicate correction, Reformer Appendix A; docs/lsh_attention.md), with R(R-1)/2 round
      comparisons instead of R^2 and no per-score logarithm.
    """

    positions: torch.Tensor
    valid: torch.Tensor
    before: int
    after: int
    causal: bool = False
    self_penalty: bool = False
    groups: torch.Tensor | None = None
    group_band: tuple[int, int] = (0, 0)
    round_locations: torch.Tensor | None = None
    round_band: tuple[int, int] = (0, 0)

    def neighbours(self, x: torch.Tensor, fill, rest_dims: int = 0) -> torch.Tensor:
        return neighbour_chunks(x, self.before, self.after, fill, rest_dims)

    @property
    def chunk_length(self) -> int:
        return self.positions.shape[-1]

    def slot_offsets(self, device) -> torch.Tensor:
        """[m, W]: key slot - query slot for every (query, window key) pair of a chunk (the same for all chunks)."""
        m = self.chunk_length
        key_slots = torch.arange(-self.before * m, (self.after + 1) * m, device=device)
        return key_slots[None, :] - torch.arange(m, device=device)[:, None]

    def disallowed(self) -> torch.Tensor:
        """[N, C, m, W] bool: True where the key must not be attended."""
        full = (*self.positions.shape, (self.before + 1 + self.after) * self.chunk_length)
        blocked = ~self.neighbours(self.valid, False).unsqueeze(-2)  # [N, C, 1, W]
        if self.groups is not None:
            lo, hi = self.group_band
            offsets = self.slot_offsets(self.groups.device)
            blocked = blocked | ((offsets < lo) | (offsets > hi))
            blocked = blocked | (self.neighbours(self.groups, -1).unsqueeze(-2) != self.groups.unsqueeze(-1))
        if self.causal:
            blocked = blocked | (self.neighbours(self.positions, 0).unsqueeze(-2) > self.positions.unsqueeze(-1))
        if self.round_locations is not None and self.round_locations.shape[-1] > 1:
            blocked = self._with_earlier_candidates(blocked.expand(full))
        return blocked.expand(full)

    def _with_earlier_candidates(self, blocked: torch.Tensor) -> torch.Tensor:
        """`blocked` [N, C, m, W] plus the window keys that were a candidate of the query in an earlier round (out of
        place: in-place updates of slices of a bool tensor do not compile)."""
        rounds = self.round_locations.shape[-1]
        if blocked.shape[0] % rounds:
            raise ValueError(f"round_locations lists {rounds} hash rounds, but there are {blocked.shape[0]} rows: "
                             "pass whole groups of rows, one row per round with the round innermost.")
        lo, hi = self.round_band
        per_round = blocked.view(-1, rounds, *blocked.shape[1:])  # [G, R, C, m, W]
        query_locations = self.round_locations.view(-1, rounds, *self.round_locations.shape[1:])  # [G, R, C, m, R']
        key_locations = self.neighbours(self.round_locations, 0, rest_dims=1)
        key_locations = key_locations.view(-1, rounds, *key_locations.shape[1:])  # [G, R, C, W, R']
        # The rows of round r against every earlier round e: [.., m, W] comparisons, the largest tensors here.
        rows = [per_round[:, 0]]
        for row_round in range(1, rounds):
            listed = None
            for earlier in range(row_round):
                q = query_locations[:, row_round, ..., earlier].unsqueeze(-1)
                k = key_locations[:, row_round, ..., earlier].unsqueeze(-2)
                hit = (k >= q + lo) & (k <= q + hi)
                listed = hit if listed is None else listed | hit
            rows.append(per_round[:, row_round] | listed)
        return torch.stack(rows, dim=1).view_as(blocked)

    def apply_(self, scores: torch.Tensor) -> torch.Tensor:
        """Mask [N, C, m, W] scores in place: -inf where disallowed (including keys an earlier round attended),
        then the self penalty."""
        scores.masked_fill_(self.disallowed(), float("-inf"))
        if self.self_penalty:  # the own keys are one diagonal of the own chunk's block: write just those
            m = self.chunk_length
            scores.narrow(-1, self.before * m, m).diagonal(dim1=-2, dim2=-1).fill_(mask_values(scores.dtype)[1])
        return scores

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        """`apply_` without writing into `scores`: the reference path's form, which torch.compile traces with
        dynamic shapes inside activation checkpointing (in-place writes to views there fail to trace)."""
        scores = scores.masked_fill(self.disallowed(), float("-inf"))
        if self.self_penalty:
            scores = scores.masked_fill(self._own_key(scores), mask_values(scores.dtype)[1])
        return scores

    def _own_key(self, scores: torch.Tensor) -> torch.Tensor:
        """[m, W] True where a query meets its own key: window column `before * m + i` for chunk row i."""
        m = self.chunk_length
        rows = torch.arange(m, device=scores.device)
        cols = torch.arange(scores.shape[-1], device=scores.device)
        return cols[None, :] == rows[:, None] + self.before * m


def _padded_flat(x: torch.Tensor, before: int, after: int, finite: bool = False) -> torch.Tensor:
    """[N, C, m, d] -> [N * C + before + after, m, d]: all chunks in one row with `before` zero chunks in front and
    `after` behind, so every chunk's window is a contiguous run of rows (see `_flat_windows`).

    `finite` (the values): a window at the end of a row reads the neighbouring row's chunks, masked with probability
    exactly 0, but 0 * NaN is NaN: one example's NaN values would reach the next example's outputs. Non-finite values
    are zeroed in this copy, so examples never influence each other; an example with NaN inputs still gets NaN
    outputs, through its own queries and keys (a masked score is overwritten, an allowed NaN one is not)."""
    flat = x.reshape(-1, *x.shape[-2:])
    if before == 0 and after == 0:
        return flat.contiguous()  # `_flat_windows` reads it with contiguous strides; no window leaves its row
    # torch.cat writes every element once (F.pad fills the whole output, then copies the inside over it)
    padded = torch.cat([flat.new_zeros(before, *flat.shape[1:]), flat, flat.new_zeros(after, *flat.shape[1:])])
    return padded.nan_to_num_(0.0, 0.0, 0.0) if finite else padded


def _flat_windows(padded: torch.Tensor, num_chunks: int, blocks: int) -> torch.Tensor:
    """[N * C, blocks * m, d] overlapping views of `_padded_flat` rows: window i = chunks i - before .. i + after.
    No copy. Windows at the ends of a row of C chunks reach into the neighbouring row (or the zero padding); those
    keys are always masked, so their probabilities and gradients are exactly 0 (and the values' copy is finite, see
    `_padded_flat`)."""
    _, m, d = padded.shape
    return padded.as_strided((num_chunks, blocks * m, d), (m * d, d, 1))  # from the tensor's own offset


def _masked_scores(q, k_windows, mask: ChunkMask, scale: float) -> torch.Tensor:
    """[N, C, m, W] masked scores of q [N * C, m, d] against window keys [N * C, W, d]."""
    scores = torch.bmm(q, k_windows.transpose(1, 2))
    if scale != 1.0:
        scores.mul_(scale)
    return mask.apply_(scores.view(*mask.positions.shape, scores.shape[-1]))


def _softmax_(scores: torch.Tensor):
    """Softmax of masked scores -> (probs, lse [..., 1]); rows with nothing allowed (best score below the floor, -inf
    when every key is masked) get probs 0 and the floor log-sum-exp. `scores` is overwritten.

    One fused `torch.softmax` (on the CPU several times faster than exp_ over the masked scores: exp of -inf is a
    slow path there). The log-sum-exp comes from the largest probability, exp(0) / sum: lse = max - log(p_max)."""
    floor = mask_values(scores.dtype)[0]
    top = scores.amax(dim=-1, keepdim=True)
    empty = top < floor
    # An empty row gets one score 0 (every other one is below the floor, so its exp is exactly 0): the softmax then
    # stays finite (no 0/0), with probability 1 on that entry, zeroed below.
    first = scores.narrow(-1, 0, 1)
    first.masked_fill_(empty, 0.0)
    probs = torch.softmax(scores, dim=-1)
    largest = probs.amax(dim=-1, keepdim=True)
    probs.narrow(-1, 0, 1).masked_fill_(empty, 0.0)
    return probs, top.clamp_(min=floor).sub_(largest.log_())


class ChunkedAttentionFunction(torch.autograd.Function):
    """(q [N, C, m, d], k [N, C, m, d], v [N, C, m, d], mask, scale, dropout_p, save_probs)
    -> (out [N, C, m, d], lse [N, C, m]).

    The window keys and values are strided views of one padded copy of k and v (`_flat_windows`), the backward adds
    each window block's gradient straight into its chunk (baddbmm into a shifted view): no [.., W, d] copies."""

    @staticmethod
    def forward(ctx, q, k, v, mask: ChunkMask, scale: float, dropout_p: float, save_probs: bool):
        shape = q.shape
        before, after = mask.before, mask.after
        num_chunks, blocks = shape[0] * shape[1], before + 1 + after
        q_flat = q.reshape(num_chunks, *shape[-2:])
        k_padded, v_padded = _padded_flat(k, before, after), _padded_flat(v, before, after, finite=True)
        scores = _masked_scores(q_flat, _flat_windows(k_padded, num_chunks, blocks), mask, scale)
        probs, lse = _softmax_(scores)
        # The backward runs outside autocast: it recomputes the scores and probabilities in the dtypes autocast gave
        # them here (CUDA autocast: bfloat16 scores, float32 softmax), as a recomputing forward saves them.
        ctx.scores_dtype, ctx.probs_dtype = scores.dtype, probs.dtype
        del scores
        probs_flat = probs.view(num_chunks, shape[-2], -1)
        v_windows = _flat_windows(v_padded, num_chunks, blocks)
        keep = None
        if dropout_p > 0.0:
            keep = torch.rand_like(probs) >= dropout_p
            out = torch.bmm((probs * keep).div_(1.0 - dropout_p).view_as(probs_flat).to(v.dtype), v_windows)
        else:  # (probabilities in float32 beside half-precision values: CUDA autocast's softmax; see `_fold`)
            out = torch.bmm(probs_flat.to(v.dtype), v_windows)
        out = out.view(shape)
        ctx.mask, ctx.scale, ctx.dropout_p = mask, scale, dropout_p
        ctx.save_for_backward(q, k_padded, v_padded, out, lse, keep, probs if save_probs else None)
        return out, lse.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k_padded, v_padded, out, lse, keep, probs = ctx.saved_tensors
        mask, scale, dropout_p = ctx.mask, ctx.scale, ctx.dropout_p
        shape = q.shape
        before, after = mask.before, mask.after
        num_chunks, m, blocks = shape[0] * shape[1], shape[-2], before + 1 + after
        q_flat = q.reshape(num_chunks, *shape[-2:])
        k_windows = _flat_windows(k_padded, num_chunks, blocks)
        v_windows = _flat_windows(v_padded, num_chunks, blocks)
        if probs is None:  # the forward's probabilities again (up to rounding), through the fused softmax
            dtype = ctx.scores_dtype  # q and k may differ in dtype under autocast (shared QK's float32 keys)
            scores = _masked_scores(q_flat.to(dtype), k_windows.to(dtype), mask, scale)
            probs = _softmax_(scores.to(ctx.probs_dtype))[0]
            del scores
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_out_flat = grad_out.reshape(num_chunks, *shape[-2:])
        probs_flat = probs.view(num_chunks, m, -1)
        grad_probs = torch.bmm(grad_out_flat, v_windows.transpose(1, 2).to(grad_out.dtype)).view_as(probs)
        used = probs_flat if keep is None else (probs * keep).div_(1.0 - dropout_p).view_as(probs_flat)
        grad_v = _fold(used, grad_out_flat, v_padded, before, m)
        del used
        if keep is not None:
            grad_probs.mul_(keep).div_(1.0 - dropout_p)
        # Softmax backward with the log-sum-exp's own gradient: dS = P * (dP - rowsum(dO * O) + dlse).
        delta = (grad_out * out).sum(-1, keepdim=True)
        if grad_lse is not None:
            delta = delta - grad_lse.unsqueeze(-1)
        grad_scores = grad_probs.sub_(delta).mul_(probs)
        del probs, grad_probs, probs_flat
        # Masked keys have probability 0, so no gradient; a row whose only key is its own (penalised, a constant)
        # or that has none has a log-sum-exp at or below the self value and gets none either.
        grad_scores.masked_fill_(lse <= mask_values(lse.dtype)[1] / 2, 0.0)
        if scale != 1.0:
            grad_scores.mul_(scale)
        grad_scores_flat = grad_scores.view(num_chunks, m, -1)
        grad_q = torch.bmm(grad_scores_flat.to(q.dtype), k_windows.to(q.dtype)).view(shape)
        grad_k = _fold(grad_scores_flat, q_flat, k_padded, before, m)
        return grad_q, grad_k.view(shape), grad_v.view(shape), None, None, None, None


def _fold(weights: torch.Tensor, x: torch.Tensor, padded_like: torch.Tensor, before: int, m: int) -> torch.Tensor:
    """Gradient of `_padded_flat` rows seen through the windows: for every window block b, weights[:, :, b]^T @ x
    added to the chunk that block came from; returns the [N * C, m, d] real rows, in padded_like's dtype.

    Under CUDA autocast the forward's softmax runs in float32 while the matmuls give bfloat16/float16, so the
    probabilities and the output's gradient can differ in dtype (the first GPU run found this): both are taken in
    the dtype of the input whose gradient this is."""
    weights, x = weights.to(padded_like.dtype), x.to(padded_like.dtype)
    num_chunks = x.shape[0]
    blocks = weights.shape[-1] // m
    # Only the real rows are kept: block b of chunk c lands in row c + b - before. Block 0 writes its rows (no
    # zero-filled buffer), the few rows it does not reach start at 0, and the other blocks add in block order, as
    # accumulating every block into zeros would.
    total = padded_like.new_empty((num_chunks, *padded_like.shape[1:]))
    for block in range(blocks):  # a handful of window blocks, each one batched matmul over every chunk
        shift = block - before
        lo, hi = max(0, -shift), min(num_chunks, num_chunks - shift)
        if block == 0:
            reached = max(hi + shift, 0) if hi > lo else 0
            total.narrow(0, reached, num_chunks - reached).zero_()
        if hi <= lo:
            continue
        part = weights[lo:hi, :, block * m:(block + 1) * m].transpose(1, 2)
        rows = total.narrow(0, lo + shift, hi - lo)
        if block == 0:
            torch.bmm(part, x[lo:hi], out=rows)
        else:
            rows.baddbmm_(part, x[lo:hi])
    return total


def chunked_attention(q, k, v, mask: ChunkMask, scale: float = 1.0, dropout_p: float = 0.0,
                       save_probs: bool = False):
    """Chunked attention over each chunk's window; returns (out [N, C, m, d], lse [N, C, m])."""
    return ChunkedAttentionFunction.apply(q, k, v, mask, scale, dropout_p, save_probs)


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int, value=0) -> torch.Tensor:
    """Pad `dim` of x at the end to a multiple of `multiple`."""
    extra = (-x.shape[dim]) % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, extra]
    if x.dtype == torch.bool:
        return F.pad(x.to(torch.uint8), pad, value=int(value)).bool()
    return F.pad(x, pad, value=value)
