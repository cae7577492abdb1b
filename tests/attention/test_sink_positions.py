"""Sinks seen just before the window (`sink_positions="adjacent"`, StreamingLLM's positions within the cache): in the
"window" attention and every windowed layer, the fast path equals the dense reference (values and gradients, left
padding, float64) and cached decoding equals the full forward; a query's output then no longer depends on how far
it is from the sinks, only on what it sees; up to position W + S - 1 nothing changes; bad settings are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo import ZooWindowConfig
from attnzoo.modeling.attention import build_attention
from tests.attention.helpers import assert_same_values_and_gradients
from tests.attention.test_far_positions import WINDOWED, assert_decoding_equals_the_full_forward, config, left_padded

#: the "window" attention (rotary only: it has no far part) and every windowed far part
KINDS = {"window": ("window", {"far_positions": ["rotary"]}), **WINDOWED}
#: (kind, how its far part sees positions)
CASES = [(name, far) for name in KINDS for far in ("rotary", "none") if not (name == "window" and far == "none")]


def layer(kind: str, settings: dict, causal: bool = True, **overrides):
    torch.manual_seed(0)
    attn = build_attention(kind, config(**settings, **overrides), 0, causal).double().eval()
    if hasattr(attn, "init_buffers"):
        attn.init_buffers()
    return attn


@pytest.mark.parametrize("name, far_positions", CASES)
def test_adjacent_sinks_equal_the_dense_reference_with_padding(name, far_positions):
    kind, settings = KINDS[name]
    attn = layer(kind, {**settings, "far_positions": [far_positions]}, sink_positions="adjacent")
    x, mask, positions = left_padded()
    fast = attn(x, attention_mask=mask, position_ids=positions)
    reference = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    assert_same_values_and_gradients(attn, x, mask, fast, reference)
    alone = attn(x[1:, 5:], position_ids=positions[1:, 5:])  # a left-padded row gives what the row alone gives
    torch.testing.assert_close(fast[1, 5:], alone[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window, sinks", [(2, 6), (1, 4), (1, 1)])
@pytest.mark.parametrize("name", ["window", "favor_window", "lsh_window_shared_qk"])
def test_adjacent_sinks_with_more_sinks_than_window_or_a_one_token_window(name, window, sinks):
    kind, settings = KINDS[name]
    attn = layer(kind, settings, sink_positions="adjacent", window_size=window, num_sink_tokens=sinks)
    x, mask, positions = left_padded()
    fast = attn(x, attention_mask=mask, position_ids=positions)
    reference = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    assert_same_values_and_gradients(attn, x, mask, fast, reference)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(attn_layers=[kind], sink_positions="adjacent", window_size=window,
                                                    num_sink_tokens=sinks, **settings)).double().eval()
    assert_decoding_equals_the_full_forward(model, length=16, prefill=3, padding=2)


@pytest.mark.parametrize("name", list(KINDS))
def test_adjacent_sinks_depend_on_real_positions_not_on_where_rotary_positions_start(name):
    """Rotary positions shifted by 100 (an offset a caller passes), or counted over the padding (a padded row without
    position_ids), leave every relative distance as it was: the sinks stay just before the window."""
    kind, settings = KINDS[name]
    attn = layer(kind, {**settings, "far_positions": ["rotary" if kind == "window" else "none"]},
                 sink_positions="adjacent")
    x, mask, positions = left_padded()
    with torch.no_grad():
        counted = attn(x, attention_mask=mask, position_ids=positions)
        shifted = attn(x, attention_mask=mask, position_ids=positions + 100)
        over_padding = attn(x, attention_mask=mask)  # positions 0, 1, ... over the pads of row 1
    torch.testing.assert_close(shifted[mask], counted[mask], rtol=1e-6, atol=1e-7)  # float32 angles
    torch.testing.assert_close(over_padding[mask], counted[mask], rtol=1e-6, atol=1e-7)


def test_adjacent_sinks_in_a_bidirectional_window_equal_the_dense_reference():
    attn = layer("window", KINDS["window"][1], causal=False, sink_positions="adjacent")
    x, mask, positions = left_padded()
    fast = attn(x, attention_mask=mask, position_ids=positions)
    reference = attn.reference_forward(x, attention_mask=mask, position_ids=positions)
    assert_same_values_and_gradients(attn, x, mask, fast, reference)


@pytest.mark.parametrize("name", list(KINDS))
def test_adjacent_sinks_change_only_queries_past_window_plus_sinks(name):
    """Queries at positions up to W + S - 1 see the sinks at their true distance either way (W = 4, S = 2); later
    ones see them closer, so their outputs move."""
    kind, settings = KINDS[name]
    settings = {**settings, "far_positions": ["rotary"]}
    absolute, adjacent = layer(kind, settings), layer(kind, settings, sink_positions="adjacent")
    adjacent.load_state_dict(absolute.state_dict())
    x, mask, positions = left_padded()
    with torch.no_grad():
        ours = adjacent(x, attention_mask=mask, position_ids=positions)
        theirs = absolute(x, attention_mask=mask, position_ids=positions)
    unchanged = mask & (positions <= 5)
    torch.testing.assert_close(ours[unchanged], theirs[unchanged], rtol=1e-12, atol=1e-12)
    assert (ours - theirs)[mask & (positions > 5)].abs().amax(-1).min() > 1e-6


@pytest.mark.parametrize("sink_positions, moves", [("absolute", True), ("adjacent", False)])
def test_with_adjacent_sinks_a_query_sees_the_same_distances_at_any_position(sink_positions, moves):
    """The same sinks and the same window, with 10 or 300 tokens between them: the last query's output is the same
    when the sinks are adjacent (every near distance is below W + S), and differs when they keep their positions."""
    attn = layer("window", KINDS["window"][1], sink_positions=sink_positions)
    generator = torch.Generator().manual_seed(3)
    sinks, window = (torch.randn(1, n, 32, dtype=torch.float64, generator=generator) for n in (2, 4))

    def last_output(gap: int):
        between = torch.randn(1, gap, 32, dtype=torch.float64, generator=generator)
        with torch.no_grad():
            return attn(torch.cat([sinks, between, window], 1))[0, -1]

    near, far = last_output(10), last_output(300)
    if moves:
        assert (near - far).abs().max() > 1e-4
    else:
        # the same relative rotations, computed from angles at other absolute positions (float32 angles)
        torch.testing.assert_close(near, far, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(KINDS))
def test_decoding_with_adjacent_sinks_equals_the_full_forward(name):
    kind, settings = KINDS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(attn_layers=[kind], sink_positions="adjacent",
                                                    **settings)).double().eval()
    assert_decoding_equals_the_full_forward(model, length=26, prefill=7, padding=3)


def test_adjacent_sinks_switch_on_at_loading(tmp_path):
    """A model trained with sinks at their positions loads with them adjacent (a config keyword) and saves that."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(attn_layers=["window"], far_positions=["rotary"])).eval()
    model.save_pretrained(tmp_path / "trained")
    switched = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", sink_positions="adjacent").eval()
    assert switched.model.transformer.blocks[0].attn.sink_positions == "adjacent"
    ids = torch.randint(1, 37, (1, 12))
    with torch.no_grad():
        before, after = model(ids).logits, switched(ids).logits
    torch.testing.assert_close(before[:, :6], after[:, :6])
    assert (before[:, 6:] - after[:, 6:]).abs().max() > 1e-6


@pytest.mark.parametrize("values, message", [
    ({"sink_positions": "cache"}, "use one of"),
    ({"sink_positions": "adjacent", "position_embedding_type": "learned", "far_positions": ["rotary"]},
     "position_embedding_type='rotary' or sink_positions='absolute'"),
    ({"sink_positions": "adjacent", "num_sink_tokens": 0}, "num_sink_tokens=0"),
])
def test_bad_sink_positions_are_refused_naming_the_field(values, message):
    with pytest.raises(ValueError, match=rf"^sink_positions=.*{message}"):
        config(**values)
    with pytest.raises(ValueError, match=r"^sink_positions="):
        ZooWindowConfig(**{"far_positions": ["rotary"], "position_embedding_type": "rotary", **values})
