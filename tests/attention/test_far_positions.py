"""Far parts that do not depend on trained distances (`far_positions`, `far_query_scale`): in every windowed
attention and in "full" layers, the fast path equals the dense reference (values and gradients, left padding,
float64), cached decoding equals the full forward, the far part really drops the rotation (and only it: the window
keeps its rotary positions), the query scales follow their formulas, and bad settings are refused naming the
field."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo import ZooHybridConfig, ZooHybridForCausalLM
from attnzoo.modeling.attention import build_attention
from attnzoo.modeling.attention.far_positions import FarQueryScale
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import assert_same_values_and_gradients

#: (attention kind, its settings): every windowed far part, LSH with shared and separate queries and keys
WINDOWED = {
    "favor_window": ("favor_window", {}),
    "lara_window": ("lara_window", {}),
    "ra_window": ("ra_window", {}),
    "lsh_window_shared_qk": ("lsh_window", {}),
    "lsh_window_separate_qk": ("lsh_window", {"lsh_shared_qk": False}),
    "block_window": ("block_window", {"block_size": 2, "block_topk": 2}),
}
SCALES = [None, "log", "learned"]
#: the far positions a windowed layer can give its far part without rotary distances beyond training
BOUNDED = ["none", "fixed", "grouped"]
GROUP = 3  # far_position_group of the "grouped" cases: not a divisor of the window (4), so the floor matters


def positions_settings(positions: str) -> dict:
    return {"far_positions": [positions], "far_position_group": GROUP if positions == "grouped" else None}


def config(**overrides) -> ZooHybridConfig:
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
                  position_embedding_type="rotary", is_decoder=True, vocab_size=37, num_hidden_layers=2,
                  intermediate_size=48, hidden_dropout_prob=0.0, pad_token_id=0, max_position_embeddings=64,
                  num_random_features=16, lara_chunk_size=3, lara_num_samples=2, lsh_chunk_length=4,
                  lsh_num_buckets=4, lsh_num_hashes=2, lsh_full_attention_threshold=0, attention_head_size=None,
                  far_positions=["none"], far_query_scale_length=8)
    values.update(overrides)
    return ZooHybridConfig(**values)


def layer(kind: str, settings: dict, **overrides):
    torch.manual_seed(0)
    attn = build_attention(kind, config(**settings, **overrides), 0, True).double().eval()
    if hasattr(attn, "init_buffers"):
        attn.init_buffers()
    if attn.far_query_scale is not None and attn.far_query_scale.kind == "learned":
        with torch.no_grad():  # not all at the initial value: heads must keep their own weight
            attn.far_query_scale.weight.copy_(torch.tensor([0.2, 0.3, 0.25, 0.4]))
    return attn


def left_padded(length=19, pad=5):
    x = torch.randn(2, length, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :pad] = False
    return x, mask, (mask.long().cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("positions", BOUNDED)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", list(WINDOWED))
def test_far_parts_without_positions_equal_their_dense_reference_with_padding(name, scale, positions):
    kind, settings = WINDOWED[name]
    attn = layer(kind, settings, far_query_scale=scale, **positions_settings(positions))
    x, mask, positions = left_padded()
    fast = attn(x, attention_mask=mask, position_ids=positions)
    reference = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    assert_same_values_and_gradients(attn, x, mask, fast, reference)
    # a left-padded row gives its real tokens what the row alone gives them
    alone = attn(x[1:, 5:], position_ids=positions[1:, 5:])
    torch.testing.assert_close(fast[1, 5:], alone[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("positions", BOUNDED)
@pytest.mark.parametrize("name", list(WINDOWED))
def test_only_the_far_part_loses_the_rotation(name, positions):
    """Queries with no far key (real positions below window + sinks) get what the rotary layer gives them; later
    ones differ; and shifting every position changes the window's rotations, so the outputs move with it."""
    kind, settings = WINDOWED[name]
    plain, rotary = layer(kind, settings, **positions_settings(positions)), layer(kind, settings,
                                                                                 far_positions=["rotary"])
    rotary.load_state_dict(plain.state_dict())
    x, mask, positions = left_padded()
    with torch.no_grad():
        ours = plain(x, attention_mask=mask, position_ids=positions)
        theirs = rotary(x, attention_mask=mask, position_ids=positions)
    near_only = mask & (positions < 6)
    torch.testing.assert_close(ours[near_only], theirs[near_only], rtol=1e-12, atol=1e-12)
    assert (ours - theirs)[mask & (positions >= 6)].abs().amax(-1).max() > 1e-4


