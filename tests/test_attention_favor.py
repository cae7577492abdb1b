"""Performer / elu+1 properties (spec shared/spec/random_feature_attention.md §7, items 1-7)."""

import math

import pytest
import torch

from attnzoo import ZooPerformerConfig, ZooPerformerForCausalLM
from attnzoo.modeling.attention import EluAttention, FavorAttention, softmax_attention_reference
from attnzoo.modeling.attention.random_features import (
    elu_features,
    gaussian_projection,
    linear_attention_bidirectional,
    linear_attention_causal,
    linear_attention_reference,
    linear_attention_step,
    log_positive_features,
    positive_random_features,
    stabilised_key_features,
    stabilised_query_features,
)
from attnzoo.modeling.cache import RecurrentStateLayer, ZooCache


def config(**kw):
    values = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=1,
                  num_random_features=64, linear_attention_chunk_size=5)
    values.update(kw)
    return ZooPerformerConfig(**values)


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


# -- 1. unbiasedness of the kernel estimate ------------------------------------------------------------------
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


# -- 2. ORF structure ---------------------------------------------------------------------------------------
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


# -- 3./4. the exact forms agree ----------------------------------------------------------------------------
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


@pytest.mark.parametrize("chunk", [1, 3, 4, 13, 20])
def test_causal_chunked_equals_masked_quadratic_and_recurrent(chunk):
    phi_q, phi_k, v = random_features()
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    expected = linear_attention_reference(phi_q, phi_k, v, causal)
    torch.testing.assert_close(linear_attention_causal(phi_q, phi_k, v, chunk), expected, rtol=1e-10, atol=1e-12)
    state = (torch.zeros(2, 3, 6, 4, dtype=torch.float64), torch.zeros(2, 3, 6, dtype=torch.float64))
    steps = []
    for t in range(13):
        out, state = linear_attention_step(phi_q[:, :, t:t + 1], phi_k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 2), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", [FavorAttention, EluAttention])
@pytest.mark.parametrize("causal", [False, True])
def test_module_fast_path_equals_reference_with_padding(kind, causal):
    torch.manual_seed(0)
    attn = kind(config(), 0, causal).double().eval()
    attn.init_buffers()
    attn.prepare()
    x = torch.randn(3, 11, 32, dtype=torch.double)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, :4] = 0  # left padding
    for m in (None, mask):
        fast, slow = attn(x, attention_mask=m), attn.reference_forward(x, attention_mask=m)
        real = torch.ones(3, 11, dtype=torch.bool) if m is None else m.bool()
        torch.testing.assert_close(fast[real], slow[real], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", [FavorAttention, EluAttention])
def test_decoding_from_the_recurrent_state_equals_the_parallel_form(kind):
    torch.manual_seed(0)
    attn = kind(config(), 0, True).double().eval()
    attn.init_buffers()
    attn.prepare()
    x = torch.randn(2, 14, 32, dtype=torch.double) * 3  # large inputs make the running key max grow
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :3] = 0
    full = attn(x, attention_mask=mask)
    cache = ZooCache([attn.new_cache_layer()])
    pieces = [attn(x[:, :5], attention_mask=mask[:, :5], past_key_values=cache)]  # prefill
    pieces += [attn(x[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache) for t in range(5, 9)]
    pieces.append(attn(x[:, 9:], attention_mask=mask, past_key_values=cache))  # a multi-token continuation
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], rtol=1e-10, atol=1e-12)
    assert cache.get_seq_length() == 14


# -- 5. strict causality in training mode --------------------------------------------------------------------
@pytest.mark.parametrize("attn_layers", [["favor"], ["elu"]])
def test_no_future_leak_in_training_mode(attn_layers):
    torch.manual_seed(0)
    model = ZooPerformerForCausalLM(config(attn_layers=attn_layers, num_hidden_layers=2, vocab_size=50,
                                           hidden_dropout_prob=0.0)).double().train()
    ids = torch.randint(0, 50, (2, 20))
    changed = ids.clone()
    changed[:, 12:] = torch.randint(0, 50, (2, 8))
    torch.manual_seed(1)
    a = model(ids).logits
    torch.manual_seed(1)  # the same random features in both forwards
    b = model(changed).logits
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


