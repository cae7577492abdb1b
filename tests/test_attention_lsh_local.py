"""LSH and local attention: fast paths against their dense references and exact attention, hashing, causality,
padding, any length, reversible bucket reuse and cached decoding with real hashing."""

import itertools
import math

import pytest
import torch

from attnzoo import ZooReformerConfig, ZooReformerForCausalLM
from attnzoo.modeling.attention.base import allowed_keys
from attnzoo.modeling.attention.chunked import WindowMask, windowed_attention, windows
from attnzoo.modeling.attention.local import LocalAttention
from attnzoo.modeling.attention.lsh import (
    LSHAttention,
    default_bucket_factors,
    hash_buckets,
    inverse_permutation,
    normalize_keys,
    sort_by_bucket,
)

HIDDEN = 16


def config(**overrides):
    values = dict(hidden_size=HIDDEN, num_attention_heads=2, lsh_chunk_length=4, lsh_full_attention_threshold=0,
                  lsh_num_buckets=4, local_chunk_length=4, hidden_dropout_prob=0.0)
    values.update(overrides)
    return ZooReformerConfig(**values)


def padding_mask(batch, length, left=2, right=2):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, length - right:] = False
    if batch > 1:
        mask[1, :left] = False
    return mask


def lm_config(**overrides):
    values = dict(vocab_size=37, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=64, lsh_chunk_length=4, lsh_full_attention_threshold=0,
                  lsh_num_buckets=4, lsh_num_hashes=2, local_chunk_length=4, hidden_dropout_prob=0.0,
                  lsh_hash_seed=7, pad_token_id=0, eos_token_id=None)
    values.update(overrides)
    return ZooReformerConfig(**values)


