"""LSH with an exact window inside the layer ("lsh_window"): the chunked parallel form against the dense reference
(values and gradients, left padding, both LSH windows, with and without the duplicate correction), exact shared-QK
attention where the window covers everything, the far part adding exactly the keys LSH lists beyond the window (and
retrieving a far copy of the query), decoding from LSH's own cache equal to the full forward, the reversible
backward, and save/load/generate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo import ZooHybridConfig, ZooReformerForCausalLM
from attnzoo.modeling.attention import Recomputation, build_attention
from attnzoo.modeling.attention.lsh import LSHAttention, LSHBuckets
from attnzoo.modeling.attention.lsh_hashing import hash_buckets, inverse_permutation, normalize_keys, sort_by_bucket
from attnzoo.modeling.attention.lsh_window import WindowedLSHAttention
from attnzoo.modeling.attention.window import left_align, restore_order
from attnzoo.modeling.attention.windowed import FAR_STATE
from attnzoo.modeling.cache import RecurrentStateLayer, ZooCache, spare_tokens
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import (
    assert_same_values_and_gradients,
    lm_config,
    named,
    saved_loaded_and_generating_like_the_full_forward,
)

LENGTH = 23


def config(**overrides):
    """Chunks of 4 over 4 buckets and 2 hash rounds: a sequence of 23 tokens spans several sorted chunks, so
    buckets decide which far keys a query sees. Rotary positions and grouped values (2 value heads for 4 heads)."""
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
                  position_embedding_type="rotary", attn_layers=["lsh_window"], is_decoder=True, vocab_size=37,
                  num_hidden_layers=2, intermediate_size=48, hidden_dropout_prob=0.0, pad_token_id=0,
                  max_position_embeddings=64, lsh_chunk_length=4, lsh_num_buckets=4, lsh_num_hashes=2,
                  lsh_attention_probs_dropout_prob=0.0, eval_seed=0)
    values.update(overrides)
    return ZooHybridConfig(**values)


def layer(**overrides):
    torch.manual_seed(0)
    return build_attention("lsh_window", config(**overrides), 0, True).double().eval()


def left_padded(batch=2, length=LENGTH, padding=5):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, :padding] = False
    return mask, (mask.long().cumsum(-1) - 1).clamp(min=0)


def candidates_beyond_the_window(attn, buckets, mask):
    """[B, H, L] whether LSH lists a far key for the query in some round ("bucket" window: a key of its bucket at
    most K sorted slots before it; far: real, not a sink, at least W real positions before it), from the buckets the
    forward saved (rows left-aligned), read back in the tokens' own order."""
    buckets = restore_order(buckets.transpose(2, 3), left_align(mask)).transpose(2, 3)
    slots = inverse_permutation(sort_by_bucket(buckets))
    slot_gap = slots[..., None, :] - slots[..., :, None]
    listed = ((buckets[..., None, :] == buckets[..., :, None]) & (slot_gap >= -attn.far.recent_size)
              & (slot_gap <= 0)).any(dim=2)
    position = mask.long().cumsum(-1) - 1
    far = ((position[:, :, None] - position[:, None, :] >= attn.window_size) & (position[:, None, :] >= attn.sinks)
           & mask[:, None, :] & mask[:, :, None])
    return (listed & far[:, None]).any(-1)


def window_and_sinks_only(attn, x, mask, positions):
    """The layer without its far part: shared-QK softmax over the window and the sinks, own key penalised."""
    qk, _, v, _, _, _ = attn._views(x, positions, 0)
    v = attn.expand_kv(v)
    position = mask.long().cumsum(-1) - 1
    gap = position[:, :, None] - position[:, None, :]
    earlier = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None] & mask[:, None, :]
    near = earlier & ((gap < attn.window_size) | (position[:, None, :] < attn.sinks))
    scores = (qk @ normalize_keys(qk).transpose(-1, -2)).masked_fill(~near[:, None], float("-inf"))
    scores = scores.masked_fill(torch.eye(x.shape[1], dtype=torch.bool), -1e5)
    return attn.output(attn.merge_heads(scores.softmax(-1) @ v))


@pytest.mark.parametrize("window, sinks, lsh_window, correction", [
    (4, 2, "bucket", True), (4, 2, "bucket", False), (3, 0, "chunk", True), (5, 7, "bucket", True),
    (5, 7, "chunk", False), (1, 0, "bucket", True), (1, 0, "chunk", True), (64, 4, "bucket", True)])
