"""Linear randomized attention: how it relates to RA and Performer, consistency, its weights, the two written forms
(values and gradients), landmarks, padding, determinism, and this project's causal LARA (parallel = quadratic
reference = recurrent decoding, no future leak)."""

import math

import pytest
import torch

from attnzoo import ZooLARAConfig, ZooLARAForCausalLM
from attnzoo.modeling.attention import LinearRandomizedAttention, softmax_attention_reference
from attnzoo.modeling.attention.base import allowed_keys
from attnzoo.modeling.attention.lara import segment_assignment
from attnzoo.modeling.attention.random_features import (
    linear_attention_bidirectional,
    log_features_at,
    snis_attention,
)
from attnzoo.modeling.attention.randomized import randomized_aggregate, sample_omega
from attnzoo.modeling.cache import ZooCache
from tests.attention.helpers import assert_same_values_and_gradients, scaled_qkv

D = 8


# -- RA is LARA with C = N and delta weights ------------------------------------------------------------------------
def test_snis_core_with_delta_weights_gives_ra():
    torch.manual_seed(0)
    q_hat, k_hat, v = scaled_qkv()
    omega = sample_omega(q_hat, k_hat, None, "unbiased", 1, noise_std=1.0)
    ra = randomized_aggregate(omega, k_hat, v, None)
    samples = omega[:, :, :, 0]  # one sample per query: C = N
    delta = torch.full((12, 12), float("-inf"), dtype=torch.float64).fill_diagonal_(0.0)
    out = snis_attention(log_features_at(q_hat, samples), log_features_at(k_hat, samples), v, delta,
                         torch.zeros(1, 1, 1, 12, dtype=torch.float64))
    torch.testing.assert_close(out, ra, rtol=1e-12, atol=1e-12)


# -- LARA with zero means and the balance heuristic is Performer ----------------------------------------------------
def test_lara_with_zero_means_and_balance_heuristic_is_performer():
    torch.manual_seed(0)
    q_hat, k_hat, v = scaled_qkv()
    omega = torch.randn(1, 1, 6, D, dtype=torch.float64)  # C = 6 samples from the proposals N(0, I)
    log_q, log_k = log_features_at(q_hat, omega), log_features_at(k_hat, omega)
    # μ_c = 0: every proposal density ratio is ξ(0, ω) = 1, so β_c = 1/C for all c.
    lara = snis_attention(log_q, log_k, v, torch.full((1, 1, 1, 6), -math.log(6), dtype=torch.float64),
                          torch.zeros(1, 1, 1, 6, dtype=torch.float64))
    performer = linear_attention_bidirectional(log_q.exp(), log_k.exp(), v)
    torch.testing.assert_close(lara, performer, rtol=1e-12, atol=1e-12)


# -- LARA modules ---------------------------------------------------------------------------------------------------
def lara_module(causal=False, heads=2, **kw):
    values = dict(hidden_size=heads * D, num_attention_heads=heads, intermediate_size=32, num_hidden_layers=1,
                  lara_num_samples=4, lara_chunk_size=3, sample_noise_std="paper")
    values.update(kw)
    torch.manual_seed(0)
    module = LinearRandomizedAttention(ZooLARAConfig(**values), 0, causal=causal).double()
    with torch.no_grad():  # identity output projection: module outputs are the attention outputs themselves
        module.o_proj.weight.copy_(torch.eye(heads * D))
        module.o_proj.bias.zero_()
    return module


def exact_softmax(module, x, mask=None, causal=False):
    q, k, v = (module.split_heads(p(x)) for p in (module.q_proj, module.k_proj, module.v_proj))
    allowed = allowed_keys(mask.bool() if mask is not None else None, x.shape[1], x.shape[1], causal, "cpu")
    return module.merge_heads(softmax_attention_reference(q, k, v, allowed))


# -- consistency: more samples per proposal, lower error ------------------------------------------------------------
def test_lara_error_falls_as_samples_per_proposal_grow():
    x = torch.randn(2, 16, 2 * D, dtype=torch.float64)
    errors = []
    for per in (1, 16, 256):
        module = lara_module(lara_samples_per_proposal=per, lara_weighting="balance").train()
        exact = exact_softmax(module, x)
        torch.manual_seed(1)
        with torch.no_grad():
            errors.append(float(torch.stack([((module(x) - exact) ** 2).mean() for _ in range(4)]).mean()))
    assert errors[0] > 4 * errors[1] > 16 * errors[2], errors