def assert_same_values_and_gradients(attn, x, mask, fast, reference):
    """Two outputs of `attn` on `x` agree at the real positions of `mask`, and so do their gradients with respect
    to `x` and every parameter (float64 tolerances)."""
    torch.testing.assert_close(fast[mask], reference[mask], rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(fast) * mask[..., None]
    grads = [torch.autograd.grad((out * weights).sum(), [x, *attn.parameters()]) for out in (fast, reference)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


# -- the chunked kernel ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("save_probs", [False, True])
def test_windowed_attention_backward_equals_autograd_of_the_same_math(save_probs):
    torch.manual_seed(0)
    n, chunks, m, d = 6, 3, 4, 5  # 2 groups of 3 hash rounds
    q, k, v = (torch.randn(n, chunks, m, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    positions = torch.arange(chunks * m).view(1, chunks, m).expand(n, -1, -1)
    valid = torch.rand(n, chunks, m) > 0.2
    valid[0, 0] = False  # a chunk whose queries see nothing (padding): finite, no gradient
    mask = WindowMask(positions, valid, before=1, after=1, causal=True, self_penalty=True,
                      groups=torch.randint(0, 2, (n, chunks, m)), group_band=(-5, 2),
                      round_locations=torch.randint(0, 4, (n, chunks, m, 3)), round_band=(-1, 1))

    def plain(q, k, v):
        scores = mask.apply_(q @ windows(k, 1, 1, 0, 1).transpose(-1, -2) * 0.5)
        lse = scores.logsumexp(-1).clamp(min=-1e9)
        probs = (scores - lse[..., None]).exp()
        # rows left with only their own (penalised, constant) key carry no gradient to it
        only_self = (lse <= -5e4)[..., None]
        probs = torch.where(only_self, probs.detach(), probs)
        return probs @ windows(v, 1, 1, 0, 1), lse

    fast, slow = windowed_attention(q, k, v, mask, 0.5, 0.0, save_probs), plain(q, k, v)
    assert torch.isfinite(fast[0]).all() and torch.isfinite(fast[1]).all()
    weights = [torch.randn_like(t) for t in fast]
    grads = [torch.autograd.grad(sum((t * w).sum() for t, w in zip(out, weights, strict=True)), (q, k, v))
             for out in (fast, slow)]
    for a, b in zip(fast + grads[0], slow + grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    def with_dropout(q, k, v):
        torch.manual_seed(5)  # the same dropout mask on every call
        return windowed_attention(q, k, v, mask, 0.5, 0.3, save_probs)

    assert torch.autograd.gradcheck(with_dropout, (q, k, v))


def test_window_mask_drops_keys_an_earlier_round_listed():
    # Rows of 3 hash rounds: a round-r row may use a window key only if no round before r listed it (its location
    # gap there within the band); written out densely per (group, round, query, key).
    torch.manual_seed(1)
    groups, rounds, chunks, m, before, after, band = 2, 3, 4, 2, 1, 0, (-2, 1)
    n, width = groups * rounds, (before + 1 + after) * m
    positions = torch.arange(chunks * m).view(1, chunks, m).expand(n, -1, -1)
    valid = torch.rand(n, chunks, m) > 0.1
    locations = torch.randint(0, 6, (n, chunks, m, rounds))
    plain = WindowMask(positions, valid, before, after)
    mask = WindowMask(positions, valid, before, after, round_locations=locations, round_band=band)
    key_locations = windows(locations, before, after, 0, rest_dims=1)  # [n, C, W, R]
    gap = key_locations[:, :, None, :, :] - locations[:, :, :, None, :]  # [n, C, m, W, R]
    listed = (gap >= band[0]) & (gap <= band[1])
    round_of_row = torch.arange(n) % rounds
    earlier = torch.arange(rounds)[None, :] < round_of_row[:, None]  # [n, R]: round e is before the row's round
    listed_earlier = (listed & earlier[:, None, None, None, :]).any(-1)
    expected = plain.disallowed() | listed_earlier
    assert listed_earlier[round_of_row == 0].sum() == 0 and listed_earlier.any()
    assert mask.disallowed().shape == (n, chunks, m, width)
    torch.testing.assert_close(mask.disallowed(), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="whole groups"):
        WindowMask(positions[:5], valid[:5], before, after, round_locations=locations[:5], round_band=band).disallowed()


# -- hashing ----------------------------------------------------------------------------------------------------
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
        overrides = dict(lsh_chunk_length=16, lsh_window="chunk", lsh_num_hashes=3)
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
    attn = LSHAttention(config(lsh_window=window, lsh_num_hashes=rounds, lsh_num_chunks_after=1), 0, causal)
    attn = attn.double().train()  # training mode: the train-time number of rounds
    x = torch.randn(2, length, HIDDEN, dtype=torch.float64, requires_grad=True)
    mask = padding_mask(2, length)
    replay = {}
    fast = attn(x, attention_mask=mask, replay=replay)
    reference = attn.reference_forward(x, attention_mask=mask, replay=replay)  # the same buckets
    assert replay["buckets"].shape == (2, 2, rounds, length + (-length) % 4)
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
    # Eq. 13-16: with the duplicate correction, combining rounds by their log-sum-exps equals one softmax over the
    # union of the rounds' candidate keys. The union is built here from the buckets alone.
    torch.manual_seed(3)
    attn = LSHAttention(config(lsh_window=window, lsh_num_hashes=4), 0, causal=False).double().eval()
    length, m = 16, 4
    x = torch.randn(1, length, HIDDEN, dtype=torch.float64)
    replay = {}
    got = attn(x, replay=replay)
    buckets = replay["buckets"]  # [1, H, R, L]
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
                                       lsh_hash_seed=seed), 0, causal).double().eval()
            x = torch.randn(2, 64, 32, dtype=torch.float64) * 2
            exact = exact_shared_qk_attention(attn, x, None)
            total += ((attn(x) - exact).norm() / exact.norm()).item()
        errors.append(total / 4)
    assert all(later < 0.8 * earlier for earlier, later in itertools.pairwise(errors)), errors


def test_eval_uses_its_own_number_of_hash_rounds():
    attn = LSHAttention(config(lsh_num_hashes=2, lsh_num_hashes_eval=5), 0, causal=True)
    x = torch.randn(1, 12, HIDDEN)
    replay = {}
    attn.train()(x, replay=replay)
    assert replay["buckets"].shape[2] == 2
    replay = {}
    attn.eval()(x, replay=replay)
    assert replay["buckets"].shape[2] == 5


# -- local attention -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal,before,after,length", list(itertools.product([False, True], [0, 1, 2], [0, 1],
                                                                               [3, 13, 16])))