def test_parallel_form_equals_dense_reference_with_padding(window, sinks, lsh_window, correction):
    check_against_the_dense_reference(layer(window_size=window, num_sink_tokens=sinks, lsh_attend_to=lsh_window,
                                            lsh_duplicate_correction=correction))


def check_against_the_dense_reference(attn):
    """Values and gradients of the fast path equal the dense reference's on a left-padded batch, and the padded row
    gives its real tokens what the row alone gives them."""
    x = torch.randn(2, LENGTH, 32, dtype=torch.float64, requires_grad=True)
    mask, positions = left_padded()
    fast = attn(x, attention_mask=mask, position_ids=positions)
    reference = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    assert_same_values_and_gradients(attn, x, mask, fast, reference)
    # a left-padded row gives its real tokens what the row alone gives them
    alone = attn(x[1:, 5:], position_ids=positions[1:, 5:])
    torch.testing.assert_close(fast[1, 5:], alone[0], rtol=1e-10, atol=1e-12)


def test_training_forward_with_fresh_rotations_equals_the_reference_on_the_same_buckets():
    attn = layer(lsh_hash_seed=None).train()  # rotations from the global RNG, one set per example
    x = torch.randn(2, LENGTH, 32, dtype=torch.float64, requires_grad=True)
    mask, positions = left_padded()
    record = Recomputation()
    fast = attn(x, attention_mask=mask, position_ids=positions, recompute=record)
    record.replaying = True  # the reference reads the buckets the forward saved, as a reversible backward does
    reference = attn.reference_forward(x, attention_mask=mask, position_ids=positions, recompute=record)
    assert record.saved["buckets"].shape == (2, 4, 2, LENGTH)
    assert_same_values_and_gradients(attn, x, mask, fast, reference)