@pytest.mark.parametrize("positions", BOUNDED)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", list(WINDOWED))
def test_cached_decoding_equals_the_full_forward(name, scale, positions):
    kind, settings = WINDOWED[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(attn_layers=[kind], far_query_scale=scale,
                                                    **positions_settings(positions), **settings)).double().eval()
    cache = assert_decoding_equals_the_full_forward(model, length=26, prefill=7, padding=3)
    assert "ring_far_k" in cache.layers[0].state  # the window keeps the keys as the far part sees them, to hand over


def assert_decoding_equals_the_full_forward(model, length: int, prefill: int, padding: int):
    """Token-by-token logits after a prefill equal the full forward's on a batch whose second row is left-padded;
    returns the cache."""
    ids = torch.randint(1, 37, (2, length))
    mask = torch.ones_like(ids)
    ids[1, :padding], mask[1, :padding] = 0, 0
    full = model(ids, attention_mask=mask).logits
    out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    steps = [out.logits]
    for t in range(prefill, length):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
        steps.append(out.logits)
    real = mask.bool()[..., None]
    torch.testing.assert_close(torch.cat(steps, 1) * real, full * real, rtol=1e-9, atol=1e-10)
    return output_cache(out)


@pytest.mark.parametrize("scale", SCALES)
def test_a_full_layer_without_positions_is_softmax_over_unrotated_scaled_queries(scale):
    torch.manual_seed(0)
    attn = build_attention("full", config(far_query_scale=scale), 0, True).double().eval()
    x, mask, positions = left_padded()
    got = attn(x, attention_mask=mask, position_ids=positions)
    q, k, v = (attn.split_heads(p(x)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    if scale == "log":
        q = q * (1 + 0.1 * torch.log(torch.floor((positions + 1).double() / 8) + 1))[:, None, :, None]
    elif scale == "learned":
        q = q * attn.far_query_scale.weight[None, :, None, None] * torch.log((positions + 1).double())[:, None, :, None]
    k, v = attn.expand_kv(k), attn.expand_kv(v)
    allowed = torch.ones(19, 19, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~allowed, float("-inf"))
    expected = attn.o_proj(attn.merge_heads(scores.softmax(-1) @ v))
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-10, atol=1e-12)


def test_the_irope_pattern_trains_generates_and_reloads(tmp_path):
    """Three windowed LSH layers with rotary positions, then a global softmax layer without positions (iRoPE,
    RNoPE-SWA), queries scaled with the log of the position: a training step reaches the learned scale, cached and
    uncached generation agree, and the saved model reloads with the same logits."""
    torch.manual_seed(0)
    model = ZooHybridForCausalLM(config(attn_layers=["lsh_window", "lsh_window", "lsh_window", "full"],
                                        far_positions=["rotary", "rotary", "rotary", "none"], num_hidden_layers=4,
                                        lsh_shared_qk=False, far_query_scale="learned"))
    blocks = model.model.transformer.blocks
    assert [block.attn.far_positions for block in blocks] == ["rotary", "rotary", "rotary", "none"]
    assert [block.attn.far_query_scale is not None for block in blocks] == [False, False, False, True]
    torch.testing.assert_close(blocks[3].attn.far_query_scale.weight, torch.full((4,), 1 / math.log(64)))
    ids = torch.randint(1, 37, (2, 20))
    model.train()
    model(ids, labels=ids).loss.backward()
    assert blocks[3].attn.far_query_scale.weight.grad.abs().min() > 0
    model.eval()
    cached = model.generate(ids[:, :8], max_new_tokens=8, do_sample=False)
    uncached = model.generate(ids[:, :8], max_new_tokens=8, do_sample=False, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    model.save_pretrained(tmp_path / "irope")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "irope").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_the_query_scales_follow_their_formulas():
    positions = torch.tensor([[0, 6, 7, 8, 15, 16, 100]])
    log = FarQueryScale("log", 2, 8, 64)(positions, torch.float64)
    expected = 1 + 0.1 * torch.log(torch.floor((positions + 1.0).double() / 8) + 1)  # 1 below 8 tokens, then up
    torch.testing.assert_close(log[:, 0, :, 0], expected)
    assert log[0, 0, :2].eq(1).all() and log[0, 0, 2] > 1
    learned = FarQueryScale("learned", 2, 8, 64)
    torch.testing.assert_close(learned(torch.tensor([[63]]), torch.float64)[0, :, 0, 0],
                               torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("name", ["favor_window", "lsh_window_separate_qk"])
def test_the_log_scale_trains_as_no_scale_on_blocks_of_its_length(name):
    """With far_query_scale_length equal to the training length, the log scale is 1 at every position that has a
    label (only the last query, which predicts past the block, is scaled), so the loss and every gradient equal the
    unscaled model's: benchmarks/long_context.py trains one of the two designs and switches the scale at inference.
    A block one token longer gives the scale a labelled position, and the losses part."""
    kind, settings = WINDOWED[name]
    ids = torch.randint(1, 37, (2, 9), generator=torch.Generator().manual_seed(2))

    def loss_and_grads(scale, length):
        torch.manual_seed(0)
        model = ZooHybridForCausalLM(config(attn_layers=[kind], lsh_hash_seed=0, far_query_scale=scale,
                                            **settings)).double()
        loss = model(ids[:, :length], labels=ids[:, :length]).loss
        loss.backward()
        return loss, [p.grad for p in model.parameters() if p.grad is not None]

    for length, same in ((8, True), (9, False)):  # far_query_scale_length=8
        (scaled, scaled_grads), (plain, plain_grads) = loss_and_grads("log", length), loss_and_grads(None, length)
        if same:
            torch.testing.assert_close(scaled, plain, rtol=0, atol=0)
            for a, b in zip(scaled_grads, plain_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            assert (scaled - plain).abs() > 1e-9


def test_fixed_far_positions_read_every_far_key_at_the_window_distance():
    """The far view's q . k is rotary's score of the pair at distance W, wherever the pair is; the near part is the
    rotary layer's."""
    attn = layer("lsh_window", {"lsh_shared_qk": False}, far_positions=["fixed"])
    q, k = torch.randn(1, 4, 19, 8, dtype=torch.float64), torch.randn(1, 4, 19, 8, dtype=torch.float64)
    positions = torch.arange(19)[None]
    q_far, k_far = attn.far_view(q, k, None, None, positions)
    window = attn.window_size
    for query, key in [(18, 0), (10, 3), (6, 2)]:
        at_query = attn.rotate(q[:, :, query:query + 1], attn.rotary(torch.tensor([[query + 100]]), q.dtype))
        at_window_before = attn.rotate(k[:, :, key:key + 1], attn.rotary(torch.tensor([[query + 100 - window]]),
                                                                         k.dtype))
        # the rotary tables are float32 (as the source model's), whose angles at other positions round differently
        torch.testing.assert_close(q_far[:, :, query] @ k_far[:, :, key].transpose(-1, -2),
                                   at_query[:, :, 0] @ at_window_before[:, :, 0].transpose(-1, -2),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, GROUP, 4])
def test_grouped_far_positions_continue_from_the_window_edge_group_times_slower(group):
    """Self-Extend's grouped positions: the far view's q . k is rotary's score of the pair at distance
    W + floor(i / G) - floor(j / G) - floor(W / G) (>= W for a far key, W at the window's edge when G divides W),
    counted in real tokens; with G = 1 that is the pair's own distance, so the far part sees what "rotary" gives it."""
    attn = layer("lsh_window", {"lsh_shared_qk": False}, far_positions=["grouped"], far_position_group=group)
    q, k = torch.randn(1, 4, 40, 8, dtype=torch.float64), torch.randn(1, 4, 40, 8, dtype=torch.float64)
    real = torch.arange(40)[None]
    q_far, k_far = attn.far_view(q, k, None, None, real, 0, real)
    window = attn.window_size
    for query, key in [(39, 0), (30, 3), (20, 16), (9, 5)]:
        distance = window + query // group - key // group - window // group
        assert distance >= window
        if group == 1:
            assert distance == query - key
        at_query = attn.rotate(q[:, :, query:query + 1], attn.rotary(torch.tensor([[distance + 50]]), q.dtype))
        at_key = attn.rotate(k[:, :, key:key + 1], attn.rotary(torch.tensor([[50]]), k.dtype))
        torch.testing.assert_close(q_far[:, :, query] @ k_far[:, :, key].transpose(-1, -2),
                                   at_query[:, :, 0] @ at_key[:, :, 0].transpose(-1, -2), rtol=1e-5, atol=1e-5)


def test_grouped_far_positions_of_group_one_are_the_rotary_layer():
    """G = 1 reads every far key at its own distance: the same outputs as far_positions 'rotary', left padding
    included (grouped positions count real tokens, as the model's position ids do)."""
    kind, settings = WINDOWED["lsh_window_separate_qk"]
    grouped = layer(kind, settings, far_positions=["grouped"], far_position_group=1)
    rotary = layer(kind, settings, far_positions=["rotary"])
    rotary.load_state_dict(grouped.state_dict())
    x, mask, positions = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(grouped(x, attention_mask=mask, position_ids=positions)[mask],
                                   rotary(x, attention_mask=mask, position_ids=positions)[mask],
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("positions", ["fixed", "grouped"])
def test_window_relative_far_positions_need_a_windowed_layer_with_a_far_part(positions):
    settings = positions_settings(positions)
    with pytest.raises(ValueError, match=r"layer 0 \('full'\) has no window beside a far part.*'rotary' or 'none'"):
        build_attention("full", config(**settings), 0, True)
    with pytest.raises(ValueError, match=r"layer 0 \('window'\) has no window beside a far part"):
        build_attention("window", config(**settings), 0, True)


@pytest.mark.parametrize("values, field, message", [
    ({"far_positions": ["nope"]}, "far_positions", "list one of"),
    ({"far_positions": ["none"], "position_embedding_type": "learned"}, "far_positions",
     "position_embedding_type='rotary'"),
    ({"far_positions": ["fixed"], "position_embedding_type": "learned"}, "far_positions",
     "position_embedding_type='rotary'"),
    ({"far_positions": ["grouped"], "far_position_group": 2, "position_embedding_type": "learned"},
     "far_positions", "position_embedding_type='rotary'"),
    ({"far_positions": ["grouped"]}, "far_position_group", "far_positions lists 'grouped'.*set it"),
    ({"far_positions": ["fixed"], "far_position_group": 4}, "far_position_group", "no layer has them"),
    ({"far_positions": ["grouped"], "far_position_group": 0}, "far_position_group", "positive integer"),
    ({"far_positions": ["rotary"], "far_query_scale": "log"}, "far_query_scale", "no layer has one"),
    ({"far_query_scale": "cubic"}, "far_query_scale", "cubic"),
    ({"far_positions": ["none", "rotary", "none"]}, "far_positions", "3 entries for 2 layers"),
])
def test_bad_far_position_settings_are_refused_naming_the_field(values, field, message):
    with pytest.raises(ValueError, match=rf"{field}=.*{message}"):
        config(**values)


def test_an_attention_without_a_far_part_refuses_to_drop_positions():
    with pytest.raises(ValueError, match=r"layer 0 \('favor'\) has no far part that can do without positions"):
        build_attention("favor", config(), 0, True)


@pytest.mark.parametrize("window, sinks", [(4, 0), (1, 0), (1, 3)])
@pytest.mark.parametrize("name", list(WINDOWED))
def test_decoding_without_sinks_or_with_a_one_token_window_equals_the_full_forward(name, window, sinks):
    """A plain sliding window (no sinks) and the narrowest window decode like the full forward, positions rotary."""
    kind, settings = WINDOWED[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(attn_layers=[kind], far_positions=["rotary"], window_size=window,
                                                    num_sink_tokens=sinks, **settings)).double().eval()
    assert_decoding_equals_the_full_forward(model, length=16, prefill=5, padding=2)


def test_a_windowed_kind_in_an_encoder_says_to_set_is_decoder():
    with pytest.raises(ValueError, match=r"'favor_window' is for causal \(decoder\) layers: set is_decoder=True"):
        build_attention("favor_window", config(), 0, False)