def test_local_fast_path_equals_reference(causal, before, after, length):
    torch.manual_seed(before + 3 * after + length)
    attn = LocalAttention(config(local_num_chunks_before=before, local_num_chunks_after=after), 0, causal).double()
    x = torch.randn(2, length, HIDDEN, dtype=torch.float64, requires_grad=True)
    mask = padding_mask(2, length, left=3, right=2)
    fast, reference = attn(x, attention_mask=mask), attn.reference_forward(x, attention_mask=mask)
    assert_same_values_and_gradients(attn, x, mask, fast, reference)


def test_local_attention_sees_exactly_its_chunk_window():
    attn = LocalAttention(config(local_chunk_length=4, local_num_chunks_before=1), 0, causal=True).double()
    x = torch.randn(1, 16, HIDDEN, dtype=torch.float64)
    base = attn(x)
    for changed, query in [(2, 9), (3, 8), (4, 8), (7, 9), (12, 15)]:
        y = x.clone()
        y[0, changed] += 1.0
        moved = (attn(y) - base)[0].abs().sum(-1) > 1e-12
        # token `changed` (chunk changed // 4) is seen by the rest of its chunk and the whole next chunk
        expected = (torch.arange(16) >= changed) & (torch.arange(16) // 4 <= changed // 4 + 1)
        assert torch.equal(moved, expected), (changed, query)


# -- causality and padding of whole models ---------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", [["lsh"], ["local"], ["local", "lsh"]])
def test_causal_models_leak_nothing_from_the_future_with_real_hashing(pattern):
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(attn_layers=pattern, lsh_num_buckets=None)).double().eval()
    ids = torch.randint(2, 37, (2, 23))
    base = model(ids).logits
    for t in (5, 12, 22):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 5) % 35 + 2
        logits = model(changed).logits
        torch.testing.assert_close(logits[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(logits[:, t:], base[:, t:])


def test_chunk_window_lets_later_hashes_move_earlier_windows():
    # Documents why "bucket" is the default: with chunk windows a later token can reorder the sorted sequence and
    # change which earlier keys share an earlier query's chunk.
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(attn_layers=["lsh"], lsh_window="chunk", num_hidden_layers=1,
                                             lsh_num_buckets=8)).double().eval()
    ids = torch.randint(2, 37, (1, 32))
    base = model(ids).logits
    moved = False
    for t in range(16, 32):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 5) % 35 + 2
        moved |= not torch.allclose(model(changed).logits[:, :16], base[:, :16], rtol=0, atol=1e-12)
    assert moved


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["lsh", "local"])
def test_padded_rows_equal_the_sequence_alone(kind, causal):
    torch.manual_seed(1)
    cls = LSHAttention if kind == "lsh" else LocalAttention
    attn = cls(config(lsh_hash_seed=11, lsh_num_hashes=2), 0, causal).double().eval()
    seq = torch.randn(1, 10, HIDDEN, dtype=torch.float64)
    alone = attn(seq)
    for side in ("left", "right"):
        filler = torch.randn(1, 5, HIDDEN, dtype=torch.float64)
        x = torch.cat([filler, seq] if side == "left" else [seq, filler], dim=1)
        mask = torch.ones(1, 15, dtype=torch.bool)
        mask[0, :5] = side != "left"
        mask[0, 10:] = side != "right"
        # Row 0 of any batch gets the same seeded rotations, so the padded row hashes like the sequence alone.
        got = attn(x, attention_mask=mask)[mask]
        torch.testing.assert_close(got, alone[0], rtol=1e-10, atol=1e-12, msg=side)


# -- any length, reversible bucket reuse -------------------------------------------------------------------------
def test_any_length_trains_and_generates():
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(lsh_hash_seed=None, lsh_num_buckets=None, reversible=True,
                                             position_embedding_type="axial")).train()
    for length in (5, 13, 30):
        ids = torch.randint(2, 37, (2, length))
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    out = model.eval().generate(torch.randint(2, 37, (2, 7)), max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16)


