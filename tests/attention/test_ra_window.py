"""Randomized Attention with an exact window inside the layer ("ra_window"): the exactness of the far part's
normaliser (the design's identity) and the unbiasedness of its numerator, the fast form against the dense
density-ratio reference (values and gradients, left padding, both variants, training noise and seeded evaluation
draws), exact softmax where the window covers everything, convergence to softmax as samples grow, cached decoding
equal to the full forward (RA's KV cache, nothing more), and save/load/generate."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo import ZooHybridConfig
from attnzoo.modeling.attention import build_attention
from attnzoo.modeling.attention.ra_window import WindowedRAAttention, keys_to_sample
from attnzoo.modeling.attention.randomized import randomized_aggregate, sample_omega
from attnzoo.modeling.attention.window import dense_near_and_far
from attnzoo.modeling.attention.windowed import FAR_STATE, far_state
from attnzoo.modeling.cache import spare_tokens
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import (
    assert_same_values_and_gradients,
    saved_loaded_and_generating_like_the_full_forward,
    scaled_qkv,
)


def config(**overrides):
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
                  position_embedding_type="rotary", ra_num_samples=3, attn_layers=["ra_window"], is_decoder=True,
                  vocab_size=37, num_hidden_layers=2, intermediate_size=48, hidden_dropout_prob=0.0, pad_token_id=0)
    values.update(overrides)
    return ZooHybridConfig(**values)


def layer(**overrides):
    return build_attention("ra_window", config(**overrides), 0, True).double()


def left_padded_batch(length=17, pad=5, seed=0):
    """x [2, length, 32] (float64, requires grad), a mask whose second row starts with `pad` padded tokens, and the
    rotary positions counted in real tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, length, 32, dtype=torch.float64, generator=g).requires_grad_()
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :pad] = False
    return x, mask, (mask.long().cumsum(-1) - 1).clamp(min=0)


# -- the design: the far normaliser is exact, the far numerator unbiased ------------------------------------------
def far_set(n=12, window=3, sinks=2):
    """The far keys [1, 1, n, n] of n causal queries without padding (window 3, 2 sinks): every query from
    position 5 on has some."""
    _, far = dense_near_and_far(torch.ones(1, n, dtype=torch.bool), window, sinks)
    return far[:, None]


def test_density_ratio_of_the_far_mixture_is_the_far_normaliser_at_every_omega():
    q_hat, k_hat, _ = scaled_qkv()
    far = far_set()
    has_far = far.any(-1)[0, 0]
    assert has_far.sum() == 7 and not has_far[:5].any()
    scores = q_hat @ k_hat.transpose(-1, -2)
    far_mass = (scores.exp() * far).sum(-1)  # Z_n = Σ_far exp(s_nm)
    pi = scores.exp() * far / far_mass.clamp(min=1e-300).unsqueeze(-1)
    g = torch.Generator().manual_seed(1)
    omega = torch.randn(1, 1, 12, 50, 8, dtype=torch.float64, generator=g) * 2  # arbitrary points, not draws

    def log_normal(x):  # log N(x; 0, I)
        return -0.5 * (x * x).sum(-1) - 4 * math.log(2 * math.pi)

    centred = omega.unsqueeze(4) - q_hat[:, :, :, None, None] - k_hat[:, :, None, None]  # ω − q̂_n − k̂_m
    density = (pi.unsqueeze(3) * log_normal(centred).exp()).sum(-1)  # p_n(ω)
    log_xi_q = (omega * q_hat.unsqueeze(3)).sum(-1) - 0.5 * (q_hat * q_hat).sum(-1, keepdim=True)
    log_xi_k = omega @ k_hat.unsqueeze(2).transpose(-1, -2) - 0.5 * (k_hat * k_hat).sum(-1)[:, :, None, None]
    integrand = ((log_xi_q.unsqueeze(-1) + log_xi_k + log_normal(omega).unsqueeze(-1)).exp() * far.unsqueeze(3))
    ratio = integrand.sum(-1)[..., has_far, :] / density[..., has_far, :]
    torch.testing.assert_close(ratio, far_mass[..., has_far, None].expand_as(ratio), rtol=1e-12, atol=0)


