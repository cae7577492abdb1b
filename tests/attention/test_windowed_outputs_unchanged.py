"""The windowed attentions compute what they computed before their rewrite into an exact near part and a pluggable
far part: every case of `tests/attention/windowed_outputs.py` (fast path, reference forward, input gradient, a
decoder's full and token-by-token logits, float64) equals the outputs saved from the earlier code to 1e-12."""

import pytest
import torch

from tests.attention.windowed_outputs import CASES, SAVED, decoder_outputs, layer_outputs


@pytest.fixture(scope="module")
def saved():
    return torch.load(SAVED)


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_equal_those_of_the_code_before_the_rewrite(name, saved):
    kind, settings = CASES[name]
    now = {**layer_outputs(kind, settings), **decoder_outputs(kind, settings)}
    assert now.keys() == saved[name].keys()
    for output, value in now.items():
        torch.testing.assert_close(value, saved[name][output], rtol=0, atol=1e-12, msg=f"{name}: {output}")