def test_reversible_backward_reuses_buckets_and_equals_plain_autograd():
    torch.manual_seed(0)
    config = lm_config(reversible=True, hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.2,
                       local_attention_probs_dropout_prob=0.1, lsh_hash_seed=None, num_hidden_layers=4)
    model = ZooReformerForCausalLM(config).double().train()
    lsh_layers = [m for m in model.modules() if isinstance(m, LSHAttention)]
    replays = []
    for layer in lsh_layers:
        layer.register_forward_hook(lambda m, args, kwargs, out: replays.append(kwargs.get("replay")),
                                    with_kwargs=True)
    ids = torch.randint(2, 37, (2, 14))
    results = []
    for use_reversible_backward in (True, False):
        model.model.transformer.use_reversible_backward = use_reversible_backward
        for layer in lsh_layers:
            layer.hash_calls = 0
        replays.clear()
        model.zero_grad()
        torch.manual_seed(123)  # the same rotations and dropout masks in both runs
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        if use_reversible_backward:
            # forward + recomputation both ran every LSH layer, but each hashed once: the recomputation read the
            # buckets its forward stored in `replay`.
            assert len(replays) == 2 * len(lsh_layers)
            assert all(layer.hash_calls == 1 for layer in lsh_layers)
            assert all(r is not None and r["buckets"].shape == (2, 2, 2, 16) for r in replays)
    (loss_rev, grads_rev), (loss_ref, grads_ref) = results
    torch.testing.assert_close(loss_rev, loss_ref, rtol=0, atol=1e-12)
    for name in grads_ref:
        torch.testing.assert_close(grads_rev[name], grads_ref[name], rtol=1e-7, atol=1e-10, msg=name)


# -- cached decoding with real hashing ---------------------------------------------------------------------------------
def decoding_model(**overrides):
    torch.manual_seed(0)
    return ZooReformerForCausalLM(lm_config(**overrides)).double().eval()


@pytest.mark.parametrize("correction", [True, False])
def test_cached_decoding_equals_the_full_forward_with_real_hashing(correction):
    # lsh_window="bucket" (default) + seeded rotations + a fixed bucket count: a cached step attends exactly to what
    # the full forward gives the last token, in every layer.
    model = decoding_model(lsh_num_hashes_eval=3, lsh_duplicate_correction=correction)
    ids = torch.randint(2, 37, (2, 30))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :11], use_cache=True)
    steps = [out.logits]
    for t in range(11, 30):
        out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)
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
    cache = out.past_key_values
    logits = model(ids[:, 10:15], past_key_values=cache, use_cache=True).logits  # five tokens at once
    torch.testing.assert_close(logits, full[:, 10:15], rtol=1e-9, atol=1e-10)
    cache.crop(-3)  # back to 12 tokens, then decode them again
    assert cache.get_seq_length() == 12
    logits = model(ids[:, 12:24], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(logits, full[:, 12:24], rtol=1e-9, atol=1e-10)


def test_decoding_cost_per_token_is_bounded():
    model = decoding_model()
    out = model(torch.randint(2, 37, (1, 40)), use_cache=True)
    for _ in range(3):
        out = model(torch.randint(2, 37, (1, 1)), past_key_values=out.past_key_values, use_cache=True)
    local_layer, lsh_layer = out.past_key_values.layers
    local = model.model.transformer.blocks[0].attn
    index, _ = local.decode_window(local_layer, 1)
    assert index.shape[-1] == (1 + 1) * 4  # a new token reads only its window's keys, whatever the context
    assert local_layer.get_seq_length() == 43 and local_layer.is_croppable  # all are kept, so it can be cropped
    assert lsh_layer.recent.shape[-1] == 4  # a new token reads K keys per round, whatever the context


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


# -- configuration -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("lsh_chunk_length", 0), ("lsh_num_buckets", 5), ("lsh_num_buckets", [4, 3]),
                                         ("lsh_num_hashes", 0), ("lsh_num_hashes_eval", 0), ("lsh_window", "ring"),
                                         ("lsh_hash_seed", -1), ("lsh_full_attention_threshold", -2),
                                         ("lsh_num_chunks_before", -1), ("local_chunk_length", 0),
                                         ("local_num_chunks_after", -1), ("lsh_attention_probs_dropout_prob", 1.0),
                                         ("attention_head_size", 0), ("reversible_merge", "sum")])
def test_bad_reformer_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        config(**{field: value})


def test_concatenated_streams_need_reversible_and_untied_embeddings():
    with pytest.raises(ValueError, match="reversible_merge"):
        config(reversible=False, reversible_merge="concat", tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        config(reversible_merge="concat")
    assert config(reversible_merge="concat", tie_word_embeddings=False).stack_output_size == 2 * HIDDEN


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
    x = torch.randn(1, 11, HIDDEN, dtype=torch.float64)
    replay = {}
    torch.testing.assert_close(attn(x, replay=replay), attn.reference_forward(x, replay=replay), rtol=1e-10,
                               atol=1e-12)


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
        torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=1e-7, atol=1e-10, msg=name)


