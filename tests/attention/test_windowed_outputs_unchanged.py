"""The windowed attentions compute what they computed before their rewrite into an exact near part and a pluggable
far part: every case of `tests/attention/windowed_outputs.py` (fast path, reference forward, input gradient, a
decoder's full and token-by-token logits, float64) equals the outputs saved from the earlier code to 1e-12, with the
weights saved beside them loaded under their saved names."""

import pytest
import torch

from tests.attention.windowed_outputs import CASES, SAVED, decoder_outputs, layer_outputs


@pytest.fixture(scope="module")
def saved():
    return torch.load(SAVED)


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_equal_those_of_the_code_before_the_rewrite(name, saved):
    kind, settings = CASES[name]
    before = saved[name]
    now = {**layer_outputs(kind, settings, before["layer_weights"]),
           **decoder_outputs(kind, settings, before["model_weights"])}
    assert now.keys() == before.keys()
    for output, value in now.items():
        if output.endswith("_weights"):
            continue
        torch.testing.assert_close(value, before[output], rtol=0, atol=1e-12, msg=f"{name}: {output}")
