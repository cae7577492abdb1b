"""Rotary position settings ("RoFormer", arXiv 2104.09864): which frequency scalings attnzoo supports, their checks,
and the inverse frequencies they define.

The frequencies follow transformers' Llama exactly (same formulas, computed in float32), so a converted Llama
checkpoint rotates q and k by the same angles as its source. Supported `rope_scaling` types: "default" (none),
"linear" (position interpolation, arXiv 2306.15595: every frequency divided by `factor`) and "llama3" (Llama 3.1's
wavelength-dependent interpolation). Dynamic NTK, YaRN and LongRoPE change the angles with the sequence length or
add an attention temperature, which no attnzoo attention models yet; they are refused rather than approximated.
"""

from __future__ import annotations

import math

import torch

from attnzoo.validation import fail

ROPE_SCALING_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_scaling_type(scaling: dict | None) -> str:
    """The scaling's type name ("rope_type", or the older "type"); "default" for None."""
    if scaling is None:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_rope(config) -> None:
    """`rope_theta` is a positive number and `rope_scaling` a supported type with its keys; `ValueError` otherwise."""
    theta = config.rope_theta
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        fail("rope_theta", theta, "set the rotary base, a positive number (10000.0 in Llama 2, 500000.0 in Llama 3).")
    scaling = config.rope_scaling
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        fail("rope_scaling", scaling, "set None or a dict such as {'rope_type': 'linear', 'factor': 2.0}.")
    kind = rope_scaling_type(scaling)
    if kind not in ROPE_SCALING_TYPES:
        fail("rope_scaling", scaling, f"rope type {kind!r} is not supported; attnzoo supports {ROPE_SCALING_TYPES} "
                                      "(docs/llama_backbones.md says why the others are refused).")
    missing = [key for key in _REQUIRED_KEYS[kind] if key not in scaling]
    if missing:
        fail("rope_scaling", scaling, f"rope type {kind!r} needs {missing}.")
    if kind != "default" and not scaling["factor"] >= 1.0:
        fail("rope_scaling", scaling, "its 'factor' must be >= 1.")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        fail("rope_scaling", scaling, "'high_freq_factor' must be greater than 'low_freq_factor'.")


def inverse_frequencies(theta: float, dim: int, scaling: dict | None) -> torch.Tensor:
    """[dim / 2] float32 angular frequencies of rotary positions over `dim` features, after `scaling`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope_scaling_type(scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, those between blended.
        scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
        blend = (context / wavelength - low) / (high - low)
        blended = (1 - blend) * scaled / factor + blend * scaled
        between = ~(wavelength < context / high) & ~(wavelength > context / low)
        return torch.where(between, blended, scaled)
    return inv_freq
