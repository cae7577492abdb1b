"""Caches a caller passes in: softmax attention decodes from transformers' `StaticCache` (preallocated keys masked by
what was written, so a decode step has static shapes and compiles whole) exactly as from its own cache, through
forward and generate(); every other attention refuses a cache slot it would read wrongly, naming the fix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from attnzoo import ZooSoftmaxConfig
from attnzoo.registration import FAMILY_CONFIGS
from attnzoo.transformers_compat import CACHE_KW  # generate()'s name for a caller's cache: "cache" from 5.24 on

SMALL = dict(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             is_decoder=True, hidden_dropout_prob=0.0, pad_token_id=0, initializer_range=0.3)


def softmax_model(**overrides):
    torch.manual_seed(0)
    config = ZooSoftmaxConfig(**{**SMALL, "position_embedding_type": "rotary", "num_key_value_heads": 2,
                                 **overrides})
    return AutoModelForCausalLM.from_config(config).double().eval()


def left_padded_batch():
    torch.manual_seed(1)
    ids = torch.randint(1, 37, (2, 12))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


@pytest.mark.parametrize("position_embedding_type", ["rotary", "learned"])
def test_softmax_decodes_from_a_static_cache_like_the_full_forward(position_embedding_type):
    model = softmax_model(position_embedding_type=position_embedding_type)
    ids, mask = left_padded_batch()
    full = model(ids, attention_mask=mask).logits
    cache = StaticCache(config=model.config, max_cache_len=20)  # 8 slots are never written
    out = model(ids[:, :5], attention_mask=mask[:, :5], cache=cache, use_cache=True)
    steps = [out.logits]
    for t in range(5, 12):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    assert cache.layers[0].keys.shape[2] == 20 and int(cache.layers[0].cumulative_length) == 12
    real = mask.bool()[..., None]
    torch.testing.assert_close(torch.cat(steps, 1) * real, full * real, rtol=1e-10, atol=1e-12)
    # the reference path reads the static slot the same way
    attn = model.model.transformer.blocks[0].attn
    hidden = torch.randn(2, 1, 32, dtype=torch.float64)
    for path in (attn.forward, attn.reference_forward):
        cache = StaticCache(config=model.config, max_cache_len=20)
        cache.layers[0].lazy_initialization(torch.zeros(2, 2, 1, 8, dtype=torch.float64),
                                            torch.zeros(2, 2, 1, 8, dtype=torch.float64))
        kwargs = {"position_ids": torch.zeros(2, 1, dtype=torch.long)} if attn.rotary is not None else {}
        assert torch.isfinite(path(hidden, cache=cache, **kwargs)).all()


def test_generate_with_a_static_cache_equals_generate_with_the_models_own_cache():
    model = softmax_model()
    ids, mask = left_padded_batch()
    runs = [model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, **extra)
            for extra in ({}, {CACHE_KW: StaticCache(config=model.config, max_cache_len=18)})]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(torch.stack(runs[0].logits), torch.stack(runs[1].logits), rtol=1e-10, atol=1e-12)
    steps = torch.stack(runs[0].logits)  # [new tokens, batch, vocab]: each step's logits depend on the context
    assert (steps[1:] - steps[:-1]).abs().amax() > 1e-3 and (steps[:, 0] - steps[:, 1]).abs().amax() > 1e-3


@pytest.mark.parametrize("family", [f for f in FAMILY_CONFIGS if f != "softmax"])
def test_other_attentions_refuse_a_transformers_cache_they_would_read_wrongly(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILY_CONFIGS[family](**SMALL)).eval()
    ids = torch.randint(1, 37, (1, 8))
    caches = [StaticCache(config=model.config, max_cache_len=16), DynamicCache(config=model.config)]
    for cache in caches:
        kinds = {type(block.attn.new_cache_layer()) for block in model.model.transformer.blocks}
        if type(cache.layers[0]) in kinds:  # RA keeps a plain DynamicLayer KV cache: that one it reads correctly
            continue
        with pytest.raises(ValueError, match=rf"holds a {type(cache.layers[0]).__name__} for layer 0.*"
                                             r"model\.new_decoding_cache\(\)"):
            model(ids, cache=cache, use_cache=True)
    own = model.new_decoding_cache()  # the fix the message names works
    model(ids, cache=own, use_cache=True)


@pytest.mark.slow
def test_a_compiled_static_decode_step_equals_eager():
    """With a StaticCache every decode step has the same shapes: the step compiles as one graph (no graph break,
    no recompilation as the cache fills) and gives the eager logits."""
    model = softmax_model().float()
    ids, _ = left_padded_batch()
    ids = ids.clamp(min=1)

    def step(token, cache, position):
        return model(token, cache=cache, use_cache=True, position_ids=position).logits[:, -1]

    def decode(step_fn):
        cache = StaticCache(config=model.config, max_cache_len=16)
        logits = [model(ids[:, :6], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(6, 12):
            logits.append(step_fn(ids[:, t:t + 1], cache, torch.full((2, 1), t)))
        return torch.stack(logits, 1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    with torch.no_grad():
        eager, got = decode(step), decode(compiled)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-5)
