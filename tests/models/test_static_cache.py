"""Static caches, for compiled and graph-captured decoding. Every family decodes from fixed-shape slots
(`model.new_decoding_cache(max_cache_len=...)`, or `generate(cache_implementation="static")`) exactly as from its
growing cache: softmax and RA from preallocated keys masked by what was written (also transformers' own
`StaticCache`), local and LSH from token buffers written in place, Performer and LARA from a recurrent state updated
in place. A decode step then traces as one graph that is never recompiled as the cache fills, and its compiled
logits equal eager ones. An attention refuses a cache slot it would read wrongly, naming the fix."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    CompileConfig,
    DynamicCache,
    GenerationConfig,
    StaticCache,
)
from transformers.cache_utils import DynamicLayer

from attnzoo import ZooSoftmaxConfig
from attnzoo.modeling.cache import StaticRecurrentStateLayer, StaticTokenBufferLayer
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
        accepted = {kind for block in model.model.transformer.blocks for kind in block.attn.cache_layer_types()}
        if type(cache.layers[0]) in accepted:  # RA keeps plain key/value slots: those it reads correctly
            continue
        with pytest.raises(ValueError, match=rf"holds a {type(cache.layers[0]).__name__} for layer 0.*"
                                             r"model\.new_decoding_cache\(\)"):
            model(ids, cache=cache, use_cache=True)
    if not any(issubclass(kind, DynamicLayer) for kind in accepted):  # an empty DynamicCache() has no slot at all
        with pytest.raises(ValueError, match=r"has no slot for layer 0.*model\.new_decoding_cache\(\)"):
            model(ids, cache=DynamicCache(), use_cache=True)
    own = model.new_decoding_cache()  # the fix the message names works
    model(ids, cache=own, use_cache=True)


# -- attnzoo's static slots, every family -----------------------------------------------------------------------
#: (family, config overrides): every attention with a static slot, with chunks small enough that local windows
#: slide, LSH buckets fill and LARA completes chunks (adds proposals) while decoding, in rotary/grouped-query and
#: learned-position models
STATIC = {
    "softmax": ("softmax", {}),
    "softmax_rotary_gqa": ("softmax", {"position_embedding_type": "rotary", "num_key_value_heads": 2}),
    "ra": ("ra", {"position_embedding_type": "rotary", "num_key_value_heads": 2}),
    "ra_biased": ("ra", {"ra_variant": "biased"}),
    "favor": ("performer", {"position_embedding_type": "rotary", "num_key_value_heads": 2}),
    "elu": ("performer", {"attn_layers": ["elu"]}),
    "lara": ("lara", {"lara_chunk_size": 4}),
    "lara_rotary": ("lara", {"lara_chunk_size": 3, "lara_weighting": "query_specific",
                             "position_embedding_type": "rotary", "num_key_value_heads": 2}),
    "reformer": ("reformer", {"lsh_chunk_length": 4, "local_chunk_length": 4, "lsh_full_attention_threshold": 8}),
    "reformer_rotary": ("reformer", {"lsh_chunk_length": 4, "local_chunk_length": 4, "reversible": False,
                                     "position_embedding_type": "rotary", "attn_layers": ["lsh", "local"]}),
    "hybrid": ("hybrid", {"attn_layers": ["full", "favor"]}),
}


def static_model(name, dtype=torch.float64, **overrides):
    family, settings = STATIC[name]
    torch.manual_seed(0)
    config = FAMILY_CONFIGS[family](**{**SMALL, **settings, **overrides})
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


@pytest.mark.parametrize("name", list(STATIC))
def test_generate_with_a_static_cache_equals_the_growing_cache(name):
    """Greedy and beam search, a left-padded batch: the same tokens and scores, and the model's cache slots really
    are the static ones (fixed capacity from generate()'s length)."""
    model = static_model(name)
    ids, mask = left_padded_batch()
    for search in ({"do_sample": False}, {"num_beams": 3, "num_return_sequences": 2, "do_sample": False}):
        runs = [model.generate(ids, attention_mask=mask, max_new_tokens=9, output_scores=True,
                               return_dict_in_generate=True, **search, **extra)
                for extra in ({}, {"cache_implementation": "static"})]
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        torch.testing.assert_close(torch.stack(runs[1].scores), torch.stack(runs[0].scores), rtol=1e-10,
                                   atol=1e-12)
    cache = model.generate(ids, attention_mask=mask, max_new_tokens=9, cache_implementation="static",
                           return_dict_in_generate=True, do_sample=False)[CACHE_KW]
    assert all(layer.max_cache_len == 12 + 9 - 1 for layer in cache.layers)
    assert all(getattr(layer, "is_compileable", False) for layer in cache.layers)
    # one prompt, the most common call (a batch of one row once made LARA's two proposal branches disagree)
    single = [model.generate(ids[:1], max_new_tokens=9, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **extra)
              for extra in ({}, {"cache_implementation": "static"})]
    assert torch.equal(single[0].sequences, single[1].sequences)
    torch.testing.assert_close(torch.stack(single[1].scores), torch.stack(single[0].scores), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["softmax", "ra", "favor", "lara", "reformer"])
def test_static_steps_take_a_mask_over_the_capacity_or_over_the_tokens_so_far(name):
    """A decode step over a static cache reads the same with a mask of `max_cache_len` columns (fixed shapes) or of
    the positions so far, and equals the full forward at the real positions."""
    model = static_model(name)
    ids, mask = left_padded_batch()
    full = model(ids, attention_mask=mask).logits
    wide = torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], 1)  # capacity 18: later columns are never read
    for step_mask in (lambda t: wide, lambda t: mask[:, :t + 1]):
        cache = model.new_decoding_cache(max_cache_len=18)
        steps = [model(ids[:, :5], attention_mask=mask[:, :5], cache=cache, use_cache=True).logits]
        for t in range(5, 12):
            steps.append(model(ids[:, t:t + 1], attention_mask=step_mask(t), cache=cache, use_cache=True).logits)
        real = mask.bool()[..., None]
        torch.testing.assert_close(torch.cat(steps, 1) * real, full * real, rtol=1e-9, atol=1e-10)


