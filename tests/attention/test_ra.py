"""Randomized attention: unbiased with the paper's noise (and biased with the official code's), the exact index
sampler, seeded evaluation draws, the biased variant, and the fast path against the density-ratio reference (values
and gradients)."""

import math

import pytest
import torch

from attnzoo import ZooRAConfig
from attnzoo.modeling.attention import RandomizedAttention, softmax_attention_reference
from attnzoo.modeling.attention.base import allowed_keys
from attnzoo.modeling.attention.counter_random import counter_uniform
from attnzoo.modeling.attention.randomized import sample_index, sample_omega
from tests.attention.helpers import assert_same_values_and_gradients, scaled_qkv

D = 8


def mc_check(samples_mean, samples_std, count, exact):
    """The largest |mean - exact| in standard errors of the Monte Carlo mean."""
    stderr = samples_std / math.sqrt(count)
    z = ((samples_mean - exact).abs() / stderr.clamp(min=1e-12))
    return z.max()


# -- unbiased with the paper's noise --------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padded"])
def test_ra_is_unbiased_with_paper_noise(mask_kind):
    torch.manual_seed(0)
    q_hat, k_hat, v = scaled_qkv()
    key_mask = torch.ones(1, 12, dtype=torch.bool)
    if mask_kind == "padded":
        key_mask[0, 9:] = False
    allowed = allowed_keys(key_mask if mask_kind == "padded" else None, 12, 12, mask_kind == "causal", "cpu")
    exact = softmax_attention_reference(q_hat * D ** 0.25, k_hat * D ** 0.25, v, allowed)
    draws = 40000
    omega = sample_omega(q_hat, k_hat, allowed, "unbiased", draws, noise_std=1.0)
    logits = omega @ k_hat.unsqueeze(2).transpose(-1, -2) - 0.5 * (k_hat * k_hat).sum(-1)[:, :, None, None, :]
    if allowed is not None:
        logits = logits.masked_fill(~allowed.unsqueeze(3), float("-inf"))
    per_draw = logits.softmax(-1) @ v.unsqueeze(2)  # [1, 1, N, S, d_v]
    z = mc_check(per_draw.mean(3), per_draw.std(3), draws, exact)
    assert z < 4.5, f"largest deviation {z:.2f} standard errors"


def test_official_noise_scale_makes_ra_biased():
    # The official code's noise, σ = d^(-1/4) in these coordinates, makes the estimator biased.
    torch.manual_seed(0)
    q_hat, k_hat, v = scaled_qkv()
    exact = softmax_attention_reference(q_hat * D ** 0.25, k_hat * D ** 0.25, v)
    omega = sample_omega(q_hat, k_hat, None, "unbiased", 40000, noise_std=D ** -0.25)
    per_draw = torch.softmax(omega @ k_hat.unsqueeze(2).transpose(-1, -2)
                             - 0.5 * (k_hat * k_hat).sum(-1)[:, :, None, None, :], -1) @ v.unsqueeze(2)
    assert mc_check(per_draw.mean(3), per_draw.std(3), 40000, exact) > 10


# -- the sampler and evaluation draws -------------------------------------------------------------------------------
def test_index_sampler_matches_softmax_probabilities():
    torch.manual_seed(0)
    scores = torch.randn(1, 1, 1, 12, dtype=torch.float64) * 1.5
    draws = 60000
    index = sample_index(scores, draws)[0, 0, 0]
    observed = torch.bincount(index, minlength=12).double()
    expected = scores.softmax(-1)[0, 0, 0] * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 31.26, chi2  # 99.9% quantile of chi-square with 11 degrees of freedom


def ra_module(variant, **kw):
    config = ZooRAConfig(hidden_size=16, num_attention_heads=2, intermediate_size=32, num_hidden_layers=1,
                         ra_variant=variant, **kw)
    return RandomizedAttention(config, 0, causal=False).double()


def test_unbiased_ra_at_evaluation_has_no_noise_but_still_samples_the_index():
    torch.manual_seed(0)
    q_hat, k_hat, _ = scaled_qkv()
    omega = sample_omega(q_hat, k_hat, None, "unbiased", 64, noise_std=0.0)
    offsets = (omega - q_hat.unsqueeze(3))[0, 0]  # each must be exactly one of the keys
    distance = (offsets.unsqueeze(-2) - k_hat[0, 0][None, None]).abs().sum(-1).min(-1).values
    assert distance.max() < 1e-12
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    stochastic = ra_module("unbiased", eval_seed=None).eval()  # sampling at evaluation stays an explicit option
    assert not torch.equal(stochastic(x), stochastic(x))
    seeded = ra_module("unbiased").eval()  # the default: seeded draws, the same on every call
    assert torch.equal(seeded(x), seeded(x))
    assert not torch.equal(seeded(x), ra_module("unbiased", eval_seed=1).eval()(x))


def test_seeded_evaluation_draws_follow_the_softmax_and_ignore_the_batch():
    scores = torch.randn(1, 1, 1, 12, dtype=torch.float64) * 1.5
    draws = 60000
    uniform = counter_uniform(5, torch.arange(draws)[:, None], torch.arange(12)[None, :])[None, None, None]
    index = sample_index(scores, draws, uniform)[0, 0, 0]
    observed = torch.bincount(index, minlength=12).double()
    expected = scores.softmax(-1)[0, 0, 0] * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 31.26, chi2  # 99.9% quantile of chi-square with 11 degrees of freedom
    # A row's draws depend on its positions only: alone, in a batch, or left-padded, the output is the same.
    module = ra_module("unbiased").eval()
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    alone = module(x[1:2])
    torch.testing.assert_close(module(x)[1:2], alone, rtol=0, atol=1e-12)
    padded = torch.cat([torch.randn(1, 4, 16, dtype=torch.float64), x[1:2]], dim=1)
    mask = torch.ones(1, 14, dtype=torch.bool)
    mask[0, :4] = False
    torch.testing.assert_close(module(padded, attention_mask=mask)[:, 4:], alone, rtol=0, atol=1e-12)


def test_biased_ra_is_deterministic_at_evaluation_and_uses_the_mean_key():
    torch.manual_seed(0)
    q_hat, k_hat, v = scaled_qkv()
    omega = sample_omega(q_hat, k_hat, None, "biased", 1, noise_std=0.0)
    pi = (q_hat @ k_hat.transpose(-1, -2)).softmax(-1)
    torch.testing.assert_close(omega[:, :, :, 0], q_hat + pi @ k_hat)
    module = ra_module("biased").eval()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    assert torch.equal(module(x), module(x))


def test_ra_fast_path_equals_its_density_ratio_reference():
    module = ra_module("unbiased", ra_num_samples=3).train()
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    torch.manual_seed(5)
    fast = module(x, attention_mask=mask)
    torch.manual_seed(5)  # the same draws
    slow = module.reference_forward(x, attention_mask=mask)
    assert_same_values_and_gradients(module, x, mask.bool(), fast, slow)
