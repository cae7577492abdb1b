"""Counter-based random numbers: each draw is a hash of (seed, counters), so the same element gets the same number
whatever else is drawn with it, on any device, inside torch.compile (no `torch.Generator`) and without touching the
global RNG. Evaluation-mode draws use them (RA's sampled indices, LSH's rotations), so evaluation is deterministic and
independent of the batch, the sequence length and a decoding cache."""

from __future__ import annotations

import math

import torch


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), in two 16-bit halves so no int64 product overflows."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (the "lowbias32" mixer), elementwise on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


#: the counters are folded into one number modulo this prime (2**31 - 1) before a single mix: products of two
#: numbers below it stay below 2**62, so no int64 overflows
FOLD_PRIME = 2147483647
FOLD_MULTIPLIER = 1103515245  # odd, below FOLD_PRIME
FOLD_INCREMENT = 12345


def _opaque(counter: torch.Tensor) -> torch.Tensor:
    """The counter as int64, unchanged, through an identity (xor 0) that inductor's index propagation does not
    model: a counter made by `arange` would otherwise turn the fold into an index expression, which inductor's
    Triton code (torch 2.11) computes in int32, so RA's compiled CUDA decode step failed to build ("Scalar
    13622895699525 is out of range for type int32"; pytorch/pytorch PR 186913 fixes value expressions)."""
    return counter.to(torch.int64) ^ 0


def counter_uniform(seed: int, *counters: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1), float64, one per element of the broadcast `counters` (int tensors, each in
    [0, 2**31 - 1)).

    The seed and the counters are folded into one number by a polynomial modulo a prime (each step uses the running
    value once), and that number is mixed once by `_hash32`. Each mixing step reads its input twice, so chaining a
    mix per counter would make an expression that doubles with every step: torch.compile inlines it, and RA's five
    counters took inductor over ten minutes to compile."""
    state = torch.full((), seed % FOLD_PRIME, dtype=torch.int64, device=counters[0].device)
    for counter in counters:
        state = (state * FOLD_MULTIPLIER + _opaque(counter) + FOLD_INCREMENT) % FOLD_PRIME
    return (_hash32(state).double() + 0.5) / 4294967296.0


def counter_normal(seed: int, shape: tuple[int, ...], device, dtype=torch.float32) -> torch.Tensor:
    """Standard normal numbers of `shape`, element i a function of (seed, i) alone (Box-Muller on two counter
    uniforms)."""
    index = torch.arange(math.prod(shape), device=device).view(shape)
    u1 = counter_uniform(seed, index, torch.zeros((), dtype=torch.int64, device=device))
    u2 = counter_uniform(seed, index, torch.ones((), dtype=torch.int64, device=device))
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)