# -- valid weights and the convex hull ------------------------------------------------------------------------------
def test_balance_heuristic_matches_gaussian_densities_and_the_correction_sums_to_zero():
    module = lara_module(lara_alpha_coeff=0.01).train()  # small λ: no clamping
    x = torch.randn(2, 11, 2 * D, dtype=torch.float64)
    torch.manual_seed(2)
    log_q, log_k, v, log_alpha, log_proposal = module._bidirectional_terms(x, None)
    # Recompute the proposals with the same draws to check β_c = N(ω_c; μ_c, I) / Σ_c' N(ω_c; μ_c', I).
    torch.manual_seed(2)
    module.weighting = "balance"
    log_balance = module._bidirectional_terms(x, None)[3]
    q, k, _ = module._inputs(x)
    q_bar, k_bar, valid = module._landmarks(q, k, None, None)
    mu = module._proposal_means(q_bar * D ** -0.25, k_bar * D ** -0.25, valid)
    torch.manual_seed(2)
    omega = module._draw(mu)
    log_normal = -0.5 * ((omega.unsqueeze(-2) - mu.unsqueeze(-3)) ** 2).sum(-1)  # [B, H, sample, proposal]
    expected = torch.diagonal(log_normal, dim1=-2, dim2=-1) - torch.logsumexp(log_normal, -1)
    torch.testing.assert_close(log_balance[:, :, 0], expected, rtol=1e-10, atol=1e-12)
    correction = log_alpha.exp() - log_balance.exp()  # λ (r_nc − mean_c r_nc): zero sum over proposals
    torch.testing.assert_close(correction.sum(-1), torch.zeros_like(correction[..., 0]), rtol=0, atol=1e-12)
    out = snis_attention(log_q, log_k, v, log_alpha, log_proposal)
    low, high = v.amin(2, keepdim=True), v.amax(2, keepdim=True)
    assert (out >= low - 1e-12).all() and (out <= high + 1e-12).all()


# -- the log-space SNIS form equals the linear-attention form ---------------------------------------------
@pytest.mark.parametrize("settings", [
    dict(), dict(lara_weighting="balance"), dict(lara_proposal_mean="q+mixed_k"), dict(lara_r_normalize="proposals"),
    dict(lara_samples_per_proposal=3), dict(lara_landmark_transform=False),
])
@pytest.mark.parametrize("training", [False, True])
def test_lara_two_written_forms_agree(settings, training):
    module = lara_module(**settings).train(training)
    x = torch.randn(3, 11, 2 * D, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 2:] = 0  # fewer real tokens than proposals
    torch.manual_seed(3)
    fast = module(x, attention_mask=mask)
    torch.manual_seed(3)  # the same draws
    slow = module.reference_forward(x, attention_mask=mask)
    assert_same_values_and_gradients(module, x, mask.bool(), fast, slow, rtol=1e-9, atol=1e-11)


def test_lara_two_forms_agree_with_2d_landmarks():
    module = lara_module(lara_landmarks="2d", lara_num_samples=4, lara_proposal_mean="q+mixed_k").eval()
    module.set_image_layout((6, 6), class_token=False)
    x = torch.randn(2, 36, 2 * D, dtype=torch.float64, requires_grad=True)
    assert_same_values_and_gradients(module, x, None, module(x), module.reference_forward(x))


# -- landmarks ------------------------------------------------------------------------------------------------------
def test_segments_follow_the_uneven_rule_and_skip_padding():
    sizes = segment_assignment(None, 1, 10, 4, "cpu").sum(-1)[0]
    assert sizes.tolist() == [2, 2, 3, 3]
    assert segment_assignment(None, 1, 3, 4, "cpu").sum(-1)[0].tolist() == [1, 1, 1, 0]  # N <= C: one per token
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # 10 real tokens, left padded
    assign = segment_assignment(mask, 1, 12, 4, "cpu")[0]
    assert assign.sum(-1).tolist() == [2, 2, 3, 3] and assign[:, :2].sum() == 0
    first_tokens = assign.argmax(-1).tolist()
    assert first_tokens == [2, 4, 6, 9]


def test_2d_landmarks_average_grid_blocks_and_need_a_square_count():
    module = lara_module(lara_landmarks="2d", lara_num_samples=49, lara_landmark_transform=False, heads=1)
    q = torch.arange(196, dtype=torch.float64).view(1, 1, 196, 1).expand(1, 1, 196, D)
    q_bar, _, valid = module._landmarks(q, q, None, (14, 14))
    grid = torch.arange(196, dtype=torch.float64).view(14, 14)
    expected = grid.view(7, 2, 7, 2).mean((1, 3)).flatten()
    torch.testing.assert_close(q_bar[0, 0, :, 0], expected)
    assert valid is None  # every pooled cell has tokens
    with pytest.raises(ValueError, match="perfect square"):
        ZooLARAConfig(lara_landmarks="2d", lara_num_samples=50)
    module.set_image_layout((14, 14), class_token=False)
    with pytest.raises(ValueError, match="patch grid"):
        module(torch.randn(1, 197, D, dtype=torch.float64))  # a class token besides the grid


