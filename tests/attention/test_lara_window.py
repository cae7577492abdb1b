"""Causal LARA with an exact window inside the layer ("lara_window"): the blocked parallel form against the dense
reference (values and gradients, left padding, several windows and sink counts), exact softmax where the window
covers everything, the far kernel as an unbiased estimate of exp(s) on the window's scale, no dependence on later
tokens, decoding across chunk completions that equals the full forward (and stores no more than causal LARA's own
decoding), and save/load/generate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo import ZooHybridConfig
from attnzoo.modeling.attention import build_attention
from attnzoo.modeling.attention.windowed import FAR_STATE, far_state
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import saved_loaded_and_generating_like_the_full_forward
from tests.attention.test_far_positions import assert_decoding_equals_the_full_forward


def config(**overrides):
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
                  position_embedding_type="rotary", attn_layers=["lara_window"], lara_chunk_size=3,
                  sample_noise_std="paper", is_decoder=True, vocab_size=37, num_hidden_layers=2, intermediate_size=48,
                  hidden_dropout_prob=0.0, pad_token_id=0)
    values.update(overrides)
    return ZooHybridConfig(**values)


def layer(training=False, **overrides):
    torch.manual_seed(0)
    return build_attention("lara_window", config(**overrides), 0, True).double().train(training)


def padded_inputs(length=17, pad=5):
    """x [2, length, 32] float64 with gradients, row 1 left-padded by `pad`, and the positions of real tokens."""
    x = torch.randn(2, length, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :pad] = False
    return x, mask, (mask.long().cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("window, sinks", [(4, 2), (3, 0), (5, 7), (1, 0), (2, 1), (64, 4)])
@pytest.mark.parametrize("training", [False, True])  # training: proposals drawn with noise (replayed by the seed)
def test_parallel_form_equals_dense_reference_with_padding(window, sinks, training):
    attn = layer(training, window_size=window, num_sink_tokens=sinks)
    x, mask, positions = padded_inputs()
    real = mask[..., None]
    torch.manual_seed(1)
    fast = attn(x, attention_mask=mask, position_ids=positions) * real
    torch.manual_seed(1)
    ref = attn.reference_forward(x, attention_mask=mask, position_ids=positions) * real
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(fast)
    params = [x, *(p for p in attn.parameters() if p.requires_grad)]
    grads = [torch.autograd.grad((out * weights).sum(), params) for out in (fast, ref)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    if not training:  # the padded row's real tokens give what the row gives alone (its draws would differ)
        alone = attn(x[1:, 5:], position_ids=positions[1:, 5:])
        torch.testing.assert_close(fast[1, 5:], alone[0], rtol=1e-10, atol=1e-12)


def test_balance_weighting_and_no_landmark_transform_match_the_reference():
    attn = layer(lara_weighting="balance", lara_landmark_transform=False, lara_chunk_size=2)
    x, mask, positions = padded_inputs(length=13, pad=3)
    fast = attn(x, attention_mask=mask, position_ids=positions)[mask]
    ref = attn.reference_forward(x, attention_mask=mask, position_ids=positions)[mask]
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    grads = [torch.autograd.grad(out.square().sum(), x)[0] for out in (fast, ref)]
    torch.testing.assert_close(*grads, rtol=1e-9, atol=1e-11)


def test_window_covering_everything_is_exact_softmax():
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    covering = layer(window_size=32, num_sink_tokens=0)
    full = build_attention("full", config(), 0, True).double()
    missing, unexpected = full.load_state_dict(covering.state_dict(), strict=False)
    assert not missing and unexpected  # the projections are shared; LARA's landmark transforms are unused here
    torch.testing.assert_close(covering(x), full(x), rtol=1e-10, atol=1e-12)


def test_far_kernel_is_an_unbiased_estimate_of_the_softmax_weights():
    """Σ_p a_ip ξ(k̂_j, ω_p) weighs the far keys on exp(s_ij)'s own scale (else the one normalisation would tilt
    the window against the far part): averaged over draws ω_p ~ N(μ_p, I) (training mode, one independent draw per
    batch row), it is exp(q̂_i·k̂_j) for every far pair, with one to five proposals available (chunks of 2)."""
    attn = layer(True, window_size=1, num_sink_tokens=0, lara_chunk_size=2, lara_weighting="balance")
    draws = 4000
    x = torch.randn(1, 10, 32, dtype=torch.float64) * 0.5
    torch.manual_seed(2)
    with torch.no_grad():
        q, k, v, _, _, _ = attn._views(x.expand(draws, -1, -1), None, 0)
        k, v = attn.expand_kv(k), attn.expand_kv(v)
        log_a, log_k = attn.far.reference_terms(q, k, v, torch.ones(draws, 10, dtype=torch.bool))
        kernel = torch.exp(log_a[:, :, :, None, :] + log_k[:, :, None, :, :]).sum(-1)  # [draws, H, L, L]
        exact = torch.exp((q[0] @ k[0].transpose(-1, -2)) * attn.near.scale)  # [H, L, L]
    far = torch.ones(10, 10, dtype=torch.bool).tril(-1)  # window 1, no sinks: every earlier key is far
    ratio = kernel.mean(0)[:, far] / exact[:, far]
    standard_error = kernel.std(0)[:, far] / exact[:, far] / draws ** 0.5
    assert ((ratio - 1).abs() < 4 * standard_error).all(), (ratio - 1).abs().max()
    assert standard_error.max() < 0.03  # tight enough to catch a constant factor (1/P, a missing 1/q̃, ...)


def test_earlier_outputs_do_not_depend_on_later_tokens_even_large_ones():
    """Keys enter with per-feature running maxima, so a large later key cannot rescale (and flush to 0) what an
    earlier query sums: earlier outputs stay the same to rounding when later activations are 100x larger. Their
    keys' log-features under the later proposals reach ~5000; one maximum over the whole sequence would turn every
    earlier output into 0 / 0 (NaN)."""
    attn = layer(True, lara_landmark_transform=False)  # later proposals then grow with the later activations
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    changed = x.clone()
    changed[:, 13:] = torch.randn(2, 11, 32, dtype=torch.float64) * 100
    torch.manual_seed(3)
    a = attn(x)
    torch.manual_seed(3)
    b = attn(changed)
    torch.testing.assert_close(a[:, :13], b[:, :13], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, 13:], b[:, 13:])


def test_decoding_across_chunk_completions_equals_the_full_forward_and_stores_no_more_than_causal_lara():
    """The decoding state holds every real key and value with their key/value heads (a
    proposal appearing when a chunk completes needs sums over all earlier far keys, as in causal LARA), the
    proposals with per-proposal sums over the keys that have left the window, and the unfinished chunk's landmark
    sums, beside the window's ring (the sinks and the last W tokens): the state is never larger than causal LARA's
    ("lara") decoding the same tokens plus that ring."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).double().eval()
    baseline = AutoModelForCausalLM.from_config(config(attn_layers=["lara"])).double().eval()
    ids = torch.randint(1, 37, (2, 30))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    full = model(ids, attention_mask=mask).logits
    out = model(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
    reference = baseline(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
    steps = [out.logits]
    for t in range(7, 30):  # chunks of 3: rows complete chunks at different steps (row 1 is 3 tokens behind)
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
        reference = baseline(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(reference),
                             use_cache=True)
        steps.append(out.logits)
        slot, lara_slot = output_cache(out).layers[0], output_cache(reference).layers[0]
        state = far_state(slot)
        ring = {"ring_k", "ring_v", "ring_pos", "count"}
        assert set(state) == {"k_hat", "v", "omega", "mu", "q_bar", "kv_sum", "key_sum", "key_level", "q_sum",
                              "k_sum"}
        assert set(slot.state) == ring | {FAR_STATE + name for name in state}
        assert slot.state["count"].tolist() == [t + 1, t - 2]  # real tokens per row: chunks are counted in them
        # proposal slots: the prior, the 3 chunks the prefill touched (the third unfinished, not yet available),
        # then one per chunk completed while decoding
        assert state["omega"].shape[2] == 1 + max(3, (t + 1) // 3)
        ring_size = sum(slot.state[name].numel() for name in ring)
        assert sum(x.numel() for x in slot.state.values()) <= sum(x.numel() for x in lara_slot.state.values()) + \
            ring_size
    real = mask.bool()[..., None]
    torch.testing.assert_close(torch.cat(steps, 1) * real, full * real, rtol=1e-9, atol=1e-10)


def test_decoding_equals_the_full_forward_after_layers_of_other_head_counts():
    """The step's `torch.cond` is traced by dynamo, one trace per process shared by every layer: after layers of
    other head counts it traces the head count as a symbol, and torch 2.11's `cond` refused the chunk proposal's
    layout for it. From a clean compiler, each model decodes like its full forward in turn."""
    torch.compiler.reset()
    for heads, kv_heads, far_kv_heads in [(4, 2, None), (4, 2, [[1]]), (2, 1, None), (8, 4, [[0, 2]]), (4, 2, None)]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(
            num_attention_heads=heads, num_key_value_heads=kv_heads, far_kv_heads=far_kv_heads)).double().eval()
        # chunks of 3 complete in both rows while decoding, at different steps
        assert_decoding_equals_the_full_forward(model, length=14, prefill=4, padding=2)


def test_saves_loads_and_generates_like_the_full_forward(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).eval()
    loaded = saved_loaded_and_generating_like_the_full_forward(model, tmp_path, 37, new_tokens=10)
    assert [n for n, _ in loaded.model.transformer.blocks[0].attn.own_parameters()] == [
        "landmark_q.0.weight", "landmark_q.0.bias", "landmark_q.1.weight", "landmark_q.1.bias",
        "landmark_k.0.weight", "landmark_k.0.bias", "landmark_k.1.weight", "landmark_k.1.bias"]


def test_encoder_layers_are_refused():
    with pytest.raises(ValueError, match="lara_window"):
        build_attention("lara_window", config(), 0, False)
