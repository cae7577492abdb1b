"""FAVOR+ with an exact window inside the layer ("favor_window"): the blocked parallel form against the dense
reference (values and gradients, left padding), exact softmax where the window covers everything, convergence to
softmax as features grow, decoding from a bounded state that equals the full forward, and save/load/generate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo import ZooHybridConfig
from attnzoo.modeling.attention import build_attention
from attnzoo.modeling.cache import RecurrentStateLayer
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import saved_loaded_and_generating_like_the_full_forward


def config(**overrides):
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
                  position_embedding_type="rotary", num_random_features=16, attn_layers=["favor_window"],
                  is_decoder=True, vocab_size=37, num_hidden_layers=2, intermediate_size=48, hidden_dropout_prob=0.0,
                  pad_token_id=0)
    values.update(overrides)
    return ZooHybridConfig(**values)


def layer(**overrides):
    attn = build_attention("favor_window", config(**overrides), 0, True).double().eval()
    attn.init_buffers()
    return attn


@pytest.mark.parametrize("window, sinks", [(4, 2), (3, 0), (5, 7), (1, 0), (64, 4)])
def test_parallel_form_equals_dense_reference_with_padding(window, sinks):
    torch.manual_seed(0)
    attn = layer(window_size=window, num_sink_tokens=sinks)
    x = torch.randn(2, 17, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, :5] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    real = mask[..., None]
    fast = attn(x, attention_mask=mask, position_ids=positions) * real
    ref = attn.reference_forward(x, attention_mask=mask, position_ids=positions) * real
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    grads = [torch.autograd.grad(out.square().sum(), x)[0] for out in (fast, ref)]
    torch.testing.assert_close(*grads, rtol=1e-9, atol=1e-11)


def test_window_covering_everything_is_exact_softmax_and_features_converge_beyond_it():
    torch.manual_seed(0)
    x = torch.randn(1, 24, 32, dtype=torch.float64) * 0.5
    covering = layer(window_size=32, num_sink_tokens=0)
    full = build_attention("full", config(), 0, True).double()
    full.load_state_dict(covering.state_dict(), strict=False)
    torch.testing.assert_close(covering(x), full(x), rtol=1e-10, atol=1e-12)
    errors = []
    for features in (16, 4096):
        torch.manual_seed(1)
        windowed = layer(window_size=4, num_sink_tokens=0, num_random_features=features)
        windowed.load_state_dict({k: v for k, v in full.state_dict().items()}, strict=False)
        errors.append((windowed(x) - full(x)).abs().mean().item())
    assert errors[1] < errors[0] / 3  # the far part is FAVOR+'s unbiased estimate of the same softmax weights


def test_decoding_state_is_bounded_and_equals_the_full_forward():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).double().eval()
    ids = torch.randint(1, 37, (2, 30))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    full = model(ids, attention_mask=mask).logits
    out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
    steps, sizes = [out.logits], set()
    for t in range(6, 30):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
        steps.append(out.logits)
        slot = output_cache(out).layers[0]
        assert type(slot) is RecurrentStateLayer
        sizes.add(sum(t.numel() for t in slot.state.values()))
    assert len(sizes) == 1  # the state does not grow with the context
    real = mask.bool()[..., None]
    torch.testing.assert_close(torch.cat(steps, 1) * real, full * real, rtol=1e-9, atol=1e-10)


def test_saves_loads_and_generates_like_the_full_forward(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(feature_redraw="learned")).eval()
    loaded = saved_loaded_and_generating_like_the_full_forward(model, tmp_path, 37, new_tokens=10)
    assert [n for n, _ in loaded.model.transformer.blocks[0].attn.own_parameters()] == ["learned_projection"]


def test_encoder_layers_are_refused():
    with pytest.raises(ValueError, match="favor_window"):
        build_attention("favor_window", config(), 0, False)