def test_far_part_is_unbiased_for_the_far_keys_softmax_numerator():
    """Z_n · f_n(ω) with ω drawn from the far-key mixture (σ = 1) has mean Σ_far exp(s_nm) v_m."""
    torch.manual_seed(0)
    q_hat, k_hat, v = scaled_qkv()
    far = far_set()
    has_far = far.any(-1)[0, 0]
    scores = q_hat @ k_hat.transpose(-1, -2)
    exact = (scores.exp() * far) @ v  # [1, 1, n, d]
    far_mass = (scores.exp() * far).sum(-1, keepdim=True)
    draws = 20000
    sampled = keys_to_sample(far)
    omega = sample_omega(q_hat, k_hat, sampled, "unbiased", draws, noise_std=1.0)
    logits = omega @ k_hat.unsqueeze(2).transpose(-1, -2) - 0.5 * (k_hat * k_hat).sum(-1)[:, :, None, None]
    per_draw = logits.masked_fill(~sampled.unsqueeze(3), float("-inf")).softmax(-1) @ v.unsqueeze(2)
    estimate = far_mass.unsqueeze(3) * per_draw  # [1, 1, n, S, d]
    stderr = (estimate.std(3) / math.sqrt(draws)).clamp(min=1e-12)  # 0 for a query with one far key: f is exact
    z = ((estimate.mean(3) - exact).abs() / stderr)[..., has_far, :]
    assert z.max() < 4.5, f"largest deviation {z.max():.2f} standard errors"
    # and the module's aggregate is the same f, averaged over the draws
    torch.testing.assert_close(randomized_aggregate(omega[:, :, :, :50], k_hat, v, sampled), per_draw[:, :, :, :50]
                               .mean(3), rtol=1e-12, atol=1e-14)


# -- the fast form against the dense reference --------------------------------------------------------------------
@pytest.mark.parametrize("variant, training", [("unbiased", True), ("unbiased", False), ("biased", True)])
@pytest.mark.parametrize("window, sinks", [(4, 2), (3, 0), (5, 7), (1, 0), (64, 4)])
def test_fast_form_equals_dense_density_ratio_reference_with_padding(window, sinks, variant, training):
    attn = layer(window_size=window, num_sink_tokens=sinks, ra_variant=variant).train(training)
    x, mask, positions = left_padded_batch()
    torch.manual_seed(3)  # training draws noise (and indices) from the global RNG: the same draws for both
    fast = attn(x, attention_mask=mask, position_ids=positions)
    torch.manual_seed(3)
    ref = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    assert_same_values_and_gradients(attn, x, mask, fast, ref, rtol=1e-10, atol=1e-12)


def trained_scale_layer(variant: str, training: bool, dtype: torch.dtype):
    """Layer 0 of a model initialised with initializer_range=0.5 (scales trained models reach): its scores pass
    exp's float32 range, where the reference's plain exp(s_nm), ξ and N(ω; ·) once gave inf / inf and 0 / 0."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(initializer_range=0.5, ra_variant=variant)).to(dtype)
    return model.model.transformer.blocks[0].attn.train(training)


VARIANTS_AND_MODES = [("unbiased", True), ("unbiased", False), ("biased", True)]


@pytest.mark.parametrize("variant, training", VARIANTS_AND_MODES)
def test_reference_is_finite_wherever_the_fast_path_is_at_initializer_range_0_5(variant, training):
    """float32, the model's own dtype: the reference was NaN at 10 to 16 of the 43 real positions here."""
    attn = trained_scale_layer(variant, training, torch.float32)
    x, mask, positions = left_padded_batch(length=24)
    x = x.detach().float()
    torch.manual_seed(3)
    fast = attn(x, attention_mask=mask, position_ids=positions)
    torch.manual_seed(3)
    ref = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    assert fast.isfinite().all()
    assert ref.isfinite().all(), f"{(~ref[mask].isfinite()).any(-1).sum()} real positions are not finite"
    torch.testing.assert_close(ref[mask], fast[mask], rtol=1e-4, atol=1e-4)  # outputs reach 29 in magnitude


@pytest.mark.parametrize("input_scale", [1, 6])
@pytest.mark.parametrize("variant, training", VARIANTS_AND_MODES)
def test_fast_form_equals_reference_at_initializer_range_0_5_in_float64(variant, training, input_scale):
    """Values and gradients in float64; inputs 6 times larger put the scores past exp's float64 range (~709),
    where the plain reference was NaN too."""
    attn = trained_scale_layer(variant, training, torch.float64)
    x, mask, positions = left_padded_batch(length=24)
    x = (x.detach() * input_scale).requires_grad_()
    torch.manual_seed(3)
    fast = attn(x, attention_mask=mask, position_ids=positions)
    torch.manual_seed(3)
    ref = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    # outputs reach ~100 at scale 6: the absolute tolerance follows the scale (relative error stays ~1e-13)
    atol = 1e-12 * input_scale ** 3
    assert_same_values_and_gradients(attn, x, mask, fast, ref, rtol=1e-10, atol=atol)


def test_only_queries_with_far_keys_differ_from_the_window_alone():
    """The window alone ("window" with the same weights) differs from ra_window exactly where queries have far
    keys: the far part is really there (and nothing else moves)."""
    attn = layer(window_size=4, num_sink_tokens=2).eval()
    window_only = build_attention("window", config(), 0, True).double().eval()
    window_only.load_state_dict(attn.state_dict())
    x, mask, positions = left_padded_batch()
    with torch.no_grad():
        ours = attn(x, attention_mask=mask, position_ids=positions)
        theirs = window_only(x, attention_mask=mask, position_ids=positions)
    n_real = mask.sum(-1)
    # real positions 0 .. window + sinks - 1 = 5 have no far key: identical; all later real queries have some
    for row in range(2):
        real = ours[row][mask[row]]
        torch.testing.assert_close(real[:6], theirs[row][mask[row]][:6], rtol=1e-12, atol=1e-12)
        assert (real[6:] - theirs[row][mask[row]][6:]).abs().amax(-1).min() > 1e-4, int(n_real[row])


