"""LSH attention: hashing, the fast path against its dense reference (values and gradients) and against exact
shared-QK attention, the union of hash rounds, reversible bucket reuse, and cached decoding with real hashing."""

import itertools
import math

import pytest
import torch

from attnzoo import ZooReformerConfig, ZooReformerForCausalLM
from attnzoo.modeling.attention import Recomputation
from attnzoo.modeling.attention.base import allowed_keys
from attnzoo.modeling.attention.local import LocalAttention
from attnzoo.modeling.attention.lsh import LSHAttention
from attnzoo.modeling.attention.lsh_hashing import (
    default_bucket_factors,
    hash_buckets,
    inverse_permutation,
    normalize_keys,
    sort_by_bucket,
)
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import (
    HIDDEN,
    assert_cached_decoding_equals_full_forward,
    assert_same_values_and_gradients,
    config,
    decoding_model,
    fast_and_reference,
    lm_config,
    named,
    padding_mask,
)


def test_hash_is_argmax_over_rotations_and_their_negatives():
    torch.manual_seed(0)
    vectors = torch.randn(2, 3, 10, 8)
    rotations = torch.randn(2, 3, 4, 8, 3 + 2)  # factors 6 and 4
    buckets = hash_buckets(vectors, rotations, [6, 4])
    rotated = torch.einsum("bhld,bhrdf->bhrlf", vectors, rotations)
    first = torch.cat([rotated[..., :3], -rotated[..., :3]], -1).argmax(-1)
    second = torch.cat([rotated[..., 3:], -rotated[..., 3:]], -1).argmax(-1)
    assert torch.equal(buckets, first + 6 * second)
    assert buckets.min() >= 0 and buckets.max() < 24


def test_default_bucket_count_is_two_per_chunk_and_factorised_when_large():
    assert default_bucket_factors(64, 64) == [2]
    assert default_bucket_factors(100, 8) == [26]  # 13 chunks
    assert default_bucket_factors(4096, 64) == [128]
    factors = default_bucket_factors(65536, 64)  # 2048 buckets -> about sqrt(2048) each
    assert len(factors) == 2 and all(f % 2 == 0 for f in factors) and math.prod(factors) >= 2048
    assert max(factors) <= 64


def test_sort_is_by_bucket_then_position():
    buckets = torch.tensor([[3, 1, 3, 0, 1, 1]])
    order = sort_by_bucket(buckets)
    assert order.tolist() == [[3, 1, 4, 5, 0, 2]]
    assert torch.equal(inverse_permutation(order).gather(-1, order), torch.arange(6)[None])


