"""Shared pieces of the attention tests: tiny Reformer configs, padding masks, and the fast-against-reference
comparison of values and gradients."""

from __future__ import annotations

import torch

from attnzoo import ZooHybridConfig, ZooReformerConfig, ZooReformerForCausalLM
from attnzoo.modeling.attention import Recomputation, UsesRecomputation
from attnzoo.transformers_compat import output_cache

HIDDEN = 16


def config(**overrides):
    values = dict(hidden_size=HIDDEN, num_attention_heads=2, lsh_chunk_length=4, lsh_full_attention_threshold=0,
                  lsh_num_buckets=4, local_chunk_length=4, hidden_dropout_prob=0.0)
    values.update(overrides)
    return ZooReformerConfig(**values)


def block_config(**overrides) -> ZooHybridConfig:
    """A 2-layer grouped-query rotary decoder of block retrieval ("block_window"): window 4, 2 sinks, blocks of 3."""
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
                  position_embedding_type="rotary", is_decoder=True, vocab_size=37, num_hidden_layers=2,
                  intermediate_size=48, hidden_dropout_prob=0.0, pad_token_id=0, max_position_embeddings=64,
                  attention_head_size=None, block_size=3, block_topk=2, attn_layers=["block_window"])
    values.update(overrides)
    return ZooHybridConfig(**values)


def lm_config(**overrides):
    values = dict(vocab_size=37, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=64, lsh_chunk_length=4, lsh_full_attention_threshold=0,
                  lsh_num_buckets=4, lsh_num_hashes=2, local_chunk_length=4, hidden_dropout_prob=0.0,
                  lsh_hash_seed=7, pad_token_id=0, eos_token_id=None)
    values.update(overrides)
    return ZooReformerConfig(**values)


def decoding_model(**overrides):
    torch.manual_seed(0)
    return ZooReformerForCausalLM(lm_config(**overrides)).double().eval()


def assert_cached_decoding_equals_full_forward(model, ids, prefix: int, rtol=1e-9, atol=1e-10):
    """Prefill `prefix` tokens, decode the rest one at a time with the cache: the logits equal one full forward."""
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :prefix], use_cache=True)
    steps = [out.logits]
    for t in range(prefix, ids.shape[1]):
        out = model(ids[:, t:t + 1], cache=output_cache(out), use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=rtol, atol=atol)


def saved_loaded_and_generating_like_the_full_forward(model, folder, vocab: int, new_tokens: int = 10):
    """Save `model` to `folder` and load it back with `AutoModelForCausalLM`; greedy generation from a 9-token prompt
    must give the logits of the original model's full forward over the generated sequence. Returns the loaded
    model."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.randint(1, vocab, (1, 9))
    out = loaded.generate(prompt, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    torch.testing.assert_close(torch.stack(out.logits, 1), model(out.sequences[:, :-1]).logits[:, 8:],
                               rtol=1e-5, atol=1e-5)
    return loaded


def scaled_qkv(n=12, seed=0, heads=1, batch=1, dim=8):
    """Pre-scaled q̂, k̂ (and v) of the randomized attentions, [batch, heads, n, dim] float64, seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, dim, generator=g, dtype=torch.float64) * dim ** -0.25 * 1.2
            for _ in range(3)]


def padding_mask(batch, length, left=2, right=2):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, length - right:] = False
    if batch > 1:
        mask[1, :left] = False
    return mask


def fast_and_reference(attn, x, **kwargs):
    """(forward, reference_forward) of `attn` on `x`, the reference replaying the forward's random state (LSH's
    buckets) as a reversible recomputation would."""
    if not isinstance(attn, UsesRecomputation):
        return attn(x, **kwargs), attn.reference_forward(x, **kwargs)
    record = Recomputation()
    fast = attn(x, recompute=record, **kwargs)
    record.replaying = True
    return fast, attn.reference_forward(x, recompute=record, **kwargs)


def assert_same_values_and_gradients(attn, x, mask, fast, reference, rtol=1e-10, atol=1e-12):
    """Two outputs of `attn` on `x` agree at the real positions of `mask` (None: all), and so do their gradients
    with respect to `x` and every parameter (float64 tolerances by default)."""
    if mask is None:
        mask = torch.ones(fast.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(fast[mask], reference[mask], rtol=rtol, atol=atol)
    weights = torch.randn_like(fast) * mask[..., None]
    params = [p for p in attn.parameters() if p.requires_grad]
    grads = [torch.autograd.grad((out * weights).sum(), [x, *params], allow_unused=True) for out in (fast, reference)]
    for a, b in zip(*grads, strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=rtol * 10, atol=atol * 10)


def named(name: str):
    """`msg` for torch.testing.assert_close that puts `name` before its own message (a bare `msg=name` replaces the
    message, hiding how far apart the tensors were: the first GPU runs reported only a parameter's name)."""
    return lambda message: f"{name}: {message}"
