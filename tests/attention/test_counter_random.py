"""Counter-based random numbers (evaluation draws of RA and LSH): distribution, determinism, independence of the
shape they are drawn in."""

from __future__ import annotations

import math

import torch

from attnzoo.modeling.attention.counter_random import counter_normal, counter_uniform


def test_counter_uniform_is_uniform_on_the_open_unit_interval():
    u = counter_uniform(7, torch.arange(200_000))
    assert u.dtype == torch.float64 and 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 3e-3 and abs(u.var().item() - 1 / 12) < 2e-3
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)  # chi-square over 20 bins, 19 dof: 99.9% quantile is 43.8
    expected = u.numel() / 20
    assert ((counts - expected) ** 2 / expected).sum().item() < 43.8


def test_counter_normal_is_standard_normal():
    z = counter_normal(3, (400, 500), "cpu", torch.float64)
    assert abs(z.mean().item()) < 1e-2 and abs(z.std().item() - 1.0) < 1e-2
    # tail masses of N(0, 1): P(|z| > 2) = 0.0455, P(|z| > 3) = 0.0027
    assert abs((z.abs() > 2).double().mean().item() - 0.0455) < 2e-3
    assert abs((z.abs() > 3).double().mean().item() - 0.0027) < 5e-4
    # neighbouring elements are uncorrelated
    flat = z.flatten()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()) < 1e-2


def test_draws_depend_on_seed_and_counters_only():
    assert torch.equal(counter_normal(5, (6, 4), "cpu"), counter_normal(5, (6, 4), "cpu"))
    assert torch.equal(counter_normal(5, (6, 4), "cpu").flatten(), counter_normal(5, (24,), "cpu"))
    assert not torch.allclose(counter_normal(5, (24,), "cpu"), counter_normal(6, (24,), "cpu"))
    # broadcasting counters gives each element the number it gets alone, and leaves the global RNG untouched
    state = torch.get_rng_state()
    grid = counter_uniform(9, torch.arange(4)[:, None], torch.arange(3)[None, :])
    assert torch.equal(torch.get_rng_state(), state)
    for i in range(4):
        for j in range(3):
            assert grid[i, j] == counter_uniform(9, torch.tensor(i), torch.tensor(j))
    assert not math.isclose(counter_uniform(9, torch.tensor(1), torch.tensor(2)).item(),
                            counter_uniform(9, torch.tensor(2), torch.tensor(1)).item())
