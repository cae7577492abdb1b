"""Performer's FAVOR+ and the elu+1 linear attention as modules: the fast path against the masked quadratic reference
(values and gradients), decoding from the recurrent state, strict causality, the redraw policies and the saved
evaluation projection."""

import math

import pytest
import torch

from attnzoo import ZooPerformerConfig, ZooPerformerForCausalLM
from attnzoo.modeling.attention import EluAttention, FavorAttention, InitialisesBuffers
from attnzoo.modeling.attention.random_features import elu_features
from attnzoo.modeling.cache import RecurrentStateLayer, ZooCache
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import assert_same_values_and_gradients


def config(**kw):
    values = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=1,
                  num_random_features=64, linear_attention_chunk_size=5)
    values.update(kw)
    return ZooPerformerConfig(**values)


def built(kind, causal):
    """A lone layer in evaluation mode, its buffers filled as `_init_weights` would."""
    attn = kind(config(), 0, causal).double().eval()
    if isinstance(attn, InitialisesBuffers):
        attn.init_buffers()
    return attn


@pytest.mark.parametrize("kind", [FavorAttention, EluAttention])
@pytest.mark.parametrize("causal", [False, True])
def test_module_fast_path_equals_reference_with_padding(kind, causal):
    torch.manual_seed(0)
    attn = built(kind, causal)
    x = torch.randn(3, 11, 32, dtype=torch.double, requires_grad=True)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, :4] = 0  # left padding
    for m in (None, mask):
        fast, slow = attn(x, attention_mask=m), attn.reference_forward(x, attention_mask=m)
        assert_same_values_and_gradients(attn, x, None if m is None else m.bool(), fast, slow)


@pytest.mark.parametrize("kind", [FavorAttention, EluAttention])
def test_decoding_from_the_recurrent_state_equals_the_parallel_form(kind):
    torch.manual_seed(0)
    attn = built(kind, True)
    x = torch.randn(2, 14, 32, dtype=torch.double) * 3  # large inputs make the running key max grow
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :3] = 0
    full = attn(x, attention_mask=mask)
    cache = ZooCache([attn.new_cache_layer()])
    pieces = [attn(x[:, :5], attention_mask=mask[:, :5], cache=cache)]  # prefill
    pieces += [attn(x[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache) for t in range(5, 9)]
    pieces.append(attn(x[:, 9:], attention_mask=mask, cache=cache))  # a multi-token continuation
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], rtol=1e-10, atol=1e-12)
    assert cache.get_seq_length() == 14


# -- strict causality in training mode --------------------------------------------------------------------
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


# -- redraw policies ---------------------------------------------------------------------------------------
def training_outputs(redraw, calls, **kw):
    torch.manual_seed(0)
    attn = FavorAttention(config(feature_redraw=redraw, **kw), 0, False).train()
    attn.init_buffers()
    x = torch.randn(1, 6, 32)
    outs, projections = [], []
    for _ in range(calls):
        attn.start_forward()  # what the Transformer does once per forward pass
        projections.append(attn.projection(None).clone())
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
    attn.start_forward()
    clone.start_forward()  # call 3: no redraw yet for either
    assert torch.equal(attn.projection(None), clone.projection(None))
    attn.start_forward()
    clone.start_forward()  # call 4: both redraw (different random draws, same schedule)
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
        layer = output_cache(out).layers[0]
        first = layer.shared["projection"]
        model(ids[:, -1:], cache=output_cache(out), use_cache=True)
    assert layer.shared["projection"] is first and isinstance(layer, RecurrentStateLayer)


def test_elu_features_are_positive_and_follow_alpha():
    x = torch.tensor([-30.0, -1.0, 0.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(elu_features(x, 1.0), torch.tensor([math.exp(-30), math.exp(-1), 1.0, 3.0],
                                                                   dtype=torch.float64))
    torch.testing.assert_close(elu_features(x, 0.1)[1], torch.tensor(1 + 0.1 * (math.exp(-1) - 1),
                                                                     dtype=torch.float64))
    with pytest.raises(ValueError, match="elu_alpha"):
        config(attn_layers=["elu"], elu_alpha=1.5)


@pytest.mark.parametrize("bad", [dict(feature_redraw="sometimes"), dict(feature_map="trig"),
                                 dict(num_random_features=0), dict(linear_attention_chunk_size=0),
                                 dict(feature_norm="unit")])
def test_bad_performer_settings_raise_naming_the_field(bad):
    with pytest.raises(ValueError, match=rf"^{next(iter(bad))}=.* is invalid: "):
        config(**bad)
