"""`far_softmax`, the softmax and log-sum-exp every normalised far part returns (`normalised_far`, `log_far_mass`,
LSH's sorted blocks): values and gradients against torch's logsumexp and softmax in float64, and the queries
without far keys."""

import pytest
import torch

from attnzoo.modeling.attention.windowed import _LogSumExpOfSoftmax, far_softmax, log_far_mass, normalised_far


def scores_and_mask(seed=3):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(5, 7, 9, generator=generator, dtype=torch.float64) * 8
    allowed = torch.rand(5, 7, 9, generator=generator) < 0.6
    allowed[..., 0] = True
    return scores, allowed, torch.randn(5, 7, generator=generator, dtype=torch.float64)


def test_log_sum_exp_from_the_softmax_equals_logsumexp_values_and_gradients():
    """The log-sum-exp read off the softmax (largest score minus the log of the largest probability) has logsumexp's
    value and gradient, with non-candidates at the lowest finite score."""
    scores, allowed, upstream = scores_and_mask()
    lowest = torch.finfo(scores.dtype).min
    results = []
    for fast in (True, False):
        logits = scores.clone().requires_grad_(True)
        masked = logits.masked_fill(~allowed, lowest)
        if fast:
            lse = _LogSumExpOfSoftmax.apply(masked, torch.softmax(masked, -1), masked.detach().amax(-1))
        else:
            lse = masked.logsumexp(-1)
        (lse * upstream).sum().backward()
        results.append((lse.detach(), logits.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-12)
    assert results[0][1][~allowed].abs().max() == 0


@pytest.mark.parametrize("marker", [float("-inf"), "lowest"])
def test_far_softmax_and_normalised_far_equal_torch_with_queries_without_far_keys(marker):
    scores, allowed, upstream = scores_and_mask(4)
    allowed[1, 2] = False  # a query without far keys
    fill = torch.finfo(scores.dtype).min if marker == "lowest" else marker
    values = torch.randn(5, 9, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    logits = scores.clone().requires_grad_(True)
    probs, lse = far_softmax(logits.masked_fill(~allowed, fill))
    out, den, lse_again = normalised_far(logits.masked_fill(~allowed, fill), values)
    assert torch.equal(lse, lse_again) and torch.equal(lse, log_far_mass(logits.masked_fill(~allowed, fill)))
    assert lse[1, 2] == float("-inf") and torch.equal(out[1, 2], torch.zeros(3, dtype=out.dtype))
    assert torch.equal(den, torch.ones_like(lse))
    real = torch.isfinite(lse)
    expected_lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    expected_probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(lse[real], expected_lse[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(probs[real], expected_probs[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[real], (expected_probs @ values)[real], rtol=0, atol=1e-12)
    # gradients: finite everywhere, zero for the query without far keys and for every non-far key
    (torch.where(real, lse, 0.0) * upstream).sum().add(out.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[1, 2].abs().max() == 0 and logits.grad[~allowed].abs().max() == 0
    reference = scores.clone().requires_grad_(True)
    masked = reference.masked_fill(~allowed, float("-inf"))
    ref_lse = torch.where(real, torch.where(real[..., None], masked, 0.0).logsumexp(-1), 0.0)
    ref_out = torch.softmax(torch.where(real[..., None], masked, 0.0), -1) @ values * real[..., None]
    (ref_lse * upstream).sum().add(ref_out.sum()).backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=0, atol=1e-12)
