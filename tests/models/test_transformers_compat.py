"""attnzoo/transformers_compat.py: what it detects on the installed transformers, and the contract it keeps with
transformers' internals (the rest is tested through generate() in every family's suite)."""

import inspect

import pytest
import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM
from attnzoo.modeling.cache import ZooCache
from attnzoo.transformers_compat import CACHE_KW, CACHE_NAMES, output_cache, take_cache, with_cache


def test_the_cache_keyword_is_the_one_outputs_and_generate_use():
    assert CACHE_KW in BaseModelOutputWithPast.__dataclass_fields__
    assert CACHE_KW in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters


def test_a_forward_takes_the_cache_under_any_of_its_names():
    cache = ZooCache([])
    for name in CACHE_NAMES[1:]:
        kwargs = {name: cache, "other": 1}
        assert take_cache(None, kwargs) is cache and kwargs == {"other": 1}  # the old name is consumed
    assert take_cache(cache, {"past_key_values": cache}) is cache  # the same cache twice is one cache
    with pytest.raises(ValueError, match="two different caches were passed.*pass one, as `cache=`"):
        take_cache(cache, {"past_key_values": ZooCache([])})


def test_outputs_hold_the_cache_under_the_installed_name_and_leave_out_a_missing_one():
    cache = ZooCache([])
    out = with_cache(CausalLMOutputWithPast, cache, logits=torch.zeros(1))
    assert out[CACHE_KW] is cache and output_cache(out) is cache
    empty = with_cache(CausalLMOutputWithPast, None, logits=torch.zeros(1))
    assert CACHE_KW not in empty and output_cache(empty) is None  # beam search raises on a key holding None


def test_the_cache_layer_interface_attnzoo_implements_is_unchanged():
    # attnzoo's self-managed slots implement exactly these; a release that adds an abstract method would make them
    # fail at construction (as it did for fla), so the set is pinned here.
    assert CacheLayerMixin.__abstractmethods__ == {"lazy_initialization", "update", "get_mask_sizes",
                                                   "get_seq_length", "get_max_length"}


def test_the_model_forward_and_generate_hooks_use_the_detected_name():
    model = ZooSoftmaxForCausalLM(ZooSoftmaxConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32,
                                                   max_position_embeddings=32, is_decoder=True)).eval()
    assert "cache" in inspect.signature(model.forward).parameters
    model_kwargs = {}
    model._prepare_cache_for_generation(model.generation_config, model_kwargs, None, 1, 20)
    assert isinstance(model_kwargs.pop(CACHE_KW), ZooCache) and not model_kwargs


def test_the_trainer_leaves_the_cache_out_of_predictions_under_every_name():
    assert set(CACHE_NAMES) <= set(ZooSoftmaxConfig().keys_to_ignore_at_inference)


def test_activation_checkpointing_is_enabled_through_the_name_this_release_has():
    from attnzoo.transformers_compat import enable_activation_checkpointing

    expected = "activation_checkpointing_enable" if hasattr(PreTrainedModel, "activation_checkpointing_enable") \
        else "gradient_checkpointing_enable"
    model = ZooSoftmaxForCausalLM(ZooSoftmaxConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32, is_decoder=True))
    called = []
    setattr(model, expected, lambda **kwargs: called.append(kwargs))
    enable_activation_checkpointing(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert called == [{"gradient_checkpointing_kwargs": {"use_reentrant": False}}]
