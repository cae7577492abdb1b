"""The random-feature machinery Performer, RA and LARA share (`attention/random_features.py`): the positive and
hyperbolic feature maps are unbiased, orthogonal projections have their structure, the three exact linear-attention
forms agree, and the stabilising constants cancel."""

import math

import pytest
import torch

from attnzoo.modeling.attention import softmax_attention_reference
from attnzoo.modeling.attention.random_features import (
    gaussian_projection,
    linear_attention_bidirectional,
    linear_attention_reference,
    log_positive_features,
    positive_random_features,
    stabilised_key_features,
    stabilised_query_features,
)


def pair(d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)


def kernel_samples(x, y, projection, hyperbolic=False):
    """One unbiased estimate of exp(x̂·ŷ) per projection draw: φ(x)·φ(y)."""
    fx = positive_random_features(x.view(1, 1, 1, -1), projection, hyperbolic)[0, :, 0]
    fy = positive_random_features(y.view(1, 1, 1, -1), projection, hyperbolic)[0, :, 0]
    return (fx * fy).sum(-1)


def assert_unbiased(samples, exact):
    mean, stderr = samples.mean(), samples.std() / math.sqrt(samples.numel())
    assert abs(mean - exact) < 4 * stderr, (float(mean), float(exact), float(stderr))


# -- the feature maps are unbiased ------------------------------------------------------------------
@pytest.mark.parametrize("hyperbolic", [False, True])
@pytest.mark.parametrize("orthogonal", [False, True])
def test_feature_kernel_is_unbiased(hyperbolic, orthogonal):
    torch.manual_seed(0)
    x, y = pair()
    exact = torch.exp((x * y).sum() / math.sqrt(8))
    projection = gaussian_projection((40000, 8), 8, orthogonal=orthogonal, dtype=torch.float64)
    assert_unbiased(kernel_samples(x, y, projection, hyperbolic), exact)


def test_hyperbolic_features_have_lower_variance():
    torch.manual_seed(0)
    x, y = pair(seed=3)
    projection = gaussian_projection((20000, 1), 8, orthogonal=False, dtype=torch.float64)
    assert kernel_samples(x, y, projection, True).var() < kernel_samples(x, y, projection, False).var()


def test_orthogonal_features_without_the_sign_fix_are_biased():
    # The reason for the fix: LAPACK's QR signs are not Haar-uniform, so plain Q rows are not isotropic.
    torch.manual_seed(0)
    d = 4
    # Vectors near the first axis, where the sign convention bites hardest (Q[0, 0] < 0 always).
    x = torch.tensor([1.2, 0.2, 0.0, 0.0], dtype=torch.float64)
    y = torch.tensor([1.0, -0.2, 0.1, 0.0], dtype=torch.float64)
    exact = torch.exp((x * y).sum() / math.sqrt(d))
    q, _ = torch.linalg.qr(torch.randn(100000, d, d, dtype=torch.float64))
    lengths = torch.randn(100000, d, d, dtype=torch.float64).norm(dim=-1)
    unfixed = q.transpose(-1, -2) * lengths.unsqueeze(-1)
    samples = kernel_samples(x, y, unfixed)
    stderr = samples.std() / math.sqrt(samples.numel())
    assert abs(samples.mean() - exact) > 10 * stderr
    fixed = gaussian_projection((100000, d), d, orthogonal=True, dtype=torch.float64)
    assert_unbiased(kernel_samples(x, y, fixed), exact)


# -- orthogonal random features ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["chi", "sqrt_d"])
def test_orthogonal_projection_structure(norm):
    torch.manual_seed(0)
    w = gaussian_projection((3, 20), 8, orthogonal=True, norm=norm, dtype=torch.float64)
    assert w.shape == (3, 20, 8)
    for head in w:
        for block in (head[:8], head[8:16], head[16:]):
            gram = block @ block.T
            off_diagonal = gram - torch.diag(torch.diagonal(gram))
            assert off_diagonal.abs().max() < 1e-10
    norms = w.norm(dim=-1)
    if norm == "sqrt_d":
        torch.testing.assert_close(norms, torch.full_like(norms, math.sqrt(8)))
    else:
        assert not torch.allclose(norms, norms[0, 0].expand_as(norms))
        assert abs(float((norms ** 2).mean()) - 8) < 1.5  # χ²_d has mean d


# -- the exact linear-attention forms agree ----------------------------------------------------------------------------
def random_features(n=13, r=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(2, 3, n, r, generator=g, dtype=torch.float64) + 0.01
    phi_k = torch.rand(2, 3, n, r, generator=g, dtype=torch.float64) + 0.01
    v = torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64)
    return phi_q, phi_k, v


def test_bidirectional_linear_equals_quadratic():
    phi_q, phi_k, v = random_features()
    torch.testing.assert_close(linear_attention_bidirectional(phi_q, phi_k, v),
                               linear_attention_reference(phi_q, phi_k, v, None), rtol=1e-10, atol=1e-12)


# -- the stabilising constants cancel -------------------------------------------------------------------------------
def test_output_is_invariant_to_the_stabilising_constants():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    w = gaussian_projection((2, 16), 8, orthogonal=True, dtype=torch.float64)
    lq, lk = log_positive_features(q, w), log_positive_features(k, w)
    phi_k, _ = stabilised_key_features(lk, None)
    base = linear_attention_bidirectional(stabilised_query_features(lq), phi_k, v)
    shifted_k, _ = stabilised_key_features(lk + 7.0, None)
    shifted_q = stabilised_query_features(lq + torch.randn(1, 2, 9, 1, dtype=torch.float64) * 5)
    torch.testing.assert_close(linear_attention_bidirectional(shifted_q, shifted_k, v), base, rtol=1e-10, atol=0)
    unstabilised = linear_attention_bidirectional(torch.exp(lq), torch.exp(lk), v)
    torch.testing.assert_close(unstabilised, base, rtol=1e-10, atol=1e-12)


# -- approximation quality ----------------------------------------------------------------------------------
def test_error_against_softmax_falls_as_features_grow():
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 32, 16, dtype=torch.float64) * 0.7 for _ in range(3))
    exact = softmax_attention_reference(q, k, v)
    errors = []
    for m in (8, 64, 512):
        mse = []
        for _ in range(8):
            w = gaussian_projection((2, m), 16, orthogonal=True, dtype=torch.float64)
            phi_k, _ = stabilised_key_features(log_positive_features(k, w), None)
            phi_q = stabilised_query_features(log_positive_features(q, w))
            mse.append(((linear_attention_bidirectional(phi_q, phi_k, v) - exact) ** 2).mean())
        errors.append(float(torch.stack(mse).mean()))
    assert errors[0] > 2 * errors[1] > 4 * errors[2], errors