@pytest.mark.parametrize("shared_qk", [True, False])
def test_window_covering_everything_is_exact_attention_with_the_same_weights(shared_qk):
    """Shared QK: LSH's full shared-QK path; separate queries and keys: exact softmax, as the source computes."""
    covering = layer(window_size=32, num_sink_tokens=0, lsh_shared_qk=shared_qk)
    full = LSHAttention(config(lsh_full_attention_threshold=32), 0, True).double() if shared_qk else \
        build_attention("full", config(), 0, True).double().eval()
    full.load_state_dict(covering.state_dict())
    x = torch.randn(2, LENGTH, 32, dtype=torch.float64)
    mask, positions = left_padded()
    got = covering(x, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(got[mask], full(x, attention_mask=mask, position_ids=positions)[mask], rtol=1e-10,
                               atol=1e-12)


def test_far_part_adds_exactly_the_keys_lsh_lists_beyond_the_window():
    attn = layer()
    x = torch.randn(2, LENGTH, 32, dtype=torch.float64)
    mask, positions = left_padded()
    record = Recomputation()
    got = attn(x, attention_mask=mask, position_ids=positions, recompute=record)
    without_far = window_and_sinks_only(attn, x, mask, positions)
    has_far = candidates_beyond_the_window(attn, record.saved["buckets"], mask).any(1)  # [B, L], any head
    assert 10 < has_far.sum() < mask.sum()  # both kinds of positions occur
    quiet = mask & ~has_far
    torch.testing.assert_close(got[quiet], without_far[quiet], rtol=1e-10, atol=1e-12)
    assert ((got - without_far).abs().amax(-1)[has_far] > 1e-6).all()
    # With no look-back in the sorted order LSH lists no key but the query's own: the window and sinks alone.
    blind = layer(lsh_num_chunks_before=0)
    got = blind(x, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(got[mask], window_and_sinks_only(blind, x, mask, positions)[mask], rtol=1e-10,
                               atol=1e-12)


def test_a_far_copy_of_the_query_is_retrieved_from_beyond_the_window():
    # Passkey-style recall: token 40 repeats token 5 (no rotary positions, so their shared-QK vectors are equal and
    # hash to the same bucket in every round). The far part finds it and, its score |q| being far above the
    # others', gives it nearly all the weight; the window and sinks alone cannot see it.
    attn = layer(position_embedding_type="learned", num_sink_tokens=1, lsh_num_buckets=8, lsh_num_chunks_before=2)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 48, 32, dtype=torch.float64, generator=generator)
    x[0, 40] = x[0, 5] = 400 * torch.randn(32, dtype=torch.float64, generator=generator)
    _, _, v, _, _, _ = attn._views(x, None, 0)
    v = attn.expand_kv(v)
    recalled = attn.output(attn.merge_heads(v[:, :, 5:6]))[0, 0]
    mask = torch.ones(1, 48, dtype=torch.bool)
    got = attn(x)[0, 40]
    torch.testing.assert_close(got, recalled, rtol=0, atol=1e-6)
    assert (window_and_sinks_only(attn, x, mask, None)[0, 40] - recalled).abs().max() > 0.1


@pytest.mark.parametrize("prefill", [6, 16])
@pytest.mark.parametrize("settings", [{"lsh_duplicate_correction": True}, {"lsh_duplicate_correction": False},
                                      {"lsh_shared_qk": False}, {"lsh_shared_qk": False, "lsh_hash_seed": 5},
                                      {"lsh_shared_qk": False, "lsh_group_rotations": True}])
def test_decoding_keeps_each_key_once_and_equals_the_full_forward(settings, prefill):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(**settings)).double().eval()
    ids = torch.randint(1, 37, (2, 30))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    full = model(ids, attention_mask=mask).logits
    out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    steps = [out.logits]
    ring = {"ring_k", "ring_v", "ring_pos", "count"}
    window = model.config.window_size
    key_heads = 4 if settings.get("lsh_shared_qk", True) else 2  # shared QK: one key per query head
    hashed_heads = 2 if settings.get("lsh_group_rotations") else 4  # grouped rotations: keys hashed per key head
    for t in range(prefill, 24):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
        steps.append(out.logits)
        slot = output_cache(out).layers[0]
        # The window's ring, and LSH's far state: the prefill's keys as a bucket index (positions in (bucket,
        # position) order, and where each bucket's run starts), the buckets and positions of the tokens decoded
        # since, and the keys and values that have left the window (the ring holds the others), each kept once.
        # Evaluation rotations are drawn again from the seed at every step; per-example ones (lsh_hash_seed) are kept.
        kept = {"lsh_sorted", "lsh_starts", "lsh_new_buckets", "lsh_new_positions", "lsh_keys", "lsh_values"} | (
            {"lsh_rotations"} if "lsh_hash_seed" in settings else set())
        kept = {FAR_STATE + name for name in kept}  # the far part's entries, beside the ring's
        assert type(slot) is RecurrentStateLayer and set(slot.state) == ring | kept
        assert slot.state["count"].tolist() == mask[:, :t + 1].sum(-1).tolist()
        far = {name: slot.state[FAR_STATE + name] for name in kept_names(kept)}
        assert far["lsh_sorted"].shape == (2, hashed_heads * 2, prefill) and far["lsh_sorted"].dtype == torch.int16
        starts = far["lsh_starts"].long()  # a run per bucket and the padding bucket's: 0 first, every key by the end
        assert starts.shape[:2] == (2, hashed_heads * 2) and (starts.diff() >= 0).all()
        assert (starts[..., 0] == 0).all() and (starts[..., -1] == prefill).all()
        # each round's index lists every prefill position once
        listed = far["lsh_sorted"].sort(-1).values.long()
        assert torch.equal(listed, torch.arange(prefill).expand(2, hashed_heads * 2, -1))
        assert far["lsh_new_buckets"].shape[:2] == (2, hashed_heads * 2)
        assert far["lsh_new_buckets"].dtype == torch.int16
        assert far["lsh_keys"].shape[::3] == (2, 8) and far["lsh_keys"].shape[1] == key_heads
        assert far["lsh_values"].shape[:2] == (2, 2)  # key/value heads, not repeated
        decoded = t + 1 - prefill
        assert far["lsh_new_positions"][:, 0, :decoded].tolist() == [
            list(range(prefill, t + 1)), list(range(prefill - 3, t - 2))]
        for name, held in (("lsh_new_buckets", decoded), ("lsh_new_positions", decoded),
                           ("lsh_keys", t + 1 - window), ("lsh_values", t + 1 - window)):
            assert held <= far[name].shape[2] <= held + spare_tokens(held), (name, t)
    cache = output_cache(out)
    steps.append(model(ids[:, 24:], attention_mask=mask, cache=cache, use_cache=True).logits)  # 6 tokens at once
    real = mask.bool()[..., None]
    torch.testing.assert_close(torch.cat(steps, 1) * real, full * real, rtol=1e-9, atol=1e-10)


