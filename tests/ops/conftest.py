"""Without a GPU, the ops' Triton kernels run on the CPU through Triton's interpreter.

Triton decides between compiling and interpreting whenever a function is decorated with `@triton.jit`, its own
library included, so TRITON_INTERPRET must be set before anything imports triton (transformers may): this conftest is
imported before the test modules here, which pytest collects before the rest of tests/. It only affects Triton
kernels, which cannot run on this machine otherwise.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