def test_left_padding_and_batch_leave_seeded_evaluation_outputs_unchanged():
    attn = layer().eval()
    x, mask, positions = left_padded_batch(pad=5)
    with torch.no_grad():
        batched = attn(x, attention_mask=mask, position_ids=positions)
        alone = attn(x[1:, 5:], position_ids=positions[1:, 5:])
        assert torch.equal(attn(x, attention_mask=mask, position_ids=positions), batched)  # deterministic
    torch.testing.assert_close(batched[1:, 5:], alone, rtol=0, atol=1e-12)
    attn.train()
    torch.manual_seed(0)
    first = attn(x, attention_mask=mask, position_ids=positions)
    assert not torch.allclose(first, attn(x, attention_mask=mask, position_ids=positions))  # training noise


# -- exactness and convergence to softmax -------------------------------------------------------------------------
@pytest.mark.parametrize("window, sinks", [(32, 0), (1, 24)])
def test_window_or_sinks_covering_everything_is_exact_softmax(window, sinks):
    torch.manual_seed(0)
    x = torch.randn(1, 24, 32, dtype=torch.float64)
    covering = layer(window_size=window, num_sink_tokens=sinks).train()  # training noise cannot matter: no far part
    full = build_attention("full", config(), 0, True).double().eval()
    full.load_state_dict(covering.state_dict())
    torch.testing.assert_close(covering(x), full(x), rtol=1e-12, atol=1e-12)


def test_far_part_converges_to_softmax_as_samples_grow_with_the_papers_noise_only():
    """With the paper's noise (σ = 1, training mode) the far part is unbiased, so its error falls as 1/√samples; the
    error is only the far values' (the near/far weights are exact). At evaluation RA drops the noise: the biased
    variant's draws are all the same point (more samples change nothing) and the unbiased one's converge to the
    mean of f at the mixture's centres, not to softmax, so its error levels off above the noisy estimate's."""
    x = torch.randn(1, 24, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.5
    full = build_attention("full", config(), 0, True).double().eval()
    errors = {}
    for variant, training in [("unbiased", True), ("unbiased", False), ("biased", False)]:
        for samples in (1, 1024):
            windowed = layer(window_size=4, num_sink_tokens=0, ra_num_samples=samples, ra_variant=variant)
            windowed.load_state_dict(full.state_dict())
            torch.manual_seed(1)
            with torch.no_grad():
                errors[variant, training, samples] = (windowed.train(training)(x) - full(x)).abs().mean().item()
    assert errors["unbiased", True, 1024] < errors["unbiased", True, 1] / 8, errors  # √1024 = 32 in expectation
    assert errors["unbiased", False, 1024] < errors["unbiased", False, 1], errors
    assert errors["unbiased", False, 1024] > 2 * errors["unbiased", True, 1024], errors
    assert errors["biased", False, 1024] == pytest.approx(errors["biased", False, 1], rel=1e-9), errors


# -- decoding, saving, generating ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["unbiased", "biased"])
def test_cached_decoding_equals_the_full_forward_with_the_ring_and_a_kv_cache(variant):
    """The decoding state is the window's ring (the sinks and the last W tokens) plus RA's KV cache: every real
    token's (rotated, unrepeated) key and value at its position, as a KV cache keeps them, and nothing else."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(ra_variant=variant)).double().eval()
    ids = torch.randint(1, 37, (2, 30))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    full = model(ids, attention_mask=mask).logits
    out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
    steps = [out.logits]
    ring = {"ring_k", "ring_v", "ring_pos", "count"}
    for t in range(6, 30):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
        steps.append(out.logits)
        slot = output_cache(out).layers[0]
        state = far_state(slot)
        assert set(state) == {"ra_k", "ra_v"} and set(slot.state) == ring | {FAR_STATE + name for name in state}
        assert slot.state["count"].tolist() == mask[:, :t + 1].sum(-1).tolist()
        for name in ("ra_k", "ra_v"):  # real tokens only, with a few spare tokens when a store grows
            assert state[name].shape[:2] == (2, 2) and t + 1 <= state[name].shape[2] <= t + 1 + spare_tokens(t + 1)
    real = mask.bool()[..., None]
    torch.testing.assert_close(torch.cat(steps, 1) * real, full * real, rtol=1e-9, atol=1e-10)


def test_saves_loads_and_generates_like_the_full_forward(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).eval()
    loaded = saved_loaded_and_generating_like_the_full_forward(model, tmp_path, 37, new_tokens=10)
    assert all(isinstance(block.attn, WindowedRAAttention) for block in loaded.model.transformer.blocks)
    assert loaded.model.transformer.blocks[0].attn.own_parameters() == []  # RA learns nothing of its own


def test_encoder_layers_are_refused():
    with pytest.raises(ValueError, match="ra_window"):
        build_attention("ra_window", config(), 0, False)