def kept_names(entries):
    return [name[len(FAR_STATE):] for name in entries]


@pytest.mark.parametrize("tokens", [1024, 4096, 16384])
def test_the_decoding_state_is_no_larger_than_a_kv_cache(tokens):
    """Each token's key and value kept once, the bucket index as 2-byte positions, nothing per bucket: after a prefill
    of 1K-16K tokens and a step, an LSH layer (separate queries and keys, 2 key/value heads for 4 query heads, as a
    Llama converts) holds at most 1.05x what the same layer's exact attention keeps in its KV cache."""
    torch.manual_seed(0)
    settings = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, attention_head_size=None,
                    window_size=32, num_sink_tokens=4, lsh_chunk_length=32, lsh_num_buckets=None,
                    max_position_embeddings=4096, lsh_num_hashes=2, position_embedding_type="rotary")
    lsh = build_attention("lsh_window", config(lsh_shared_qk=False, **settings), 0, True).eval()
    exact = build_attention("full", config(**settings), 0, True).eval()
    x = torch.randn(1, tokens + 1, 128)
    positions = torch.arange(tokens + 1)[None]
    sizes = {}
    for name, attn in (("lsh", lsh), ("exact", exact)):
        cache = ZooCache([attn.new_cache_layer()])
        with torch.no_grad():
            attn(x[:, :tokens], cache=cache, position_ids=positions[:, :tokens])
            attn(x[:, tokens:], cache=cache, position_ids=positions[:, tokens:])
        sizes[name] = sum(t.numel() * t.element_size() for t in tensors_of(vars(cache.layers[0])))
    assert sizes["lsh"] <= 1.05 * sizes["exact"], sizes


def tensors_of(value):
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    return [t for v in value for t in tensors_of(v)] if isinstance(value, list | tuple) else []


def test_reversible_backward_reuses_buckets_and_equals_plain_autograd(monkeypatch):
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(attn_layers=["local", "lsh_window"], reversible=True, window_size=3,
                                             num_sink_tokens=1, lsh_hash_seed=None, num_hidden_layers=4,
                                             hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.2))
    model = model.double().train()
    windowed_layers = [m for m in model.modules() if isinstance(m, WindowedLSHAttention)]
    hash_calls = []
    real_hash = LSHBuckets.hash_vectors  # the far part's hashing, as the "lsh" attention's (`self` is the far part)
    monkeypatch.setattr(LSHBuckets, "hash_vectors",
                        lambda self, *a: hash_calls.append(self.layer) or real_hash(self, *a))
    ids = torch.randint(2, 37, (2, 14))
    results = []
    for use_reversible_backward in (True, False):
        model.model.transformer.use_reversible_backward = use_reversible_backward
        model.zero_grad()
        hash_calls.clear()
        torch.manual_seed(123)  # the same rotations and dropout masks (window and far part) in both runs
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        # each layer hashed once: the reversible recomputation read the buckets its forward saved
        assert sorted(map(id, hash_calls)) == sorted(map(id, windowed_layers))
    (loss_rev, grads_rev), (loss_ref, grads_ref) = results
    torch.testing.assert_close(loss_rev, loss_ref, rtol=0, atol=1e-12)
    for name in grads_ref:
        torch.testing.assert_close(grads_rev[name], grads_ref[name], rtol=1e-7, atol=1e-10, msg=named(name))


def test_saves_loads_and_generates_like_the_full_forward(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).eval()
    saved_loaded_and_generating_like_the_full_forward(model, tmp_path, 37, new_tokens=14)


def test_encoder_layers_are_refused():
    with pytest.raises(ValueError, match="lsh_window"):
        build_attention("lsh_window", config(), 0, False)


# -- separate queries and keys (lsh_shared_qk=False) ---------------------------------------------------------------
@pytest.mark.parametrize("block", [1, 3, 32])  # one query a block; blocks that do not divide the length; the layer's
# (the last two: a window and sinks that leave a few queries far keys, and a window longer than the sequence)
@pytest.mark.parametrize("window, sinks, correction, hashes", [(4, 2, True, 2), (4, 2, False, 2), (1, 0, True, 3),
                                                               (5, 7, True, 1), (3, 0, True, 2), (15, 4, True, 2),
                                                               (30, 2, True, 2)])