def test_static_slots_keep_their_addresses_while_decoding_and_beam_reordering():
    """In-place writes: the tensors a compiled step (or a CUDA graph) was built on are the ones the cache keeps."""
    for name, kind in (("favor", StaticRecurrentStateLayer), ("reformer", StaticTokenBufferLayer)):
        model = static_model(name)
        ids, mask = left_padded_batch()
        cache = model.new_decoding_cache(max_cache_len=16)
        model(ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True)
        slot = cache.layers[1]
        assert isinstance(slot, kind)
        tensors = slot.state if kind is StaticRecurrentStateLayer else {**slot.buffers, **slot.sequence}
        addresses = {name: t.data_ptr() for name, t in tensors.items()}
        for t in range(6, 9):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
        cache.reorder_cache(torch.tensor([1, 0]))
        after = slot.state if kind is StaticRecurrentStateLayer else {**slot.buffers, **slot.sequence}
        assert {name: t.data_ptr() for name, t in after.items()} == addresses
        assert int(slot.get_seq_length()) == 9


@pytest.mark.parametrize("family", ["softmax", "performer", "reformer", "lara", "ra"])
def test_encoder_decoder_generate_with_a_static_cache(family):
    torch.manual_seed(0)
    config = FAMILY_CONFIGS[family](**{**SMALL, "is_decoder": False}, is_encoder_decoder=True,
                                    decoder_start_token_id=1)
    model = AutoModelForSeq2SeqLM.from_config(config).double().eval()
    ids = torch.randint(2, 37, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    runs = [model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, **extra) for extra in ({}, {"cache_implementation": "static"})]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(torch.stack(runs[1].scores), torch.stack(runs[0].scores), rtol=1e-10, atol=1e-12)


