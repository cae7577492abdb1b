"""Where the ops' Triton tests run: on CUDA when there is a GPU, else on the CPU under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET before triton is imported)."""

import pytest
import torch

from attnzoo.ops.triton_utils import interpreting, triton_importable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _skip_reason() -> str | None:
    if not triton_importable():
        return "Triton is not installed (pip install triton)"
    if DEVICE == "cpu" and not interpreting():
        return ("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it; when running "
                "these tests another way, export TRITON_INTERPRET=1)")
    return None


needs_triton = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