def test_separate_queries_and_keys_equal_the_dense_reference_with_padding(window, sinks, correction, hashes, block,
                                                                          monkeypatch):
    """The sorted blocks (queries laid out by where their candidates end among the sorted keys, each block scoring
    its span of K + block keys) give the reference's values and gradients, whatever the block size."""
    import attnzoo.modeling.attention.lsh_window as lsh_window

    monkeypatch.setattr(lsh_window, "SORTED_BLOCK", block)
    attn = layer(window_size=window, num_sink_tokens=sinks, lsh_duplicate_correction=correction, lsh_shared_qk=False,
                 lsh_num_hashes=hashes)
    assert [name for name, _ in attn.named_children()] == ["rotary", "q_proj", "k_proj", "v_proj", "o_proj"]
    check_against_the_dense_reference(attn)


@pytest.mark.parametrize("pairs", [1, 700])  # one block per group; groups that do not divide the blocks
def test_separate_queries_and_keys_in_groups_of_blocks_equal_the_dense_reference(pairs, monkeypatch):
    """Long prompts score a group of blocks at a time (a memory bound); any group size gives the values and gradients
    of the reference."""
    import attnzoo.modeling.attention.lsh_window as lsh_window

    monkeypatch.setattr(lsh_window, "FAR_BLOCK_PAIRS", pairs)
    monkeypatch.setattr(lsh_window, "SORTED_BLOCK", 4)
    check_against_the_dense_reference(layer(window_size=4, num_sink_tokens=2, lsh_shared_qk=False, lsh_num_hashes=3))


def test_chunk_windows_need_shared_queries_and_keys():
    # plain "lsh" layers take separate ones too: tests/attention/test_lsh_separate_qk.py
    assert build_attention("lsh", config(lsh_shared_qk=False), 0, True).name == "lsh"
    with pytest.raises(ValueError, match=r"lsh_attend_to='chunk' is invalid.*set lsh_attend_to='bucket'"):
        config(lsh_shared_qk=False, lsh_attend_to="chunk")


def test_separate_queries_and_keys_train_in_a_reversible_stack_like_plain_autograd():
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(attn_layers=["local", "lsh_window"], reversible=True, window_size=3,
                                             num_sink_tokens=1, lsh_hash_seed=None, lsh_shared_qk=False,
                                             num_hidden_layers=4, hidden_dropout_prob=0.1))
    model = model.double().train()
    ids = torch.randint(2, 37, (2, 14))
    results = []
    for use_reversible_backward in (True, False):
        model.model.transformer.use_reversible_backward = use_reversible_backward
        model.zero_grad()
        torch.manual_seed(123)  # the same rotations and dropout masks in both runs
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], rtol=1e-9, atol=1e-11, msg=named(name))


def test_grouped_rotations_hash_each_key_once_for_its_group():
    """With `lsh_group_rotations` a key-value group's query heads hash with its first head's rotations: keys are
    hashed once per key-value head (2 here), each query head's key buckets are its group's, and its query buckets
    are what its own query gets under those rotations. The layer's parallel form still equals its reference, and
    shared QK (keys per query head) refuses the setting."""
    attn = layer(lsh_shared_qk=False, lsh_group_rotations=True)
    x = torch.randn(2, LENGTH, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q, k, _, _, _, _ = attn._views(x, None, 0)
    far = attn.far
    query_buckets, key_buckets, rotations = far._buckets(q, k, None, None)
    assert key_buckets.shape[1] == 2 and query_buckets.shape[1] == 4
    factors = far.bucket_factors()
    for head in range(4):
        group_rotations = rotations[:, [head // 2 * 2]]
        torch.testing.assert_close(query_buckets[:, [head]], hash_buckets(q[:, [head]], group_rotations, factors),
                                   rtol=0, atol=0)
        torch.testing.assert_close(far._per_query_head(key_buckets)[:, [head]],
                                   hash_buckets(k[:, [head // 2]], group_rotations, factors), rtol=0, atol=0)
    # the setting changes the buckets: without it the second query head of a group hashes with its own rotations
    ungrouped, _, _ = layer(lsh_shared_qk=False).far._buckets(q, k, None, None)
    assert not torch.equal(ungrouped[:, 1::2], query_buckets[:, 1::2])
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    torch.testing.assert_close(attn(x), attn.reference_forward(x, mask), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="lsh_group_rotations"):
        config(lsh_group_rotations=True)
    with pytest.raises(ValueError, match="lsh_group_rotations"):
        config(lsh_shared_qk=False, lsh_group_rotations="yes")
