"""A decode step given its cache under a name the model does not take must fail, never decode from the new token
alone. `past_key_value` (singular) is a common misspelling of `past_key_values`: neither the floor nor the newest
supported transformers takes it (their Llama swallows it in `**kwargs` and decodes without the cache), so every
attnzoo forward that takes a cache refuses it with a TypeError naming the names it does take."""

from __future__ import annotations

import importlib

import pytest
import torch

from attnzoo.registration import FAMILY_CONFIGS
from attnzoo.transformers_compat import CACHE_NAMES, output_cache
from tests.attention.helpers import named

#: the message says which keywords do take the cache (both work with every supported transformers)
REFUSAL = r"past_key_value.*past_key_values.*cache="


def suite(family: str):
    """The family's `FamilySuite` (its small config and attention settings), from its own test module."""
    module = importlib.import_module(f"tests.models.test_family_{family}")
    config_class = FAMILY_CONFIGS[family]
    return next(value for name, value in vars(module).items()
                if name.startswith("Test") and getattr(value, "config_class", None) is config_class)()


def prefill(model, ids, **inputs):
    with torch.no_grad():
        return output_cache(model(ids[:, :-1], use_cache=True, **inputs))


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(request):
    return suite(request.param)


@pytest.mark.parametrize("head", ["Model", "ForCausalLM"])
def test_a_decode_step_given_past_key_value_is_refused_not_decoded_without_the_cache(family, head):
    model = family.build(head, is_decoder=True).eval()  # a base model keeps a cache only as a decoder
    ids = family.inputs_for("ForCausalLM", length=10)["input_ids"]
    cache = prefill(model, ids)
    with torch.no_grad(), pytest.raises(TypeError, match=REFUSAL):
        model(ids[:, -1:], past_key_value=cache)
    with torch.no_grad(), pytest.raises(TypeError, match=REFUSAL):  # a None value is the same misspelling
        model(ids[:, -1:], past_key_value=None)


def test_every_name_the_cache_is_taken_under_decodes_like_the_full_forward(family):
    model = family.build("ForCausalLM").eval()
    ids = family.inputs_for("ForCausalLM", length=10)["input_ids"]
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, -1]
        for name in CACHE_NAMES:
            step = model(ids[:, -1:], **{name: prefill(model, ids)}).logits[:, -1]
            torch.testing.assert_close(step, full, atol=family.atol, rtol=1e-4, msg=named(name))


def test_the_decoder_of_an_encoder_decoder_refuses_past_key_value(family):
    model = family.build("ForConditionalGeneration").eval()
    inputs = family.inputs_for("ForConditionalGeneration")
    ids, decoder_ids = inputs["input_ids"], inputs["decoder_input_ids"]
    with torch.no_grad():
        full = model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False).logits[:, -1]
        out = model(input_ids=ids, decoder_input_ids=decoder_ids[:, :-1], use_cache=True)
        encoded = (out.encoder_last_hidden_state,)
        with pytest.raises(TypeError, match=REFUSAL):
            model(encoder_outputs=encoded, decoder_input_ids=decoder_ids[:, -1:], past_key_value=output_cache(out))
        step = model(encoder_outputs=encoded, decoder_input_ids=decoder_ids[:, -1:], cache=output_cache(out))
    torch.testing.assert_close(step.logits[:, -1], full, atol=family.atol, rtol=1e-4)
