"""The dense far part ("dense_window"): with rotary far positions it is exact causal softmax attention split at the
window, so it must equal the "full" attention with the same weights; the parallel form's query groups must not
change what it computes, groups without far keys included. (The far-part contract itself, reference, decoding and
padding, is checked for it by tests/attention/test_far_part_conformance.py.)"""

import pytest
import torch

from attnzoo.modeling.attention import build_attention, dense_window
from attnzoo.modeling.attention.conformance import conformance_config
from attnzoo.modeling.modeling_hybrid import ZooHybridForCausalLM


def _inputs(length=21, left=6):
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :left] = False
    x = torch.randn(2, length, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4),
                    requires_grad=True)
    return x, dict(attention_mask=mask, position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0)), mask


def test_rotary_far_keys_give_exact_softmax_attention():
    config = conformance_config("dense_window")
    torch.manual_seed(0)
    dense = build_attention("dense_window", config, 0, True).double().eval()
    full = build_attention("full", conformance_config("full"), 0, True).double().eval()
    full.load_state_dict(dense.state_dict())
    x, kwargs, mask = _inputs()
    ours, exact = dense(x, **kwargs), full(x, **kwargs)
    torch.testing.assert_close(ours[mask], exact[mask], rtol=1e-10, atol=1e-12)
    weights = torch.randn(ours.shape, dtype=ours.dtype, generator=torch.Generator().manual_seed(5)) * mask[..., None]
    grads = [torch.autograd.grad((out * weights).sum(), [x, *layer.parameters()])
             for out, layer in ((ours, dense), (exact, full))]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_whole_models_match_softmax_logits_and_generate_alike():
    torch.manual_seed(0)
    dense = ZooHybridForCausalLM(conformance_config("dense_window")).double().eval()
    full = ZooHybridForCausalLM(conformance_config("full")).double().eval()
    full.load_state_dict(dense.state_dict())
    ids = torch.randint(1, 37, (1, 15), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, full(ids).logits, rtol=1e-10, atol=1e-12)
        ours = dense.generate(ids, max_new_tokens=12, do_sample=False)
        exact = full.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, exact)


@pytest.mark.parametrize("scores_per_group", [128, 256, 1152])
@pytest.mark.parametrize("far_positions", ["fixed", "rotary"])
def test_query_groups_change_nothing(monkeypatch, scores_per_group, far_positions):
    """Groups of 1, 2 and 9 queries (scores for 2 rows x 4 heads x 16 far keys at most each) against one group."""
    torch.manual_seed(0)
    layer = build_attention("dense_window", conformance_config("dense_window", far_positions=[far_positions]), 0,
                            True).double().eval()
    x, kwargs, mask = _inputs()
    whole = layer(x, **kwargs)
    grad_whole = torch.autograd.grad(whole[mask].sum(), [x, *layer.parameters()])
    monkeypatch.setattr(dense_window, "SCORES_PER_GROUP", scores_per_group)
    grouped = layer(x, **kwargs)
    torch.testing.assert_close(grouped[mask], whole[mask], rtol=1e-12, atol=1e-13)
    for a, b in zip(torch.autograd.grad(grouped[mask].sum(), [x, *layer.parameters()]), grad_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
    with torch.no_grad():
        reference = layer.reference_forward(x, **kwargs)
    torch.testing.assert_close(grouped[mask], reference[mask], rtol=1e-9, atol=1e-11)


def test_fixed_far_positions_differ_from_rotary():
    """The far view is not ignored: reading every far key at distance W changes the output wherever a query has a far
    key farther than W, and nowhere else (its nearest far key is at distance W either way)."""
    x, kwargs, mask = _inputs()
    outs = {}
    for far_positions in ("rotary", "fixed"):
        torch.manual_seed(0)
        layer = build_attention("dense_window", conformance_config("dense_window", far_positions=[far_positions]),
                                0, True).double().eval()
        with torch.no_grad():
            outs[far_positions] = layer(x, **kwargs)
    position = kwargs["position_ids"]
    has_far = mask & (position >= 4 + 2 + 1)  # W = 4, S = 2: a far key farther than W from W + S + 1 on
    # (at distance W the two views agree to the rotary tables' float32 rounding, about 1e-9 here)
    differs = (outs["rotary"] - outs["fixed"]).abs().amax(-1) > 1e-6
    assert torch.equal(differs[mask], has_far[mask])


@pytest.mark.parametrize(("scores_per_group", "group"), [(128, 1), (256, 2), (1152, 9)])
def test_group_sizes_are_what_the_bound_gives(monkeypatch, scores_per_group, group):
    """The sizes the test above relies on: the bound over (rows x heads x the most far keys a query has)."""
    monkeypatch.setattr(dense_window, "SCORES_PER_GROUP", scores_per_group)
    seen = []
    original = dense_window.DenseFarPart._attend
    monkeypatch.setattr(dense_window.DenseFarPart, "_attend",
                        lambda self, q, *rest: seen.append(q.shape[2]) or original(self, q, *rest))
    torch.manual_seed(0)
    layer = build_attention("dense_window", conformance_config("dense_window"), 0, True).double().eval()
    x, kwargs, _ = _inputs()
    with torch.no_grad():
        layer(x, **kwargs)
    assert max(seen) == group