def test_static_cache_bad_input_is_refused_with_the_fix():
    model = static_model("reformer")
    ids, mask = left_padded_batch()
    for bad in (0, -3, 2.5, True, "16"):
        with pytest.raises(ValueError, match=r"max_cache_len=.* is invalid: pass the number of positions"):
            model.new_decoding_cache(max_cache_len=bad)
    with pytest.raises(ValueError, match=r"the cache holds 0 positions and the input adds 12, but the static cache "
                                         r"holds max_cache_len=8; build the cache with max_cache_len >= 12"):
        model(ids, attention_mask=mask, cache=model.new_decoding_cache(max_cache_len=8), use_cache=True)
    cache = model.new_decoding_cache(max_cache_len=13)  # decoding past the capacity is refused before any write
    model(ids, attention_mask=mask, cache=cache, use_cache=True)
    model(ids[:, :1], cache=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"the cache holds 13 positions and the input adds 1.*max_cache_len=13"):
        model(ids[:, :1], cache=cache, use_cache=True)
    assert int(cache.get_seq_length()) == 13
    learned = static_model("softmax", max_position_embeddings=64)  # learned positions: 64 of them
    with pytest.raises(ValueError, match=r"max_cache_len=80 exceeds max_position_embeddings=64.*max_cache_len <= 64"):
        learned(ids, cache=learned.new_decoding_cache(max_cache_len=80), use_cache=True)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match=rf"max_cache_len={bad} is invalid"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static",
                           max_cache_len=bad)
    cache = model.new_decoding_cache(max_cache_len=12)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 13\); with a static cache of "
                                         r"max_cache_len=12"):
        model(ids, attention_mask=torch.ones(2, 13, dtype=torch.long), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"cache_implementation='offloaded' is not supported.*'static'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="offloaded")
    torch.manual_seed(0)
    windowed = AutoModelForCausalLM.from_config(FAMILY_CONFIGS["window"](**SMALL)).eval()
    with pytest.raises(ValueError, match=r"static cache \(max_cache_len=16\) is not available for attention 'window'"
                                         r".*growing cache"):
        windowed.new_decoding_cache(max_cache_len=16)
    with pytest.raises(ValueError, match=r"not available for attention 'window'"):
        windowed.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static")


def static_decode(model, step, capacity=16):
    """Prefill 6 tokens of a left-padded batch eagerly, then 6 steps through `step`, with a mask of the cache's
    capacity (fixed shapes): [batch, 7, vocab] logits."""
    ids, mask = (x.to(model.device) for x in left_padded_batch())
    wide = torch.cat([mask, torch.ones_like(mask[:, :capacity - mask.shape[1]])], 1)
    cache = model.new_decoding_cache(max_cache_len=capacity)
    logits = [model(ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True).logits[:, -1]]
    for t in range(6, 12):  # a copy: a CUDA graph's outputs are overwritten by its next replay
        logits.append(step(ids[:, t:t + 1], cache, wide).clone())
    return torch.stack(logits, 1)


def compiled_static_decode(model, backend, mode=None):
    """(eager logits, compiled logits, frames compiled) of `static_decode`, the step compiled whole with static
    shapes (`mode="reduce-overhead"`: CUDA graphs)."""
    def step(token, cache, mask):
        return model(token, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend) if mode is None else _ModeCounter(mode)
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=counter)
    with torch.no_grad():
        eager, got = static_decode(model, step), static_decode(model, compiled)
    return eager, got, counter.frame_count


class _ModeCounter:
    """Inductor with a torch.compile `mode`'s options, counting the frames it compiles. (torch.compile hands `mode`
    to a callable backend as a keyword, which dynamo's counting backends do not take: the first GPU run failed
    there.)"""

    def __init__(self, mode: str):
        from torch._inductor import list_mode_options

        self.options, self.frame_count = list_mode_options(mode, False), 0

    def __call__(self, graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.frame_count += 1
        return compile_fx(graph, example_inputs, config_patches=self.options)


@pytest.mark.parametrize("name", ["softmax_rotary_gqa", "ra", "favor", "elu", "lara_rotary", "reformer",
                                  "reformer_rotary", "hybrid"])
def test_a_static_decode_step_traces_as_one_graph_that_is_never_recompiled(name):
    """fullgraph=True: no graph break; one frame for six steps: no recompilation as the cache fills (dynamo's own
    backend runs the captured graph, so the values are checked too)."""
    eager, got, frames = compiled_static_decode(static_model(name, torch.float32), "eager")
    assert frames == 1
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)


def test_new_caches_and_generate_calls_reuse_one_compiled_step():
    """torch.compile guards on what a step reads; nothing may depend on which cache object is passed, or every
    generate() call (a new cache each) would compile the step again."""
    for name in ("favor", "lara", "reformer"):
        model = static_model(name, torch.float32)

        def step(token, cache, mask, model=model):
            return model(token, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]

        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=counter)
        with torch.no_grad():
            first, second = static_decode(model, compiled), static_decode(model, compiled)  # two caches
        assert counter.frame_count == 1
        torch.testing.assert_close(second, first, rtol=0, atol=0)
    graphs = []

    def counting_backend(graph, example_inputs, **options):  # generate() passes its CompileConfig's mode too
        graphs.append(graph)
        return graph.forward

    config = GenerationConfig(max_new_tokens=3, do_sample=False, cache_implementation="static", max_cache_len=24,
                              compile_config=CompileConfig(backend=counting_backend, fullgraph=True, dynamic=False))
    config.compile_config._compile_all_devices = True  # transformers compiles the decode step itself on GPUs only
    ids, mask = left_padded_batch()
    torch._dynamo.reset()
    runs = [model.generate(ids, attention_mask=mask, generation_config=config) for _ in range(3)]
    assert len(graphs) == 1 and all(torch.equal(run, runs[0]) for run in runs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax_rotary_gqa", "ra", "favor", "lara", "reformer"])
def test_a_compiled_static_decode_step_equals_eager(name):
    """Inductor-compiled static decoding (the step a CUDA graph captures on a GPU) gives the eager logits."""
    eager, got, frames = compiled_static_decode(static_model(name, torch.float32), "inductor")
    assert frames == 1
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-5)
