"""Centred keys for separate-QK LSH (`lsh_centre_keys`, attnzoo.convert.lsh_key_centres): keys that share a common
direction crowd a few buckets unless their centre is taken off; with a centre the fast path still equals the dense
reference, decoding equals the full forward, the centre saves and loads, and the calibration sets it to the mean of the
keys the far part hashes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo import ZooHybridConfig
from attnzoo.convert.lsh_key_centres import centre_lsh_keys, centred_lsh_parts
from attnzoo.modeling.attention import build_attention
from attnzoo.modeling.attention.lsh_window import LSHFarPart
from tests.attention.helpers import saved_loaded_and_generating_like_the_full_forward
from tests.attention.test_far_positions import assert_decoding_equals_the_full_forward
from tests.attention.test_lsh_window import check_against_the_dense_reference


def config(**overrides):
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
                  position_embedding_type="rotary", attn_layers=["lsh_window"], is_decoder=True, vocab_size=37,
                  num_hidden_layers=2, intermediate_size=48, hidden_dropout_prob=0.0, pad_token_id=0,
                  max_position_embeddings=64, lsh_chunk_length=4, lsh_num_buckets=4, lsh_num_hashes=2,
                  lsh_attention_probs_dropout_prob=0.0, eval_seed=0, lsh_shared_qk=False, lsh_centre_keys=True)
    values.update(overrides)
    return ZooHybridConfig(**values)


def with_random_centres(model_or_layer, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model_or_layer.named_buffers():
            if name.endswith("lsh_key_centre"):
                buffer.copy_(torch.randn(buffer.shape, generator=g, dtype=buffer.dtype))
    return model_or_layer


def test_keys_that_share_a_direction_spread_over_the_buckets_only_when_centred():
    """Keys = a common vector 20x their own spread: uncentred, every key of a head lands in at most 3 buckets of 16
    per round; minus that vector (the centre) they use most of them."""
    torch.manual_seed(0)
    attn = build_attention("lsh_window", config(lsh_num_buckets=16, lsh_num_hashes=4), 0, True).eval()
    part = attn.far
    factors = part.bucket_factors()
    rotations = part.draw_rotations(1, 4, factors, "cpu")
    common = torch.randn(2, 8)
    keys = (20 * common[:, None, :] + torch.randn(2, 200, 8))[None]  # [1, kv_heads, 200, d]
    crowded = part._hash_keys(keys, rotations, factors, None)
    with torch.no_grad():
        attn.lsh_key_centre.copy_(20 * common)
    spread = part._hash_keys(keys, rotations, factors, None)
    used = [len(torch.unique(b[0, h, r])) for b in (crowded, spread) for h in range(4) for r in range(4)]
    assert max(used[:16]) <= 3 and min(used[16:]) >= 10, used


@pytest.mark.parametrize("window, sinks", [(4, 2), (1, 0), (15, 4)])
def test_the_fast_path_equals_the_dense_reference_with_centred_keys(window, sinks):
    torch.manual_seed(0)
    attn = with_random_centres(build_attention("lsh_window", config(window_size=window, num_sink_tokens=sinks), 0,
                                               True).double().eval())
    assert attn.lsh_key_centre.abs().min() > 0
    check_against_the_dense_reference(attn)


@pytest.mark.parametrize("far_kv_heads", [None, [[1]]])
def test_decoding_with_centred_keys_equals_the_full_forward(far_kv_heads):
    """The centre moves keys into other buckets (the logits differ from the uncentred model's), and decoding hashes
    each new key as the full forward does; with a far part in one key-value head, one centre."""
    torch.manual_seed(0)
    model = with_random_centres(AutoModelForCausalLM.from_config(config(far_kv_heads=far_kv_heads)).double().eval())
    centres = [b for n, b in model.named_buffers() if n.endswith("lsh_key_centre")]
    assert len(centres) == 2 and all(c.shape == (2 if far_kv_heads is None else 1, 8) for c in centres)
    torch.manual_seed(1)
    assert_decoding_equals_the_full_forward(model, length=26, prefill=7, padding=3)
    ids = torch.randint(1, 37, (1, 26))
    uncentred = AutoModelForCausalLM.from_config(config(far_kv_heads=far_kv_heads)).double().eval()
    uncentred.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("lsh_key_centre")},
                              strict=False)
    assert not torch.allclose(model(ids).logits, uncentred(ids).logits)


def test_the_centres_save_load_and_generate_like_the_full_forward(tmp_path):
    torch.manual_seed(0)
    model = with_random_centres(AutoModelForCausalLM.from_config(config()).eval())
    loaded = saved_loaded_and_generating_like_the_full_forward(model, tmp_path, 37, new_tokens=12)
    assert loaded.config.lsh_centre_keys is True
    for (name, saved), (_, got) in zip(model.named_buffers(), loaded.named_buffers(), strict=True):
        torch.testing.assert_close(got, saved, rtol=0, atol=0, msg=name)


def test_calibration_sets_each_centre_to_the_mean_of_the_real_keys_it_hashes(monkeypatch):
    """Over a left-padded batch: each far part's centre is the mean of the keys `_hash_keys` saw at real positions,
    computed with the centres at zero (earlier centres do not matter); the model is left in the mode it was in."""
    torch.manual_seed(0)
    model = with_random_centres(AutoModelForCausalLM.from_config(config()).double().train())
    seen = {}
    hash_keys = LSHFarPart._hash_keys

    def watched(self, k, rotations, factors, valid):
        assert self.layer.lsh_key_centre.abs().max() == 0
        seen.setdefault(self.layer_idx, []).append((k.detach(), valid.to(k.dtype)))
        return hash_keys(self, k, rotations, factors, valid)

    monkeypatch.setattr(LSHFarPart, "_hash_keys", watched)
    ids = torch.randint(1, 37, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    centres = centre_lsh_keys(model, ids, attention_mask=mask)
    assert model.training and sorted(centres) == [0, 1]
    for index, calls in seen.items():
        assert len(calls) == 1
        k, valid = calls[0]
        expected = (k * valid[:, None, :, None]).sum((0, 2)) / valid.sum()
        torch.testing.assert_close(centres[index], expected)
        torch.testing.assert_close(model.model.transformer.blocks[index].attn.lsh_key_centre, expected)
    # a second calibration on the same text gives the same centres (they are zeroed first)
    monkeypatch.setattr(LSHFarPart, "_hash_keys", hash_keys)
    again = centre_lsh_keys(model, ids, attention_mask=mask)
    for index in centres:
        torch.testing.assert_close(again[index], centres[index], rtol=0, atol=0)


def test_bad_settings_and_models_without_centres_are_refused():
    with pytest.raises(ValueError, match="lsh_centre_keys"):
        config(lsh_shared_qk=True)
    with pytest.raises(ValueError, match="lsh_centre_keys"):
        config(lsh_centre_keys="yes")
    model = AutoModelForCausalLM.from_config(config(lsh_centre_keys=False)).eval()
    assert not [n for n, _ in model.named_buffers() if n.endswith("lsh_key_centre")]
    with pytest.raises(ValueError, match="lsh_centre_keys=True"):
        centre_lsh_keys(model, torch.randint(1, 37, (1, 10)))
    with pytest.raises(ValueError, match="input_ids"):
        centre_lsh_keys(AutoModelForCausalLM.from_config(config()).eval(), torch.randint(1, 37, (10,)))


def test_a_checkpoint_without_centres_loads_with_centring_on_at_zero_and_reports_nothing_missing(tmp_path):
    """The documented path: load an uncentred conversion with lsh_centre_keys=True, then calibrate. Until then the
    centres are zero (the uncentred model's outputs), and the load does not call them weights missing from the
    checkpoint."""
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config(lsh_centre_keys=False)).eval()
    plain.save_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, lsh_centre_keys=True, output_loading_info=True)
    assert not info["missing_keys"]
    assert [b.abs().max().item() for n, b in model.named_buffers() if n.endswith("lsh_key_centre")] == [0.0, 0.0]
    ids = torch.randint(1, 37, (1, 20))
    torch.testing.assert_close(model.eval()(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_a_failed_calibration_keeps_the_centres_it_had():
    torch.manual_seed(0)
    model = with_random_centres(AutoModelForCausalLM.from_config(config()).eval())
    before = {n: b.clone() for n, b in model.named_buffers() if n.endswith("lsh_key_centre")}
    with pytest.raises(ValueError):  # a mask of another length: the forward refuses it
        centre_lsh_keys(model, torch.randint(1, 37, (1, 12)), attention_mask=torch.ones(1, 5, dtype=torch.long))
    for name, buffer in model.named_buffers():
        if name in before:
            torch.testing.assert_close(buffer, before[name], rtol=0, atol=0)
    assert all(part.key_record is None for part in centred_lsh_parts(model).values())
