"""Keys and values stored in a few bits: one (scale, low) pair per vector, its entries rounded to 2^bits levels.

A far part that keeps every far key and value (block retrieval) holds as many bytes as a KV cache; read only a
few at a time, they can be held in 8 or 4 bits each, as KV-cache quantisation does for a whole cache (KIVI, arXiv
2402.02750; KVQuant, arXiv 2401.18079). Here each head's key or value vector x of one token (its e entries) is
stored asymmetrically: low = min x, scale = (max x - low) / (2^bits - 1), codes round((x - low) / scale) in
0 .. 2^bits - 1 (two 4-bit codes a byte, the even entry in the low half), read back as codes * scale + low; the
error is at most scale / 2 per entry, up to the float rounding of codes * scale + low (computed in float32 at least,
so for half-precision inputs too; a vector whose range max - min overflows its dtype, past 3.4e38 in float32, reads
back as NaN, as no key or value of a working model does). One pair per
vector keeps what a token stores independent of every other token, so a decoding step stores what the full forward
reads: the full forward reads `round_trip(x)`, which is `dequantise(*quantise(x))` computed in the same operations.
(The same operations on the same vector: a key that a one-token step computes a rounding error away from the full
forward's may round to the next level, one step of its scale, where unquantised it would differ by that rounding
error alone.) Its gradient is the identity (a straight-through estimator, as quantisation-aware training uses): the
rounding has no useful gradient of its own.
"""

from __future__ import annotations

import torch

#: the bit widths `quantise` stores
STORE_BITS = (8, 4)


def check_bits(bits: int) -> None:
    """Refuse a width that is not one of `STORE_BITS`."""
    if bits not in STORE_BITS:
        raise ValueError(f"bits={bits!r} is not a stored width: use one of {STORE_BITS}.")


def quantise(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., e * bits / 8], ranges [..., 2] = (scale, low) in x's dtype, or float32 for a narrower one)
    of vectors x [..., e]; bits is 8, or 4 for an even e."""
    check_bits(bits)
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"4-bit entries pack two a byte and the vectors have {x.shape[-1]} entries: use 8 bits.")
    levels = (1 << bits) - 1
    x = x.detach().to(torch.promote_types(x.dtype, torch.float32))  # half precision: a range past 65504, 8-bit steps
    low, high = x.aminmax(dim=-1, keepdim=True)
    scale = (high - low) / levels
    scale = torch.where(scale > 0, scale, 1.0)  # a constant vector: every code 0, read back as low exactly
    codes = ((x - low) / scale).round_().clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, torch.cat([scale, low], -1)


def dequantise(codes: torch.Tensor, ranges: torch.Tensor, bits: int) -> torch.Tensor:
    """The vectors [..., e] that codes [..., e * bits / 8] and ranges [..., 2] hold, in the ranges' dtype."""
    check_bits(bits)
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
    return codes.to(ranges.dtype) * ranges[..., :1] + ranges[..., 1:]


class _StraightThrough(torch.autograd.Function):
    """`stored` exactly (x + (stored - x).detach() would round), with x's gradient the identity."""

    @staticmethod
    def forward(ctx, x, stored):
        return stored.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def round_trip(x: torch.Tensor, bits: int | None) -> torch.Tensor:
    """x as a store of `bits` bits holds it (x itself for None), with the identity as its gradient."""
    if bits is None:
        return x
    stored = dequantise(*quantise(x, bits), bits).to(x.dtype)
    return _StraightThrough.apply(x, stored) if x.requires_grad else stored
