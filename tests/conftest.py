"""Suite-wide set-up. Without a GPU, the fused ops' Triton kernels (attnzoo/ops) run on the CPU through Triton's
interpreter, which is how tests/ops verifies them here. Triton decides between compiling and interpreting whenever a
function is decorated with `@triton.jit`, its own library included, so TRITON_INTERPRET must be set before anything
imports triton (transformers and torch may): this root conftest is imported before any test module."""

import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process script run builds its own Accelerator; accelerate keeps process-wide singletons, so they are
    reset after every test (a script's mixed precision or accumulation setting must not leak into the next)."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class _DeprecationRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "deprecat" in message.lower():
            self.messages.append(f"{record.name}: {message}")


@pytest.fixture(autouse=True)
def no_transformers_deprecation_logged():
    """transformers announces some deprecations through its logger rather than `warnings` (reading an output's
    `past_key_values` on 5.24, say): any such message during a test fails it, as pyproject's `filterwarnings` does for
    warnings. A test that exercises a deprecated spelling on purpose clears `handler.messages` itself."""
    handler = _DeprecationRecords()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
    assert not handler.messages, f"transformers logged a deprecation: {handler.messages}"
