"""Learned buckets for separate-QK LSH (`lsh_key_centroids`, attnzoo.convert.lsh_key_centres.fit_lsh_key_centroids):
a key falls in the bucket of its nearest centroid (after its head's centre) in every round and a query probes the
centroids it scores highest, one a round; with them the fast path equals the dense reference (values and gradients),
decoding equals the full forward, the centroids save and load, and the calibration sets them to k-means centroids of
the keys the far part hashes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo.convert.lsh_key_centres import (
    centre_lsh_keys,
    centroid_lsh_parts,
    fit_lsh_key_centroids,
    kmeans,
)
from attnzoo.modeling.attention import build_attention, lsh_window
from attnzoo.modeling.attention.lsh_window import LSHFarPart
from tests.attention.helpers import saved_loaded_and_generating_like_the_full_forward
from tests.attention.test_far_positions import assert_decoding_equals_the_full_forward
from tests.attention.test_lsh_key_centres import config as centred_config
from tests.attention.test_lsh_window import check_against_the_dense_reference


def config(**overrides):
    return centred_config(**{"lsh_key_centroids": True, "lsh_num_buckets": 6, "lsh_num_hashes": 2, **overrides})


def with_random_calibration(model_or_layer, seed=1):
    """Random centres and centroids (a calibration's stand-in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model_or_layer.named_buffers():
            if name.endswith(("lsh_key_centre", "lsh_key_centroids")):
                buffer.copy_(torch.randn(buffer.shape, generator=g, dtype=buffer.dtype))
    return model_or_layer


def test_keys_fall_in_their_nearest_centroids_bucket_and_queries_probe_their_best_centroids():
    torch.manual_seed(0)
    attn = with_random_calibration(build_attention("lsh_window", config(lsh_num_hashes=3), 0, True).eval())
    part = attn.far
    q, k = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    query_buckets, key_buckets = part._centroid_buckets(q, k, valid)
    assert query_buckets.shape == (2, 4, 3, 9) and key_buckets.shape == (2, 2, 3, 9)
    centroids, centre = attn.lsh_key_centroids, attn.lsh_key_centre
    for b in range(2):
        for position in range(9):
            if not valid[b, position]:
                assert (query_buckets[b, :, :, position] == 6).all() and (key_buckets[b, :, :, position] == 6).all()
                continue
            for kv in range(2):
                nearest = ((k[b, kv, position] - centre[kv]) - centroids[kv]).norm(dim=-1).argmin()
                assert (key_buckets[b, kv, :, position] == nearest).all()  # the same bucket every round
            for head in range(4):  # query heads 0, 1 share key-value head 0's centroids; 2, 3 head 1's
                ranked = (centroids[head // 2] @ q[b, head, position]).argsort(descending=True)
                assert query_buckets[b, head, :, position].tolist() == ranked[:3].tolist()
    # a new token alone gets the buckets it gets in the whole sequence
    token_q, token_k = part._hash_token(q[:, :, 4:5], k[:, :, 4:5], None, part.bucket_factors())
    torch.testing.assert_close(token_q, query_buckets[..., 4:5], rtol=0, atol=0)
    torch.testing.assert_close(token_k, key_buckets[..., 4:5], rtol=0, atol=0)


def far_part_with_two_axis_centroids(**overrides):
    """A far part of 2 learned buckets probed one a round, window 2 and no sinks, its centroids e0 and e1 (float64)."""
    attn = build_attention("lsh_window", config(lsh_num_buckets=2, lsh_num_hashes=1, lsh_num_chunks_before=8,
                                               window_size=2, num_sink_tokens=0, **overrides), 0, True).double().eval()
    with torch.no_grad():
        attn.lsh_key_centroids.zero_()
        attn.lsh_key_centroids[:, 0, 0] = 1.0
        attn.lsh_key_centroids[:, 1, 1] = 1.0
    return attn.far


def test_a_query_probes_the_bucket_of_its_content():
    """Keys of two contents along e0 and e1, interleaved; centroids on the two: a query along e0 probing one bucket
    probes the bucket that holds every e0 key and no e1 key."""
    part = far_part_with_two_axis_centroids()
    k = torch.zeros(1, 2, 12, 8, dtype=torch.float64)
    k[..., 0::2, 0], k[..., 1::2, 1] = 1.0, 1.0
    q = torch.zeros(1, 4, 12, 8, dtype=torch.float64)
    q[..., 0] = 1.0
    query_buckets, key_buckets = part._centroid_buckets(q, k, None)
    assert (query_buckets == 0).all() and key_buckets[0, 0, 0].tolist() == [0, 1] * 6


def test_a_query_probes_the_bucket_whose_members_it_scores_highest_once_its_block_counts_them():
    """Centroids e0 and e1; the keys alternate e0 (bucket 0) and e1 + 3 e2 (bucket 1, its members off the centroid);
    the query e0 + e2 / 2 scores centroid 0 higher (1 against 0) but bucket 1's members higher (1.5 against 1).
    With a window of 2 and blocks of 4, queries 0-3 count no key (every bucket its centroid: bucket 0), queries 4-7
    count keys 0-2 (bucket 1's mean (e1 + (e1 + 3 e2)) / 2 scores 0.75: still bucket 0), queries 8-11 keys 0-6
    (bucket 1's (e1 + 3 (e1 + 3 e2)) / 4 scores 1.125: bucket 1). By the centroids, every query probes bucket 0."""
    part = far_part_with_two_axis_centroids(lsh_member_mean_block=4)
    k = torch.zeros(1, 2, 12, 8, dtype=torch.float64)
    k[..., 0::2, 0] = 1.0
    k[..., 1::2, 1], k[..., 1::2, 2] = 1.0, 3.0
    q = torch.zeros(1, 4, 12, 8, dtype=torch.float64)
    q[..., 0], q[..., 2] = 1.0, 0.5
    query_buckets, key_buckets = part._centroid_buckets(q, k, None)
    assert key_buckets[0, 0, 0].tolist() == [0, 1] * 6
    assert (query_buckets[0, :, 0] == torch.tensor([0] * 8 + [1] * 4)).all()
    positions = torch.arange(12)[None]
    torch.testing.assert_close(part._reference_member_probes(q, k, torch.ones(1, 12, dtype=torch.bool), positions),
                               query_buckets, rtol=0, atol=0)
    part.member_mean_block = None
    assert (part._centroid_buckets(q, k, None)[0] == 0).all()


def test_ranking_by_the_members_log_mass_prefers_a_full_bucket_to_a_slightly_better_single_key():
    """Centroids e0 and e1 (head_dim 8, scores scaled by 1/√8); key 0 is 2 e0 (bucket 0), every later key e1 (bucket
    1); the query √8 (e0 + 0.8 e1). With a window of 2 and blocks of 4, by the mean bucket 0 always wins ((e0 + 2 e0) /
    2 scores 1.5 against 0.8, after the centroids' 1 against 0.8). By the log mass, queries 0-3 count no key (1 + log
    1 against 0.8), queries 4-7 count keys 0-2 (1.5 + log 2 = 2.19 against 0.8 + log 3 = 1.90: bucket 0), queries 8-
    23 count keys 0-6 or more (0.8 + log 7 = 2.75 at least: bucket 1), as an exact softmax would weigh them."""
    k = torch.zeros(1, 2, 24, 8, dtype=torch.float64)
    k[..., 0, 0], k[..., 1:, 1] = 2.0, 1.0
    q = torch.zeros(1, 4, 24, 8, dtype=torch.float64)
    q[..., 0], q[..., 1] = 8 ** 0.5, 0.8 * 8 ** 0.5
    valid, positions = torch.ones(1, 24, dtype=torch.bool), torch.arange(24)[None]
    expected = {"mean": [0] * 24, "log_mass": [0] * 8 + [1] * 16}
    for score, probes in expected.items():
        part = far_part_with_two_axis_centroids(lsh_member_mean_block=4, lsh_member_score=score)
        query_buckets, key_buckets = part._centroid_buckets(q, k, None)
        assert key_buckets[0, 0, 0].tolist() == [0] + [1] * 23
        assert (query_buckets[0, :, 0] == torch.tensor(probes)).all(), score
        torch.testing.assert_close(part._reference_member_probes(q, k, valid, positions), query_buckets, rtol=0,
                                   atol=0)


def test_the_log_mass_is_a_lower_bound_on_the_members_log_sum_exp():
    """q·m / √d + log(1 + n) <= log Σ exp(q·x / √d) over the centroid and the n keys (Jensen), with equality when
    they all score alike."""
    part = far_part_with_two_axis_centroids(lsh_member_mean_block=4, lsh_member_score="log_mass")
    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 5, 40):
        members = torch.randn(n + 1, 8, generator=g, dtype=torch.float64)  # the centroid first
        q = torch.randn(8, generator=g, dtype=torch.float64)
        bound = part._member_scores(q @ members.mean(0), torch.tensor(float(n), dtype=torch.float64))
        assert bound <= torch.logsumexp(members @ q / 8 ** 0.5, 0) + 1e-12
    same = torch.ones(6, 8, dtype=torch.float64)
    torch.testing.assert_close(part._member_scores(q @ same.mean(0), torch.tensor(5.0, dtype=torch.float64)),
                               torch.logsumexp(same @ q / 8 ** 0.5, 0))


@pytest.mark.parametrize("window, sinks, probes", [(4, 2, 2), (1, 0, 1), (15, 4, 6)])
def test_the_fast_path_equals_the_dense_reference_with_learned_buckets(window, sinks, probes):
    torch.manual_seed(0)
    attn = with_random_calibration(build_attention(
        "lsh_window", config(window_size=window, num_sink_tokens=sinks, lsh_num_hashes=probes), 0, True
    ).double().eval())
    assert attn.lsh_key_centroids.abs().min() > 0
    check_against_the_dense_reference(attn)


@pytest.mark.parametrize("window, sinks, probes, block, pieces, score", [
    (4, 2, 2, 3, False, "mean"), (1, 0, 1, 1, False, "mean"), (15, 4, 3, 5, False, "mean"),
    (4, 2, 2, 64, False, "mean"), (4, 2, 2, 3, True, "mean"), (1, 0, 3, 1, True, "mean"),
    (4, 2, 2, 3, False, "log_mass"), (15, 4, 3, 5, False, "log_mass"), (1, 0, 3, 1, True, "log_mass")])
def test_the_fast_path_equals_the_dense_reference_probing_by_the_members_mean(window, sinks, probes, block, pieces,
                                                                            score, monkeypatch):
    """Blocks shorter than the window and longer than the sequence (every bucket then its centroid); with `pieces`
    the sums and scores bounded to one block and one query row at a time (a running sum across the pieces)."""
    if pieces:
        monkeypatch.setattr(lsh_window, "MEMBER_SUMS", 1)
        monkeypatch.setattr(lsh_window, "CENTROID_SCORES", 1)
    torch.manual_seed(0)
    attn = with_random_calibration(build_attention(
        "lsh_window", config(window_size=window, num_sink_tokens=sinks, lsh_num_hashes=probes,
                             lsh_member_mean_block=block, lsh_member_score=score), 0, True
    ).double().eval())
    check_against_the_dense_reference(attn)


@pytest.mark.parametrize("far_kv_heads, block, score", [(None, None, "mean"), ([[1]], None, "mean"),
                                                       (None, 4, "mean"), ([[1]], 3, "mean"), (None, 3, "log_mass")])
def test_decoding_with_learned_buckets_equals_the_full_forward(far_kv_heads, block, score):
    torch.manual_seed(0)
    model = with_random_calibration(AutoModelForCausalLM.from_config(config(
        far_kv_heads=far_kv_heads, lsh_member_mean_block=block, lsh_member_score=score)).double().eval())
    centroids = [b for n, b in model.named_buffers() if n.endswith("lsh_key_centroids")]
    assert len(centroids) == 2 and all(c.shape == (2 if far_kv_heads is None else 1, 6, 8) for c in centroids)
    torch.manual_seed(1)
    cache = assert_decoding_equals_the_full_forward(model, length=26, prefill=7, padding=3)
    assert all("far.lsh_sorted" in layer.state for layer in cache.layers)
    assert not any("far.lsh_rotations" in layer.state for layer in cache.layers)  # learned buckets draw none
    kv_heads = 2 if far_kv_heads is None else 1
    for layer in cache.layers:
        # a key's bucket is the same in every round: one index of the prefill's keys and one of the decoded tokens'
        # buckets serve both rounds
        assert layer.state["far.lsh_sorted"].shape == (2, kv_heads, 7)
        assert layer.state["far.lsh_new_buckets"].shape[:2] == (2, kv_heads)
        # the members' sums and counts: a bucket each, whatever the length
        kept = {name: layer.state[f"far.lsh_{name}_sums"].shape for name in ("member", "pending")
                if f"far.lsh_{name}_sums" in layer.state}
        assert kept == ({} if block is None else {"member": (2, kv_heads, 6, 8), "pending": (2, kv_heads, 6, 8)})


def test_the_centroids_save_load_and_generate_like_the_full_forward(tmp_path):
    torch.manual_seed(0)
    model = with_random_calibration(AutoModelForCausalLM.from_config(config()).eval())
    loaded = saved_loaded_and_generating_like_the_full_forward(model, tmp_path, 37, new_tokens=12)
    assert loaded.config.lsh_key_centroids is True
    for (name, saved), (_, got) in zip(model.named_buffers(), loaded.named_buffers(), strict=True):
        torch.testing.assert_close(got, saved, rtol=0, atol=0, msg=name)


def test_kmeans_starts_from_evenly_spaced_points_and_separates_clear_groups():
    points = torch.cat([torch.randn(30, 2, generator=torch.Generator().manual_seed(0)) * 0.1 + c
                        for c in (torch.tensor([5.0, 0.0]), torch.tensor([-5.0, 0.0]), torch.tensor([0.0, 5.0]))])
    start = kmeans(points, 3, iterations=0)
    torch.testing.assert_close(start, points[[0, 44, 89]], rtol=0, atol=0)  # round(linspace(0, 89, 3))
    fitted = kmeans(points, 3)
    for group in range(3):
        torch.testing.assert_close(fitted[group], points[30 * group:30 * (group + 1)].mean(0))


def test_calibration_fits_the_centroids_to_the_real_keys_it_hashes_minus_their_centre(monkeypatch):
    """Over a left-padded batch, after centre_lsh_keys: each far part's centroids are kmeans of the real keys it hashed
    in the calibration's forward (the centroids at zero in it), minus its centre, per key-value head; the model is
    left in its mode, and fitting twice gives the same centroids."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).double().train()
    ids = torch.randint(1, 37, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    centre_lsh_keys(model, ids, attention_mask=mask)
    seen = {}
    keys_to_hash = LSHFarPart._keys_to_hash

    def watched(self, k, valid):
        hashed = keys_to_hash(self, k, valid)
        if self.key_capture is not None:
            assert self.layer.lsh_key_centroids.abs().max() == 0
            seen[self.layer_idx] = torch.cat([hashed[b][:, valid[b]] for b in range(k.shape[0])], dim=1)
        return hashed

    monkeypatch.setattr(LSHFarPart, "_keys_to_hash", watched)
    fitted = fit_lsh_key_centroids(model, ids, attention_mask=mask)
    assert model.training and sorted(fitted) == sorted(seen) == [0, 1]
    for index, keys in seen.items():
        assert keys.shape == (2, 20 + 14, 8)
        expected = torch.stack([kmeans(head.float(), 6) for head in keys])
        torch.testing.assert_close(fitted[index], expected)
        torch.testing.assert_close(model.model.transformer.blocks[index].attn.lsh_key_centroids,
                                   expected.double())
    monkeypatch.setattr(LSHFarPart, "_keys_to_hash", keys_to_hash)
    again = fit_lsh_key_centroids(model, ids, attention_mask=mask)
    for index in fitted:
        torch.testing.assert_close(again[index], fitted[index], rtol=0, atol=0)
    assert all(part.key_capture is None for part in centroid_lsh_parts(model).values())


def test_bad_settings_and_models_without_centroids_are_refused():
    with pytest.raises(ValueError, match="lsh_key_centroids.*lsh_centre_keys=True"):
        config(lsh_centre_keys=False)
    with pytest.raises(ValueError, match="lsh_num_buckets"):
        config(lsh_num_buckets=[2, 4])
    with pytest.raises(ValueError, match="lsh_num_hashes"):
        config(lsh_num_hashes=7)
    with pytest.raises(ValueError, match="lsh_num_hashes"):
        config(lsh_num_hashes_eval=8)
    with pytest.raises(ValueError, match="lsh_member_mean_block=0 .*positive number of tokens"):
        config(lsh_member_mean_block=0)
    with pytest.raises(ValueError, match="lsh_member_mean_block=8 .*lsh_key_centroids=True"):
        config(lsh_key_centroids=False, lsh_member_mean_block=8)
    with pytest.raises(ValueError, match="lsh_member_score='mass' .*use one of \\('mean', 'log_mass'\\)"):
        config(lsh_member_mean_block=8, lsh_member_score="mass")
    with pytest.raises(ValueError, match="lsh_member_score='log_mass' .*set lsh_member_mean_block too"):
        config(lsh_member_score="log_mass")
    with pytest.raises(ValueError, match="lsh_key_centroids=True"):
        fit_lsh_key_centroids(AutoModelForCausalLM.from_config(config(lsh_key_centroids=False)).eval(),
                              torch.randint(1, 37, (1, 10)))
    model = AutoModelForCausalLM.from_config(config()).eval()
    with pytest.raises(ValueError, match="fewer than the 6 centroids"):
        fit_lsh_key_centroids(model, torch.randint(1, 37, (1, 5)))
    with pytest.raises(ValueError, match="input_ids"):
        fit_lsh_key_centroids(model, torch.randint(1, 37, (10,)))
    with pytest.raises(ValueError, match="iterations"):
        fit_lsh_key_centroids(model, torch.randint(1, 37, (1, 10)), iterations=-1)


def test_a_checkpoint_without_centroids_loads_with_them_at_zero_and_reports_nothing_missing(tmp_path):
    torch.manual_seed(0)
    centred = AutoModelForCausalLM.from_config(centred_config()).eval()
    centred.save_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, lsh_key_centroids=True, lsh_num_buckets=6,
                                                       output_loading_info=True)
    assert not info["missing_keys"]
    assert [b.abs().max().item() for n, b in model.named_buffers() if n.endswith("lsh_key_centroids")] == [0.0, 0.0]


def test_a_failed_fit_keeps_the_centroids_it_had():
    torch.manual_seed(0)
    model = with_random_calibration(AutoModelForCausalLM.from_config(config()).eval())
    before = {n: b.clone() for n, b in model.named_buffers() if n.endswith("lsh_key_centroids")}
    with pytest.raises(ValueError):  # a mask of another length: the forward refuses it
        fit_lsh_key_centroids(model, torch.randint(1, 37, (1, 12)), attention_mask=torch.ones(1, 12, 1,
                                                                                            dtype=torch.long))
    for name, buffer in model.named_buffers():
        if name in before:
            torch.testing.assert_close(buffer, before[name], rtol=0, atol=0)
    assert all(part.key_capture is None for part in centroid_lsh_parts(model).values())


@pytest.mark.parametrize("block, window, sinks, prefill, far_kv_heads, eval_probes, score", [
    (1, 4, 2, 3, None, None, "mean"),  # a block a token: the sums change at every step
    (40, 4, 0, 8, [[1]], 3, "mean"),  # blocks past the text: every bucket its centroid; more probes in evaluation
    (3, 1, 2, 1, None, 3, "mean"),  # a prefill shorter than the window and sinks
    (4, 4, 2, 12, [[1]], None, "mean"),  # a prefill of whole blocks
    (2, 4, 2, 5, None, None, "log_mass"),  # the counts change every other step
])
def test_each_decoding_step_probes_the_buckets_the_full_forward_probes(block, window, sinks, prefill, far_kv_heads,
                                                                      eval_probes, score, monkeypatch):
    """The probes themselves, step by step, for rows of three lengths (one all padding through the prefill): each
    real token's buckets in decoding are the full forward's at its position, and so are the logits."""
    from attnzoo.transformers_compat import output_cache

    full_probes, step_probes = [], []
    centroid_buckets, member_token = LSHFarPart._centroid_buckets, LSHFarPart._member_token

    def recorded_full(self, q, k, valid):
        out = centroid_buckets(self, q, k, valid)
        full_probes.append(out[0])
        return out

    def recorded_step(self, stored, q, k, x):
        out = member_token(self, stored, q, k, x)
        step_probes.append((out[0], x.valid[:, 0].clone(), x.position[:, 0].clone()))
        return out

    monkeypatch.setattr(LSHFarPart, "_centroid_buckets", recorded_full)
    monkeypatch.setattr(LSHFarPart, "_member_token", recorded_step)
    torch.manual_seed(0)
    model = with_random_calibration(AutoModelForCausalLM.from_config(config(
        window_size=window, num_sink_tokens=sinks, lsh_num_buckets=8, lsh_num_hashes=2,
        lsh_num_hashes_eval=eval_probes, lsh_member_mean_block=block, lsh_member_score=score,
        far_kv_heads=far_kv_heads,
        max_position_embeddings=64)).double().eval())
    length = 30
    ids = torch.randint(1, 37, (3, length))
    mask = torch.ones_like(ids)
    mask[1, :5], mask[2, :prefill + 2] = 0, 0
    with torch.no_grad():
        full_logits = model(ids, attention_mask=mask).logits
        layers = len(full_probes)
        out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
        logits = [out.logits]
        for t in range(prefill, length):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
            logits.append(out.logits)
    full_probes = full_probes[:layers]
    assert layers == 2 and len(step_probes) == layers * (length - prefill)
    compared = 0
    for step, (probes, real, position) in enumerate(step_probes):
        for row in range(3):
            if real[row]:
                torch.testing.assert_close(probes[row, :, :, 0], full_probes[step % layers][row, :, :, position[row]],
                                           rtol=0, atol=0)
                compared += 1
    assert compared == layers * int(mask[:, prefill:].sum())  # every real decoded token, in every layer
    real = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[real], full_logits[real], rtol=1e-9, atol=1e-10)