# -- 6. stabiliser invariance -------------------------------------------------------------------------------
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


# -- 7. redraw policy ---------------------------------------------------------------------------------------
def training_outputs(redraw, calls, **kw):
    torch.manual_seed(0)
    attn = FavorAttention(config(feature_redraw=redraw, **kw), 0, False).train()
    attn.init_buffers()
    x = torch.randn(1, 6, 32)
    outs, projections = [], []
    for _ in range(calls):
        attn.prepare()
        projections.append(attn._current_projection.clone())
        outs.append(attn(x))
    return outs, projections, attn


def test_every_step_redraws_and_fixed_does_not():
    outs, _, _ = training_outputs("every_step", 2)
    assert not torch.allclose(outs[0], outs[1])
    outs, projections, attn = training_outputs("fixed", 2)
    assert torch.equal(outs[0], outs[1]) and torch.equal(projections[0], attn.eval_projection)


def test_interval_redraw_changes_exactly_every_k_calls():
    _, projections, attn = training_outputs("interval", 7, feature_redraw_interval=3)
    changed = [not torch.equal(projections[i], projections[i - 1]) for i in range(1, 7)]
    assert changed == [False, False, True, False, False, True]
    assert int(attn.redraw_counter) == 7


def test_interval_schedule_survives_a_state_dict_round_trip():
    _, _, attn = training_outputs("interval", 2, feature_redraw_interval=3)
    clone = FavorAttention(config(feature_redraw="interval", feature_redraw_interval=3), 0, False).train()
    clone.load_state_dict(attn.state_dict())
    attn.prepare()
    clone.prepare()  # call 3: no redraw yet for either
    assert torch.equal(attn._current_projection, clone._current_projection)
    attn.prepare()
    clone.prepare()  # call 4: both redraw (different random draws, same schedule)
    assert int(attn.redraw_counter) == int(clone.redraw_counter) == 4


def test_evaluation_is_deterministic_and_the_projection_is_saved(tmp_path):
    torch.manual_seed(0)
    model = ZooPerformerForCausalLM(config(vocab_size=50)).eval()
    ids = torch.randint(0, 50, (1, 9))
    assert torch.equal(model(ids).logits, model(ids).logits)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    key = "model.transformer.blocks.0.attn.eval_projection"
    assert torch.equal(saved[key], model.state_dict()[key])
    torch.manual_seed(123)  # a different RNG state must not matter after loading
    loaded = ZooPerformerForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_generation_uses_one_projection_even_in_training_mode():
    torch.manual_seed(0)
    model = ZooPerformerForCausalLM(config(vocab_size=50, hidden_dropout_prob=0.0)).train()
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        layer = out.past_key_values.layers[0]
        first = layer.shared["projection"]
        model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    assert layer.shared["projection"] is first and isinstance(layer, RecurrentStateLayer)


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


def test_elu_features_are_positive_and_follow_alpha():
    x = torch.tensor([-30.0, -1.0, 0.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(elu_features(x, 1.0), torch.tensor([math.exp(-30), math.exp(-1), 1.0, 3.0],
                                                                   dtype=torch.float64))
    torch.testing.assert_close(elu_features(x, 0.1)[1], torch.tensor(1 + 0.1 * (math.exp(-1) - 1),
                                                                     dtype=torch.float64))
    with pytest.raises(ValueError, match="elu_alpha"):
        config(attn_layers=["elu"], elu_alpha=1.5)


def test_bad_performer_settings_raise():
    for bad in (dict(feature_redraw="sometimes"), dict(feature_map="trig"), dict(num_random_features=0),
                dict(linear_attention_chunk_size=0), dict(feature_norm="unit")):
        with pytest.raises(ValueError):
            config(**bad)