def test_rotations_come_from_the_hash_seed_or_the_global_rng():
    seeded = LSHAttention(config(lsh_hash_seed=3), 0, causal=True)
    assert torch.equal(seeded.draw_rotations(2, 2, [4], "cpu"), seeded.draw_rotations(2, 2, [4], "cpu"))
    other_layer = LSHAttention(config(lsh_hash_seed=3), 1, causal=True)
    assert not torch.equal(seeded.draw_rotations(2, 2, [4], "cpu"), other_layer.draw_rotations(2, 2, [4], "cpu"))
    unseeded = LSHAttention(config(), 0, causal=True)
    torch.manual_seed(5)
    first = unseeded.draw_rotations(2, 2, [4], "cpu")
    torch.manual_seed(5)
    assert torch.equal(first, unseeded.draw_rotations(2, 2, [4], "cpu"))
    rotations = unseeded.draw_rotations(3, 2, [4], "cpu")
    assert rotations.shape == (3, 2, 2, HIDDEN // 2, 2)
    assert not torch.equal(rotations[0], rotations[1]) and not torch.equal(rotations[:, :, 0], rotations[:, :, 1])


# -- LSH against exact attention and against its reference ----------------------------------------------------
def exact_shared_qk_attention(attn, x, key_mask):
    """softmax(q k^T) v with k = q/|q|, masks as the contract says, and a token's own key only when it has no other
    allowed key (a hard mask here, not LSH's large finite penalty)."""
    qk, v = attn._project(x)
    length = x.shape[1]
    allowed = allowed_keys(key_mask, length, length, attn.causal, x.device)
    if allowed is None:
        allowed = torch.ones(1, 1, length, length, dtype=torch.bool)
    others = allowed & ~torch.eye(length, dtype=torch.bool)
    allowed = torch.where(others.any(-1, keepdim=True), others, allowed)
    scores = (qk @ normalize_keys(qk).transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    return attn.output(attn.merge_heads(scores.softmax(-1) @ v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("path", ["one chunk", "full-attention threshold"])
def test_lsh_covering_the_sequence_equals_exact_shared_qk_attention(causal, path):
    torch.manual_seed(0)
    length = 11
    if path == "one chunk":  # hashing still runs, 3 rounds, but one chunk holds everything
        overrides = dict(lsh_chunk_length=16, lsh_attend_to="chunk", lsh_num_hashes=3)
    else:
        overrides = dict(lsh_full_attention_threshold=16)
    attn = LSHAttention(config(**overrides), 0, causal).double().eval()
    x = torch.randn(2, length, HIDDEN, dtype=torch.float64)
    mask = padding_mask(2, length)
    got = attn(x, attention_mask=mask)
    expected = exact_shared_qk_attention(attn, x, mask)
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-12, atol=1e-12)


LSH_SETTINGS = list(itertools.product([False, True], ["bucket", "chunk"], [13, 16], [1, 3]))


@pytest.mark.parametrize("causal,window,length,rounds", LSH_SETTINGS)
def test_lsh_fast_path_equals_reference(causal, window, length, rounds):
    torch.manual_seed(length + rounds)
    attn = LSHAttention(config(lsh_attend_to=window, lsh_num_hashes=rounds, lsh_num_chunks_after=1), 0, causal)
    attn = attn.double().train()  # training mode: the train-time number of rounds
    x = torch.randn(2, length, HIDDEN, dtype=torch.float64, requires_grad=True)
    mask = padding_mask(2, length)
    record = Recomputation()
    fast = attn(x, attention_mask=mask, recompute=record)
    record.replaying = True
    reference = attn.reference_forward(x, attention_mask=mask, recompute=record)  # the same buckets
    assert record.saved["buckets"].shape == (2, 2, rounds, length + (-length) % 4)
    assert_same_values_and_gradients(attn, x, mask, fast, reference)


def test_reference_draws_the_same_rotations_as_the_fast_path():
    attn = LSHAttention(config(lsh_num_hashes=2), 0, causal=True).double()
    x = torch.randn(1, 10, HIDDEN, dtype=torch.float64)
    torch.manual_seed(1)
    fast = attn(x)
    torch.manual_seed(1)
    torch.testing.assert_close(fast, attn.reference_forward(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window", ["bucket", "chunk"])
def test_multi_round_attention_is_a_softmax_over_the_union_of_the_rounds(window):
    # Appendix A: with the duplicate correction, combining rounds by their log-sum-exps equals one softmax over the
    # union of the rounds' candidate keys. The union is built here from the buckets alone.
    torch.manual_seed(3)
    attn = LSHAttention(config(lsh_attend_to=window, lsh_num_hashes=4, lsh_num_chunks_after=1), 0,
                        causal=False).double().eval()
    length, m = 16, 4
    x = torch.randn(1, length, HIDDEN, dtype=torch.float64)
    record = Recomputation()
    got = attn(x, recompute=record)
    buckets = record.saved["buckets"]  # [1, H, R, L]
    slots = inverse_permutation(sort_by_bucket(buckets))
    gap = slots[..., None, :] - slots[..., :, None]
    if window == "chunk":
        chunk_gap = slots[..., None, :] // m - slots[..., :, None] // m
        candidate = (chunk_gap >= -1) & (chunk_gap <= 1)
    else:
        candidate = (buckets[..., None, :] == buckets[..., :, None]) & (gap.abs() <= m)
    union = candidate.any(dim=2)  # [1, H, L, L]
    qk, v = attn._project(x)
    scores = qk @ normalize_keys(qk).transpose(-1, -2)
    is_self = torch.eye(length, dtype=torch.bool)
    others = union & ~is_self
    allowed = torch.where(others.any(-1, keepdim=True), others, union)
    expected = attn.output(attn.merge_heads(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_error_against_exact_attention_falls_as_hash_rounds_grow(causal):
    errors = []
    for rounds in (1, 2, 4, 8):
        total = 0.0
        for seed in range(4):
            torch.manual_seed(seed)
            attn = LSHAttention(config(hidden_size=32, lsh_chunk_length=8, lsh_num_buckets=8, lsh_num_hashes=rounds,
                                       lsh_hash_seed=seed, lsh_num_chunks_after=1), 0, causal).double().eval()
            x = torch.randn(2, 64, 32, dtype=torch.float64) * 2
            exact = exact_shared_qk_attention(attn, x, None)
            total += ((attn(x) - exact).norm() / exact.norm()).item()
        errors.append(total / 4)
    assert all(later < 0.8 * earlier for earlier, later in itertools.pairwise(errors)), errors


def test_eval_uses_its_own_number_of_hash_rounds():
    attn = LSHAttention(config(lsh_num_hashes=2, lsh_num_hashes_eval=5), 0, causal=True)
    x = torch.randn(1, 12, HIDDEN)
    record = Recomputation()
    attn.train()(x, recompute=record)
    assert record.saved["buckets"].shape[2] == 2
    record = Recomputation()
    attn.eval()(x, recompute=record)
    assert record.saved["buckets"].shape[2] == 5


def test_reversible_backward_reuses_buckets_and_equals_plain_autograd(monkeypatch):
    torch.manual_seed(0)
    config = lm_config(reversible=True, hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.2,
                       local_attention_probs_dropout_prob=0.1, lsh_hash_seed=None, num_hidden_layers=4)
    model = ZooReformerForCausalLM(config).double().train()
    lsh_layers = [m for m in model.modules() if isinstance(m, LSHAttention)]
    replays = []
    for layer in lsh_layers:
        layer.register_forward_hook(lambda m, args, kwargs, out: replays.append(kwargs.get("recompute")),
                                    with_kwargs=True)
    hash_calls = []
    real_hash = LSHAttention.hash_vectors
    monkeypatch.setattr(LSHAttention, "hash_vectors",
                        lambda self, *a: hash_calls.append(self) or real_hash(self, *a))
    ids = torch.randint(2, 37, (2, 14))
    results = []
    for use_reversible_backward in (True, False):
        model.model.transformer.use_reversible_backward = use_reversible_backward
        hash_calls.clear()
        replays.clear()
        model.zero_grad()
        torch.manual_seed(123)  # the same rotations and dropout masks in both runs
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        if use_reversible_backward:
            # forward + recomputation both ran every LSH layer, but each hashed once: the recomputation read the
            # buckets its forward saved in its `Recomputation`.
            assert len(replays) == 2 * len(lsh_layers)
            assert sorted(map(id, hash_calls)) == sorted(map(id, lsh_layers))
            assert all(r is not None and r.saved["buckets"].shape == (2, 2, 2, 16) for r in replays)
    (loss_rev, grads_rev), (loss_ref, grads_ref) = results
    torch.testing.assert_close(loss_rev, loss_ref, rtol=0, atol=1e-12)
    for name in grads_ref:
        torch.testing.assert_close(grads_rev[name], grads_ref[name], rtol=1e-7, atol=1e-10, msg=named(name))


@pytest.mark.parametrize("correction", [True, False])
def test_cached_decoding_equals_the_full_forward_with_real_hashing(correction):
    # lsh_attend_to="bucket" (default) + seeded rotations + a fixed bucket count: a cached step attends exactly to what
    # the full forward gives the last token, in every layer.
    model = decoding_model(lsh_num_hashes_eval=3, lsh_duplicate_correction=correction)
    ids = torch.randint(2, 37, (2, 30))
    assert_cached_decoding_equals_full_forward(model, ids, prefix=11)
    # generate() with and without the cache, and the full forward, agree token for token
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    cached = model.generate(ids[:, :9], use_cache=True, **kwargs)
    uncached = model.generate(ids[:, :9], use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert torch.equal(model(cached[:, :-1]).logits[:, 8:].argmax(-1), cached[:, 9:])


def test_multi_token_steps_and_crop_keep_decoding_exact():
    model = decoding_model(attn_layers=["lsh"])
    ids = torch.randint(2, 37, (2, 24))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :10], use_cache=True)
    cache = output_cache(out)
    logits = model(ids[:, 10:15], cache=cache, use_cache=True).logits  # five tokens at once
    torch.testing.assert_close(logits, full[:, 10:15], rtol=1e-9, atol=1e-10)
    cache.crop(-3)  # back to 12 tokens, then decode them again
    assert cache.get_seq_length() == 12
    logits = model(ids[:, 12:24], cache=cache, use_cache=True).logits
    torch.testing.assert_close(logits, full[:, 12:24], rtol=1e-9, atol=1e-10)


def test_decoding_cost_per_token_is_bounded():
    model = decoding_model()
    out = model(torch.randint(2, 37, (1, 40)), use_cache=True)
    for _ in range(3):
        out = model(torch.randint(2, 37, (1, 1)), cache=output_cache(out), use_cache=True)
    local_layer, lsh_layer = output_cache(out).layers
    local = model.model.transformer.blocks[0].attn
    index, _ = local.decode_window(local_layer, 1)
    assert index.shape[-1] == (1 + 1) * 4  # a new token reads only its window's keys, whatever the context
    assert local_layer.get_seq_length() == 43 and local_layer.is_croppable  # all are kept, so it can be cropped
    lsh = model.model.transformer.blocks[1].attn
    qk = torch.randn(1, 2, 1, lsh.head_dim, dtype=torch.float64)
    listed = lsh.join_buckets(qk, qk, torch.ones(1, 1, dtype=torch.bool), lsh_layer)
    assert listed.shape == (1, 2, 2, 4 + 1)  # a new token reads K keys per round and its own, whatever the context


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("seeded", [True, False])
def test_decoding_cache_holds_a_kv_cache_and_small_bucket_indices(kv_heads, seeded):
    # What a KV cache of the same heads holds (the shared query-keys and the unrepeated values), each key's buckets as
    # int16 and a validity flag, at any length: no per-bucket table, no spare room past a few percent, and no
    # rotations when decoding can draw them again from the evaluation seed.
    config = lm_config(attn_layers=["lsh"], num_attention_heads=4, num_key_value_heads=kv_heads, hidden_size=256,
                       lsh_num_buckets=None, max_position_embeddings=1024, lsh_chunk_length=8,
                       lsh_hash_seed=7 if seeded else None)
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(config).eval()
    lsh = model.model.transformer.blocks[0].attn
    assert math.prod(lsh.bucket_factors()) == 256
    for length in (520, 1000):  # past MIN_SPARE_TOKENS / 5%: the spare room is at most 1 / SPARE_FRACTION
        cache = output_cache(model(torch.randint(2, 37, (1, length)), use_cache=True))
        for _ in range(3):
            cache = output_cache(model(torch.randint(2, 37, (1, 1)), cache=cache, use_cache=True))
        layer = cache.layers[0]
        held = length + 3
        assert layer.buffers["keys"].shape[:2] == (1, 4) and layer.buffers["values"].shape[:2] == (1, kv_heads)
        assert layer.buffers["buckets"].dtype == torch.int16
        assert set(layer.sequence) == ({"lead"} if not seeded else {"lead", "rotations"})
        kv_bytes = held * (4 + kv_heads) * lsh.head_dim * 4  # keys of every query head (shared QK) and values
        stored = sum(b.numel() * b.element_size() for b in layer.buffers.values())
        extra = held * (4 * 2 * 2 + 1)  # int16 buckets of 4 heads x 2 rounds, a bool per token
        assert stored <= 1.05 * (kv_bytes + extra)
        assert kv_bytes + extra <= 1.05 * kv_bytes


def test_beam_search_and_batched_left_padding_with_real_hashing():
    model = decoding_model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 37, (n,), generator=g) for n in (9, 6)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 9 - len(p):], mask[row, 9 - len(p):] = p, 1
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, attention_mask=mask, use_cache=True, **kwargs)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    beams = model.generate(ids, attention_mask=mask, num_beams=3, **kwargs)
    assert beams.shape == (2, 19)


def test_bf16_hashing_forward_is_finite():
    model = ZooReformerForCausalLM(lm_config(lsh_hash_seed=None)).to(torch.bfloat16).train()
    ids = torch.randint(2, 37, (2, 21))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)


@pytest.mark.parametrize("kind", ["lsh full", "lsh chunked", "local"])
def test_batch_of_one_equals_reference(kind):
    # A batch of one gives views with unusual strides after the head split; the kernel must not assume contiguity.
    torch.manual_seed(2)
    threshold = 32 if kind == "lsh full" else 0
    cls = LocalAttention if kind == "local" else LSHAttention
    attn = cls(config(lsh_full_attention_threshold=threshold, lsh_num_hashes=2), 0, causal=False).double()
    x = torch.randn(1, 11, HIDDEN, dtype=torch.float64, requires_grad=True)
    assert_same_values_and_gradients(attn, x, None, *fast_and_reference(attn, x))


def test_reversible_backward_with_chunked_feed_forward_equals_plain_autograd():
    # The reversible backward recomputes and backpropagates a chunked feed-forward one chunk at a time; dropout and
    # drop-path masks must repeat exactly.
    torch.manual_seed(0)
    config = lm_config(reversible=True, hidden_dropout_prob=0.2, drop_path_rate=0.3, chunk_size_feed_forward=4,
                       num_hidden_layers=3, lsh_hash_seed=None)
    model = ZooReformerForCausalLM(config).double().train()
    ids = torch.randint(2, 37, (2, 14))
    results = []
    for use_reversible_backward in (True, False):
        model.model.transformer.use_reversible_backward = use_reversible_backward
        model.zero_grad()
        torch.manual_seed(7)
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-12)
    for name in results[1][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=1e-7, atol=1e-10, msg=named(name))


def test_cache_batch_utilities_keep_decoding_exact():
    # batch_repeat_interleave / batch_select_indices / reorder_cache act on every per-sequence tensor of both cache
    # layer kinds (keys, ring buffers, rotations, bucket lists), so the decoded logits stay those of a full forward.
    model = decoding_model()
    ids = torch.randint(2, 37, (2, 20))
    full = model(ids, use_cache=False).logits
    cache = output_cache(model(ids[:, :12], use_cache=True))
    cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
    cache.reorder_cache(torch.tensor([3, 2, 1, 0]))  # rows 1, 1, 0, 0
    cache.batch_select_indices(torch.tensor([0, 2]))  # rows 1, 0
    logits = model(ids[[1, 0], 12:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(logits, full[[1, 0], 12:], rtol=1e-9, atol=1e-10)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_causal_threshold_is_per_position_in_fast_path_reference_and_decoding():
    # Causal layers give the first `lsh_full_attention_threshold` positions full attention at any length, so
    # decoding that starts below the threshold and grows past it stays equal to the full forward.
    torch.manual_seed(4)
    attn = LSHAttention(config(lsh_full_attention_threshold=5, lsh_num_hashes=2), 0, causal=True).double()
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64, requires_grad=True)
    assert_same_values_and_gradients(attn, x, None, *fast_and_reference(attn, x))
    model = decoding_model(lsh_full_attention_threshold=5)
    assert_cached_decoding_equals_full_forward(model, torch.randint(2, 37, (2, 16)), prefix=2)


@pytest.mark.parametrize("reversible", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_one_examples_nan_never_reaches_the_other_examples(reversible, training):
    """Examples in a batch never influence each other: a NaN in one example's inputs leaves the others finite and
    unchanged (LSH windows at a row's end read the next row's chunks with probability 0, and 0 * NaN is NaN)."""
    torch.manual_seed(0)
    config = ZooReformerConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=128, attn_layers=["lsh", "local"],
                               lsh_chunk_length=8, local_chunk_length=8, reversible=reversible, is_decoder=True,
                               hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0)
    model = ZooReformerForCausalLM(config).train(training)
    embeds = model.model.embed_tokens(torch.randint(0, 40, (3, 40))).detach()
    poisoned = embeds.clone()
    poisoned[1, 5] = float("nan")
    with torch.no_grad():
        torch.manual_seed(1)
        clean = model(inputs_embeds=embeds, use_cache=False).logits
        torch.manual_seed(1)
        dirty = model(inputs_embeds=poisoned, use_cache=False).logits
    assert torch.isnan(dirty[1]).any()
    torch.testing.assert_close(dirty[[0, 2]], clean[[0, 2]], rtol=0, atol=0)
