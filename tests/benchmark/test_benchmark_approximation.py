"""The approximation-quality benchmark (Figure 1 of arXiv 2204.04667): its estimators and diagnostics, and a quick
end-to-end run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnzoo.modeling.attention import softmax_attention_reference
from attnzoo.modeling.attention.randomized import randomized_aggregate, sample_omega
from tests.scripts_helpers import ROOT, load_module

BENCHMARKS = ROOT / "benchmarks"
aq = load_module(BENCHMARKS, "approximation_quality")
est = aq.est  # imported by the script from its folder, as a regular module


def qkv(batch=2, heads=2, n=16, d=16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64) * scale for _ in range(3)]


def identity_values(q):
    batch, heads, n, _ = q.shape
    return torch.eye(n, dtype=q.dtype).expand(batch, heads, n, n)


def test_effective_sample_size_counts_equal_weights_and_rejects_unnormalised_ones():
    weights = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(est.effective_sample_size(weights), torch.tensor([4.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="normalised"):
        est.effective_sample_size(torch.tensor([[0.5, 0.2]]))


def test_softmax_self_weight_is_the_diagonal_of_softmax_attention():
    q, k, _ = qkv()
    attention = softmax_attention_reference(q, k, identity_values(q))  # values = one-hot positions: A itself
    torch.testing.assert_close(est.softmax_self_weight(q, k), torch.diagonal(attention, dim1=-2, dim2=-1))


def test_performer_snis_weights_reproduce_its_output_and_self_weight():
    q, k, v = qkv()
    torch.manual_seed(0)
    projection = est.performer_projection(2, 24, 16, "cpu", torch.float64)
    approx = est.performer(q, k, v, projection)
    # Σ_c w_nc f(ω_c) with the reported weights is the zoo's linear-attention output.
    key_probs = est.log_positive_features(k, projection).softmax(-2)
    torch.testing.assert_close(approx.weights @ (key_probs.transpose(-1, -2) @ v), approx.output, rtol=1e-10,
                               atol=1e-12)
    implied = est.performer(q, k, identity_values(q), projection).output
    torch.testing.assert_close(approx.self_weight, torch.diagonal(implied, dim1=-2, dim2=-1), rtol=1e-10, atol=1e-12)
    assert torch.all(approx.effective_sample_size() <= 24 + 1e-9) and torch.all(approx.effective_sample_size() >= 1)


def test_paper_code_performer_without_eps_and_floor_is_the_zoo_performer():
    q, k, v = qkv(scale=0.8)
    torch.manual_seed(1)
    projection = est.performer_projection(2, 32, 16, "cpu", torch.float64)
    plain = est.paper_code_performer(q, k, v, projection, eps=0.0, denominator_floor=0.0)
    torch.testing.assert_close(plain.output, est.performer(q, k, v, projection).output, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(plain.row_mass, torch.ones_like(plain.row_mass))


def test_paper_code_performer_is_biased_where_the_zoo_performer_keeps_improving():
    q, k, v = qkv(batch=2, heads=1, n=32, d=16, seed=3)
    q, k = q * 0.5, k * 0.5  # mild attention logits (std ~0.25): Monte Carlo error ~ 1/features
    exact = softmax_attention_reference(q, k, v)
    errors = {"zoo": [], "paper_code": []}
    torch.manual_seed(2)
    for features in (32, 256, 2048):
        zoo = paper = 0.0
        for _ in range(4):
            projection = est.performer_projection(1, features, 16, "cpu", torch.float64)
            zoo += ((est.performer(q, k, v, projection).output - exact) ** 2).mean().item() / 4
            approx = est.paper_code_performer(q, k, v, projection)
            paper += ((approx.output - exact) ** 2).mean().item() / 4
        errors["zoo"].append(zoo)
        errors["paper_code"].append(paper)
    assert errors["zoo"][2] < errors["zoo"][0] / 20, errors  # unbiased features: error ~ 1/m
    assert errors["paper_code"][2] > 0.8 * errors["paper_code"][1], errors  # a floor that features don't lower
    assert errors["paper_code"][2] > 5 * errors["zoo"][2], errors
    assert approx.row_mass.mean() < 0.99  # the denominator floor binds for some queries: their outputs shrink


@pytest.mark.parametrize("noise", ["official", "paper"])
def test_lara_weights_reproduce_its_output_and_self_weight(noise):
    q, k, v = qkv(batch=2, heads=2, n=16, d=16, seed=4)
    for training in (False, True):
        module = est.lara_module(2, 16, 4, 2, noise, training, "cpu", torch.float64)
        torch.manual_seed(5)
        approx = est.lara(module, q, k, v, (4, 4))
        torch.manual_seed(5)  # the same ω
        key_probs = module.bidirectional_terms(q, k, v, None, (4, 4))[1].softmax(-2)
        torch.testing.assert_close(approx.weights @ (key_probs.transpose(-1, -2) @ v), approx.output, rtol=1e-10,
                                   atol=1e-12)
        torch.manual_seed(5)  # the implied attention is the output for one-hot values
        implied = est.lara(module, q, k, identity_values(q), (4, 4)).output
        torch.testing.assert_close(approx.self_weight, torch.diagonal(implied, dim1=-2, dim2=-1), rtol=1e-10,
                                   atol=1e-12)
        assert approx.samples == 8 and torch.all(approx.effective_sample_size() <= 8 + 1e-9)


def test_only_the_paper_noise_scale_is_consistent_at_fixed_proposals():
    """The evidence for LARA's default sample_noise_std="paper" (arXiv 2204.04667, Eq. 38 weights a sample by
    unit-covariance proposal densities): with the proposals fixed, drawing more samples from each drives σ = 1's error
    down, while σ = d^-1/4 ("official", the authors' code) converges to a biased estimate and levels off."""
    def mse(noise, per_proposal):
        total = 0.0
        for seed in range(4):
            q, k, v = qkv(seed=seed)
            torch.manual_seed(100 + seed)
            module = est.lara_module(2, 16, 4, per_proposal, noise, True, "cpu", torch.float64)
            total += (est.lara(module, q, k, v, (4, 4)).output - softmax_attention_reference(q, k, v)).pow(2).mean()
        return total.item() / 4

    paper, official = ([mse(noise, per) for per in (16, 1024)] for noise in ("paper", "official"))
    assert paper[1] < 0.4 * paper[0]  # measured 0.23x
    assert official[1] > 0.75 * official[0]  # measured 0.91x: the bias stays
    assert paper[1] < official[1]


def test_ra_matches_the_zoo_sampler_and_reports_its_self_weight():
    q, k, v = qkv(batch=1, heads=2, n=12, d=8, seed=6)
    torch.manual_seed(7)
    approx = est.ra(q, k, v, 5, compute_dtype=torch.float64)
    torch.manual_seed(7)
    scale = 8 ** -0.25
    zoo = randomized_aggregate(sample_omega(q * scale, k * scale, None, "unbiased", 5, 1.0), k * scale, v, None)
    torch.testing.assert_close(approx.output, zoo, rtol=1e-10, atol=1e-12)
    torch.manual_seed(7)
    implied = est.ra(q, k, identity_values(q), 5, compute_dtype=torch.float64).output
    torch.testing.assert_close(approx.self_weight, torch.diagonal(implied, dim1=-2, dim2=-1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(approx.effective_sample_size(), torch.full((1, 2, 12), 5.0, dtype=torch.float64))


def test_ra_query_chunks_give_the_same_estimator(monkeypatch):
    q, k, v = qkv(batch=1, heads=1, n=12, d=8, seed=8)
    exact = softmax_attention_reference(q, k, v)
    monkeypatch.setattr(est, "RA_CHUNK_ELEMENTS", 12 * 400 * 12)  # a single chunk
    torch.manual_seed(0)
    whole = ((est.ra(q, k, v, 400, compute_dtype=torch.float64).output - exact) ** 2).mean()
    monkeypatch.setattr(est, "RA_CHUNK_ELEMENTS", 400 * 12 * 5)  # chunks of 5 queries (the last one of 2)
    chunked = est.ra(q, k, v, 400, compute_dtype=torch.float64)
    assert ((chunked.output - exact) ** 2).mean() < 4 * whole and whole < 1e-3
    assert chunked.self_weight.shape == (1, 1, 12)


@pytest.mark.parametrize("bad, message", [
    (["--samples", "4", "10"], "--samples 10: every count must be a perfect square"),
    (["--samples", "16", "4"], "--samples and --per_proposal must be increasing"),
    (["--draws", "0"], "--draws must be at least 1"),
    (["--train_images", "10"], "--train_images must be between"),
])
def test_bad_benchmark_arguments_raise_naming_the_flag(bad, message):
    with pytest.raises(ValueError, match=message):
        aq.parse_args(bad)


def test_synthetic_data_refuses_an_unknown_distribution():
    with pytest.raises(ValueError, match="iid"):
        aq.synthetic_qkv("uniform", 1, 0, "cpu")


@pytest.mark.slow
def test_quick_run_writes_every_measurement(tmp_path):
    out = tmp_path / "aq.json"
    aq.main(["--quick", "--output", str(out)])
    result = json.loads(out.read_text())
    assert set(result["sources"]) == {"vit", "iid", "clustered"}
    assert 0.0 <= result["run"]["vit_test_accuracy"] <= 1.0 and result["benchmark"] == "approximation_quality"
    for source in result["sources"].values():
        assert set(source["methods"]) == set(aq.METHODS)
        for name, values in source["methods"].items():
            assert set(values["mse"]) == {"4", "16"}
            assert all(math.isfinite(x) and x > 0 for x in values["mse"].values())
            assert all(1.0 - 1e-9 <= values["ess"][m] <= int(m) + 1e-9 for m in values["ess"]), name
            assert all(0.0 < x < 1.0 for x in values["self_weight"].values())
        assert set(source["consistency"]) == {"lara_official_sigma", "lara_paper_sigma"}
        assert set(source["consistency"]["lara_paper_sigma"]["mse"]) == {"1", "4"}
        assert source["findings"]["ordering_by_mse"]["16"].count("<") == 5
        assert 0 < source["softmax_self_weight"] < 1 and source["reference_mse"]["zero_output"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