def test_cache_batch_utilities_keep_decoding_exact():
    # batch_repeat_interleave / batch_select_indices / reorder_cache act on every per-sequence tensor of both cache
    # layer kinds (keys, ring buffers, rotations, bucket lists), so the decoded logits stay those of a full forward.
    model = decoding_model()
    ids = torch.randint(2, 37, (2, 20))
    full = model(ids, use_cache=False).logits
    cache = model(ids[:, :12], use_cache=True).past_key_values
    cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
    cache.reorder_cache(torch.tensor([3, 2, 1, 0]))  # rows 1, 1, 0, 0
    cache.batch_select_indices(torch.tensor([0, 2]))  # rows 1, 0
    logits = model(ids[[1, 0], 12:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(logits, full[[1, 0], 12:], rtol=1e-9, atol=1e-10)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_causal_threshold_is_per_position_in_fast_path_reference_and_decoding():
    # Causal layers give the first `lsh_full_attention_threshold` positions full attention at any length, so
    # decoding that starts below the threshold and grows past it stays equal to the full forward.
    torch.manual_seed(4)
    attn = LSHAttention(config(lsh_full_attention_threshold=5, lsh_num_hashes=2), 0, causal=True).double()
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    replay = {}
    torch.testing.assert_close(attn(x, replay=replay), attn.reference_forward(x, replay=replay), rtol=1e-10,
                               atol=1e-12)
    model = decoding_model(lsh_full_attention_threshold=5)
    ids = torch.randint(2, 37, (2, 16))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :2], use_cache=True)
    steps = [out.logits]
    for t in range(2, 16):
        out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)


# -- CUDA (run where a GPU exists; the CPU tests above cover the same logic) ------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("kind", ["lsh", "local"])
def test_cuda_fast_path_equals_cpu_with_the_same_buckets(kind):
    torch.manual_seed(0)
    cls = LSHAttention if kind == "lsh" else LocalAttention
    attn = cls(config(lsh_num_hashes=3), 0, causal=True).double()
    x = torch.randn(2, 29, HIDDEN, dtype=torch.float64)
    mask = padding_mask(2, 29)
    outputs = []
    replay = {}
    for device in ("cpu", "cuda"):
        attn = attn.to(device)
        xd = x.to(device).requires_grad_()
        step_replay = {k: v.to(device) for k, v in replay.items()}
        out = attn(xd, attention_mask=mask.to(device), replay=step_replay)
        replay = replay or step_replay
        out.pow(2).sum().backward()
        outputs.append([out.detach().cpu(), xd.grad.cpu()] + [p.grad.cpu() for p in attn.parameters()])
        attn.zero_grad()
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@cuda
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_cuda_reversible_backward_with_hashing_replays_buckets_dropout_and_autocast(autocast_dtype):
    torch.manual_seed(0)
    config = lm_config(reversible=True, hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.1,
                       local_attention_probs_dropout_prob=0.1, lsh_hash_seed=None, num_hidden_layers=4,
                       chunk_size_feed_forward=8, max_position_embeddings=256)
    dtype = torch.float64 if autocast_dtype is None else torch.float32
    model = ZooReformerForCausalLM(config).to("cuda", dtype).train()
    ids = torch.randint(2, 37, (2, 150), device="cuda")
    results = []
    for use_reversible_backward in (True, False):
        model.model.transformer.use_reversible_backward = use_reversible_backward
        model.zero_grad()
        torch.manual_seed(7)
        with torch.autocast("cuda", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    tol = dict(rtol=1e-6, atol=1e-9) if autocast_dtype is None else dict(rtol=5e-2, atol=5e-3)
    for name in results[1][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], **tol, msg=name)


@cuda
def test_cuda_cached_decoding_equals_the_full_forward():
    model = decoding_model(max_position_embeddings=64).to("cuda")
    ids = torch.randint(2, 37, (2, 30), device="cuda")
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :11], use_cache=True)
    steps = [out.logits]
    for t in range(11, 30):
        out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)
