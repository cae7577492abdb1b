"""Windowed chunk attention through PyTorch's FlexAttention (`torch.nn.attention.flex_attention`).

Each row of C chunks of m positions becomes one sequence of L = C·m positions (a batch entry, one head). The window
structure is the block mask, built directly from the chunk geometry (no [L, L] mask is evaluated): query block b
gets the key blocks that hold chunks first_chunk(b) - before .. last_chunk(b) + after. Which keys inside those
blocks a query may use is the `mask_mod`, which reads the `ChunkMask` metadata at the two flat indices: the
window-slot offset of `ChunkMask.groups` is simply kv_idx - q_idx in this layout, and the duplicate-correction
rule loops over the earlier rounds (row b is round b mod R).

What the mask cannot say: a query's own key under `self_penalty` is not masked but scored with a finite constant,
so the mask_mod allows it and a `score_mod` replaces its score by the self value (score_mod sees the scaled score).
FlexAttention returns -inf as the log-sum-exp of a row with no allowed key; it is replaced by the masked floor, as
`torch_chunks.chunked_attention` returns it. The gradient of a row left with only its own key differs in one respect:
the self score is a constant here too, so it passes no gradient to q or k, exactly as in the PyTorch path.

FlexAttention runs its backward on CUDA only (compiled there with torch.compile); on the CPU this runs the forward
(eager, unfused) and refuses inputs that need gradients. No dropout.
"""

from __future__ import annotations

import torch

from attnzoo.ops.chunked_attention.torch_chunks import ChunkMask, mask_values

#: FlexAttention's sparse block size (its default): both the query and the key blocks of the block mask.
FLEX_BLOCK_SIZE = 128

_compiled_flex = None


def _flex_function(device: torch.device):
    """FlexAttention compiled on CUDA (its fused kernels); the eager reference on the CPU."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def chunk_block_mask(mask: ChunkMask, rows: int, chunks: int, m: int, mask_mod, device, block_size: int):
    """A BlockMask whose query block b lists the key blocks covering chunks first(b) - before .. last(b) + after."""
    from torch.nn.attention.flex_attention import BlockMask

    length = chunks * m
    q_blocks = -(-length // block_size)
    starts = torch.arange(q_blocks, device=device) * block_size
    first_chunk = starts // m
    last_chunk = torch.clamp(starts + block_size - 1, max=length - 1) // m
    first_key = torch.clamp(first_chunk - mask.before, min=0) * m
    last_key = torch.clamp((last_chunk + mask.after + 1) * m, max=length) - 1
    first_block, last_block = first_key // block_size, last_key // block_size
    counts = last_block - first_block + 1
    # BlockMask wants one column per key block (it reads only the first `counts`; the rest repeat the last one)
    indices = first_block[:, None] + torch.arange(q_blocks, device=device)[None, :]
    indices = torch.minimum(indices, last_block[:, None])
    shape = (rows, 1, q_blocks)
    return BlockMask.from_kv_blocks(counts.to(torch.int32).expand(shape).contiguous(),
                                    indices.to(torch.int32).expand(*shape, q_blocks).contiguous(),
                                    BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(length, length))


def _mask_functions(mask: ChunkMask, rows: int, chunks: int, m: int, dtype: torch.dtype):
    """(mask_mod, score_mod) reading the mask's metadata as [N, L] (and [N, L, R]) tensors."""
    length = chunks * m
    valid = mask.valid.reshape(rows, length)
    positions = mask.positions.reshape(rows, length)
    groups = mask.groups.reshape(rows, length) if mask.groups is not None else None
    rounds = mask.round_locations.shape[-1] if mask.round_locations is not None else 1
    locations = mask.round_locations.reshape(rows, length, rounds) if rounds > 1 else None
    before, after, causal, self_penalty = mask.before, mask.after, mask.causal, mask.self_penalty
    group_lo, group_hi = mask.group_band
    round_lo, round_hi = mask.round_band
    self_value = mask_values(dtype)[1]

    def mask_mod(b, h, q_idx, kv_idx):
        gap = kv_idx // m - q_idx // m
        allowed = (gap >= -before) & (gap <= after) & valid[b, kv_idx]
        if groups is not None:
            offset = kv_idx - q_idx
            allowed = allowed & (offset >= group_lo) & (offset <= group_hi) & (groups[b, kv_idx] == groups[b, q_idx])
        if causal:
            allowed = allowed & (positions[b, kv_idx] <= positions[b, q_idx])
        for earlier in range(rounds - 1):
            listed = locations[b, kv_idx, earlier] - locations[b, q_idx, earlier]
            listed = (listed >= round_lo) & (listed <= round_hi) & (b % rounds > earlier)
            allowed = allowed & ~listed
        if self_penalty:
            allowed = allowed | (q_idx == kv_idx)
        return allowed

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx == kv_idx, torch.full_like(score, self_value), score)

    return mask_mod, score_mod if self_penalty else None


def flex_chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ChunkMask,
                            scale: float = 1.0, block_size: int = FLEX_BLOCK_SIZE):
    """(out [N, C, m, d], lse [N, C, m]) as `torch_chunks.chunked_attention` (no dropout); see the module docstring."""
    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError("FlexAttention has no backward on the CPU: run on CUDA, call under torch.no_grad() for "
                         "the forward only, or use backend='torch' (or 'triton') for gradients.")
    from torch.nn.attention.flex_attention import AuxRequest

    if not torch.is_grad_enabled():  # FlexAttention refuses CPU inputs that require grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    rows, chunks, m, d = q.shape
    length = chunks * m
    mask_mod, score_mod = _mask_functions(mask, rows, chunks, m, q.dtype)
    block_mask = chunk_block_mask(mask, rows, chunks, m, mask_mod, q.device, block_size)
    flex = _flex_function(q.device)
    out, aux = flex(*(x.reshape(rows, 1, length, d) for x in (q, k, v)), score_mod=score_mod,
                    block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
    floor = mask_values(q.dtype)[0]
    lse = torch.where(torch.isneginf(aux.lse), floor, aux.lse).to(q.dtype)
    return out.view(q.shape), lse.view(q.shape[:-1])
