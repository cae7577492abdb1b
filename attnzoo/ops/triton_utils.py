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


def resolve_backend(backend: str, x: torch.Tensor, op: str, unsupported: str | None = None) -> str:
    """"auto" -> "triton" on CUDA when Triton is importable and its kernels take the inputs, else "torch"; an
    explicit "triton" that cannot run on `x`, or cannot take the inputs, raises a ValueError saying why.

    `unsupported`: why the op's kernels cannot take these inputs (a size they have no tiles for), or None. float64
    inputs are never taken: the kernels accumulate in float32, and a float64 caller asks for float64 results (the
    first GPU run found the chunk kernel failing to compile on them, reached through "auto")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}.")
    if unsupported is None and x.dtype == torch.float64:
        unsupported = "the kernels compute in float32 or half precision, and the inputs are float64"
    if backend == "auto":
        return "triton" if x.is_cuda and triton_importable() and unsupported is None else "torch"
    if backend == "triton" and not triton_can_run(x):
        reason = ("Triton is not installed (pip install triton)" if not triton_importable() else
                  f"the inputs are on {x.device} and Triton runs on CUDA, or on the CPU only under its interpreter "
                  "(set TRITON_INTERPRET=1 before anything imports triton)")
        raise ValueError(f"{op}: backend='triton' cannot run here: {reason}; use backend='torch' or 'auto'.")
    if backend == "triton" and unsupported is not None:
        raise ValueError(f"{op}: backend='triton' cannot take these inputs: {unsupported}; use backend='torch' or "
                         "'auto' (which picks the PyTorch path for them).")
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
