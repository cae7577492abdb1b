import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process script run builds its own Accelerator; accelerate keeps process-wide singletons, so they are
    reset after every test (a script's mixed precision or accumulation setting must not leak into the next)."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