def test_padded_tokens_do_not_change_landmarks_or_outputs():
    module = lara_module().eval()
    x = torch.randn(1, 9, 2 * D, dtype=torch.float64)
    padded = torch.cat([x, torch.randn(1, 3, 2 * D, dtype=torch.float64) * 50], dim=1)
    mask = torch.tensor([[1] * 9 + [0] * 3])
    torch.testing.assert_close(module(padded, attention_mask=mask)[:, :9], module(x), rtol=1e-10, atol=1e-12)


# -- determinism and gradients --------------------------------------------------------------------------------------
def test_lara_evaluation_is_deterministic_and_gradients_reach_landmarks():
    module = lara_module().eval()
    x = torch.randn(2, 10, 2 * D, dtype=torch.float64)
    assert torch.equal(module(x), module(x))
    module.train()
    x.requires_grad_(True)
    module(x).sum().backward()
    for name, p in module.named_parameters():
        if name.startswith("o_proj"):
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_snis_output_has_correct_gradient_with_respect_to_the_proposal_means():
    torch.manual_seed(0)
    q_hat, k_hat, v = scaled_qkv(n=6)
    noise = torch.randn(1, 1, 3, D, dtype=torch.float64)

    def lara_of_mu(mu):
        omega = mu + noise
        log_density = log_features_at(mu, omega).transpose(-1, -2)
        own = torch.diagonal(log_density, dim1=-2, dim2=-1)
        log_balance = own - torch.logsumexp(log_density, -1)
        return snis_attention(log_features_at(q_hat, omega), log_features_at(k_hat, omega), v,
                              log_balance.unsqueeze(2), own.unsqueeze(2))

    mu = (torch.randn(1, 1, 3, D, dtype=torch.float64) * 0.5).requires_grad_(True)
    assert torch.autograd.gradcheck(lara_of_mu, (mu,), eps=1e-6, atol=1e-6)


# -- causal LARA (docs/random_feature_attention.md) -----------------------------------------------------------------
def test_causal_lara_parallel_equals_quadratic_reference():
    module = lara_module(causal=True).train()
    x = torch.randn(2, 13, 2 * D, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(4)
    fast = module(x)
    torch.manual_seed(4)  # the same draws
    assert_same_values_and_gradients(module, x, None, fast, module.reference_forward(x), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("weighting", ["query_specific", "balance"])
def test_causal_lara_recurrent_decoding_equals_parallel(weighting):
    module = lara_module(causal=True, lara_weighting=weighting).eval()
    x = torch.randn(2, 17, 2 * D, dtype=torch.float64) * 2
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[1, :4] = 0  # left padding: row 1's chunks start 4 positions later
    full = module(x, attention_mask=mask)
    cache = ZooCache([module.new_cache_layer()])
    pieces = [module(x[:, :5], attention_mask=mask[:, :5], cache=cache)]
    pieces += [module(x[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache) for t in range(5, 14)]
    pieces.append(module(x[:, 14:], attention_mask=mask, cache=cache))
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], rtol=1e-10, atol=1e-12)


def test_causal_lara_does_not_see_the_future_in_training_mode():
    torch.manual_seed(0)
    config = ZooLARAConfig(vocab_size=40, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                           num_hidden_layers=2, lara_num_samples=4, lara_chunk_size=3, hidden_dropout_prob=0.0)
    model = ZooLARAForCausalLM(config).double().train()
    ids = torch.randint(0, 40, (2, 20))
    changed = ids.clone()
    changed[:, 11:] = torch.randint(0, 40, (2, 9))
    torch.manual_seed(1)
    a = model(ids).logits
    torch.manual_seed(1)
    b = model(changed).logits
    torch.testing.assert_close(a[:, :11], b[:, :11], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, 11:], b[:, 11:])


def test_causal_lara_gradients_stay_finite_with_large_activations():
    # Regression: unavailable proposals' weights overflowed to inf before masking (proposals far apart, float32),
    # and the backward turned their zero gradient into NaN (seen as a NaN loss in a byte-LM run).
    module = lara_module(causal=True, lara_landmark_transform=False).float().train()
    x = (torch.randn(2, 40, 2 * D) * 30).requires_grad_(True)
    module(x).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("bad", [dict(lara_weighting="optimal"), dict(lara_proposal_mean="eq33"),
                                 dict(lara_num_samples=0), dict(lara_landmarks="3d"), dict(sample_noise_std="loud"),
                                 dict(lara_r_normalize="keys")])
def test_bad_lara_settings_raise_naming_the_field(bad):
    with pytest.raises(ValueError, match=rf"^{next(iter(bad))}=.* is invalid: "):
        ZooLARAConfig(**bad)


def test_causal_lara_takes_one_sample_per_proposal():
    with pytest.raises(ValueError, match="one sample per proposal"):
        lara_module(causal=True, lara_samples_per_proposal=2)
