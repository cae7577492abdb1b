"""Suite-wide set-up. Without a GPU, the fused ops' Triton kernels (attnzoo/ops) run on the CPU through Triton's
interpreter, which is how tests/ops verifies them here. Triton decides between compiling and interpreting whenever a
function is decorated with `@triton.jit`, its own library included, so TRITON_INTERPRET must be set before anything
imports triton (transformers and torch may): this root conftest is imported before any test module."""

import logging
import os
import sys
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """The scripts set torch's thread count (attnzoo/training/threads.py); a later test must not inherit it (its
    results would round differently from a subprocess's)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process script run builds its own Accelerator; accelerate keeps process-wide singletons, so they are
    reset after every test (a script's mixed precision or accumulation setting must not leak into the next)."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _attnzoo_on_stack() -> bool:
    """Whether attnzoo's code (the package, or a checkpoint's remote-code copy) is among the callers."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(("attnzoo", "transformers_modules")):
            return True
        frame = frame.f_back
    return False


class _DeprecationRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "deprecat" in message.lower() and _attnzoo_on_stack():
            self.messages.append(f"{record.name}: {message}")


@pytest.fixture(autouse=True)
def no_transformers_deprecation_logged():
    """transformers announces some deprecations through its logger rather than `warnings` (reading an output's
    `past_key_values` on 5.24, say): such a message logged while attnzoo's code is running fails the test, as
    pyproject's `filterwarnings` does for warnings. (Deprecations transformers logs about its own internal calls, e.g.
    assisted decoding's call of the assistant's generate(), are not attnzoo's.)"""
    handler = _DeprecationRecords()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
    assert not handler.messages, f"transformers logged a deprecation: {handler.messages}"


@pytest.fixture(autouse=True, scope="session")
def no_environment_report_in_lm_eval_results():
    """lm-eval's simple_evaluate() adds torch's environment report (torch.utils.collect_env) to every result, which
    runs `pip list` and a few other commands: over a second an evaluation on two cores, and the tests evaluate in
    this process some seventy times. No test reads the report; here it is a placeholder. (Processes the tests start,
    such as lm-eval's command and the scripts the README runs, collect it as usual.)"""
    from torch.utils import collect_env

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(collect_env, "get_pretty_env_info", lambda: "(not collected in attnzoo's tests)")
        yield


@pytest.fixture(scope="session")
def readme_gguf_conversion(tmp_path_factory):
    """The README's GGUF block run once a session, when first asked for, in a folder of its own: a function that
    returns (its CompletedProcess, the folder it converts into). The conversion of the real SmolLM2-135M-Instruct
    GGUF takes about a minute on two cores; tests/convert/test_convert_gguf.py checks the converted model against
    transformers' model of the file, and tests/scripts/test_readme.py that the block runs as written. (A lock: the
    README test calls it from a thread of its own.)"""
    from tests.scripts_helpers import run_readme_gguf_block

    lock, done = threading.Lock(), []

    def conversion():
        with lock:
            if not done:
                cwd = tmp_path_factory.mktemp("readme_gguf")
                done.append((run_readme_gguf_block(cwd), cwd / "runs" / "smollm2-softmax"))
            return done[0]

    return conversion
