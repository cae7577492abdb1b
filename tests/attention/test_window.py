"""Sliding-window attention with sinks: the blocked fast path against the dense reference (values and gradients,
padding, both directions), against exact softmax when the window covers everything, and decoding from a state that
stays S + W tokens long however long the context grows."""

from __future__ import annotations

import pytest
import torch

from attnzoo import ZooWindowConfig, ZooWindowForCausalLM
from attnzoo.modeling.attention import build_attention
from attnzoo.modeling.attention.window import WindowStateLayer
from attnzoo.transformers_compat import output_cache


def window_config(**overrides):
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
                  position_embedding_type="rotary", vocab_size=37, num_hidden_layers=2, intermediate_size=48,
                  hidden_dropout_prob=0.0, is_decoder=True, pad_token_id=0)
    values.update(overrides)
    return ZooWindowConfig(**values)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window, sinks", [(4, 2), (3, 0), (5, 7), (1, 1), (64, 4)])
def test_fast_path_equals_dense_reference_with_padding(window, sinks, causal):
    torch.manual_seed(0)
    attn = build_attention("window", window_config(window_size=window, num_sink_tokens=sinks), 0, causal).double()
    x = torch.randn(3, 17, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 17, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    mask[2, 13:] = False  # right padding
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    fast = attn(x, attention_mask=mask, position_ids=positions)
    ref = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    real = mask[..., None]
    torch.testing.assert_close(fast * real, ref * real, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(fast).all()
    grad_fast, = torch.autograd.grad((fast * real).square().sum(), x)
    grad_ref, = torch.autograd.grad((ref * real).square().sum(), x)
    torch.testing.assert_close(grad_fast, grad_ref, rtol=1e-9, atol=1e-11)


def test_a_window_covering_the_sequence_is_exact_softmax():
    torch.manual_seed(0)
    config = window_config(window_size=32, num_sink_tokens=0)
    window = build_attention("window", config, 0, True).double()
    full = build_attention("full", config, 0, True).double()
    full.load_state_dict(window.state_dict())
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    torch.testing.assert_close(window(x), full(x), rtol=1e-10, atol=1e-12)


def test_a_query_sees_its_window_and_the_sinks_and_nothing_else():
    """Perturbing a token outside both changes nothing; perturbing a sink or a window token changes the output."""
    torch.manual_seed(0)
    attn = build_attention("window", window_config(window_size=3, num_sink_tokens=2), 0, True).double()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    base = attn(x)[0, 11]
    for token, visible in [(0, True), (1, True), (2, False), (8, False), (9, True), (11, True)]:
        changed = x.clone()
        changed[0, token] += 1.0
        assert torch.allclose(attn(changed)[0, 11], base) != visible, token


def test_decoding_state_stays_sinks_plus_window_and_equals_the_full_forward():
    torch.manual_seed(0)
    model = ZooWindowForCausalLM(window_config()).double().eval()
    ids = torch.randint(1, 37, (2, 40))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # a left-padded row
    full = model(ids, attention_mask=mask).logits
    out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
    steps = [out.logits]
    for t in range(6, 40):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
        steps.append(out.logits)
        for layer in output_cache(out).layers:
            assert isinstance(layer, WindowStateLayer)
            held = {name: tuple(t.shape) for name, t in layer.state.items()}
            assert held["ring_k"] == held["ring_v"] == (2, 2, 2 + 4, 8)  # S + W, never more
            # the sinks in the first S slots, the token at position p in slot S + p mod W (rows count real tokens)
            count = mask[:, :t + 1].sum(-1)
            for row in range(2):
                expected = [0, 1] + [-1] * 4
                for p in range(max(int(count[row]) - 4, 0), int(count[row])):
                    expected[2 + p % 4] = p
                assert layer.state["ring_pos"][row].tolist() == expected
    real = mask.bool()[..., None]
    torch.testing.assert_close(torch.cat(steps, 1) * real, full * real, rtol=1e-9, atol=1e-10)


def test_generation_with_a_prompt_shorter_than_the_sinks_fills_them_while_decoding():
    torch.manual_seed(0)
    model = ZooWindowForCausalLM(window_config(window_size=3, num_sink_tokens=4)).eval()
    prompt = torch.randint(1, 37, (1, 2))
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    full = model(out.sequences[:, :-1]).logits[:, 1:]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("values, field", [(dict(window_size=0), "window_size"),
                                           (dict(num_sink_tokens=-1), "num_sink_tokens"),
                                           (dict(window_size=2.5), "window_size")])
def test_bad_window_settings_raise_value_error_naming_the_field(values, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        window_config(**values)
