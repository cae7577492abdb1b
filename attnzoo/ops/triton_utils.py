"""What the Triton ops share: whether Triton can run on given tensors (a CUDA device, or on the CPU through Triton's
interpreter, `TRITON_INTERPRET=1`, which is how the CPU test suite verifies the kernels), the dot-product precision
for float32 inputs, and tile sizes.

Triton stays optional: nothing here imports it at module level."""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton")


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter: TRITON_INTERPRET is set and was already set when triton
    was imported. Triton reads it whenever a function is decorated with `@triton.jit`, its own library
    (`tl.zeros`, `tl.sum`, ...) included, so it must be set before anything imports triton."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    # Imported by name: Triton stays optional, also for the copy of this code that checkpoints carry (transformers
    # refuses remote code whose plain imports name a package that is not installed).
    language = importlib.import_module("triton.language")
    interpreter = importlib.import_module("triton.runtime.interpreter")
    return isinstance(language.zeros, interpreter.InterpretedFunction)


def triton_can_run(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take `x`: on CUDA, or on the CPU under the interpreter."""
    return triton_importable() and (x.is_cuda or (x.device.type == "cpu" and interpreting()))


def resolve_backend(backend: str, x: torch.Tensor, op: str) -> str:
    """"auto" -> "triton" on CUDA when Triton is importable, else "torch"; an explicit "triton" that cannot run on
    `x` raises a ValueError saying why."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}.")
    if backend == "auto":
        return "triton" if x.is_cuda and triton_importable() else "torch"
    if backend == "triton" and not triton_can_run(x):
        reason = ("Triton is not installed (pip install triton)" if not triton_importable() else
                  f"the inputs are on {x.device} and Triton runs on CUDA, or on the CPU only under its interpreter "
                  "(set TRITON_INTERPRET=1 before anything imports triton)")
        raise ValueError(f"{op}: backend='triton' cannot run here: {reason}; use backend='torch' or 'auto'.")
    return backend


def dot_precision(dtype: torch.dtype) -> str | None:
    """`input_precision` of tl.dot: for float32 inputs follow PyTorch's own matmul setting (TF32 only when
    torch.backends.cuda.matmul.allow_tf32 is on, exact "ieee" otherwise); half-precision inputs use the default
    (tensor cores, float32 accumulation)."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def feature_block(size: int, largest: int = 64) -> int:
    """A power-of-two tile for a feature dimension: at least 16 (tl.dot's smallest), at most `largest`; the kernels
    mask the columns beyond `size` and loop over tiles when `size` is larger."""
    block = 16
    while block < size and block < largest:
        block *= 2
    return block
