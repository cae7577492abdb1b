"""Block retrieval beyond the window ("block_window"): reading every block is exact causal softmax; reading the
top-k blocks selects the blocks a hand computation of the selection rule selects, and no other far key outside the
tail; decoding keeps each far key and value once. The contract's checks (reference = fast path, decoding = full
forward, left padding, remote code) run over it in tests/attention/test_far_part_conformance.py."""

from __future__ import annotations

import math

import pytest
import torch

from attnzoo import ZooHybridForCausalLM
from attnzoo.modeling.attention import build_attention
from attnzoo.modeling.attention.block_window import selectable_blocks
from attnzoo.modeling.attention.windowed import FarInputs, far_state
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import block_config as config


def left_padded(length=40, pad=5):
    x = torch.randn(2, length, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :pad] = False
    return x, mask, (mask.long().cumsum(-1) - 1).clamp(min=0)


def test_reading_every_block_is_exact_causal_softmax():
    """With top-k at least the number of blocks, every far key is read: window + sinks + far = softmax over every
    earlier real key, with left padding."""
    torch.manual_seed(0)
    block = build_attention("block_window", config(block_topk=20), 0, True).double().eval()
    full = build_attention("full", config(block_topk=20), 0, True).double().eval()
    full.load_state_dict(block.state_dict())
    x, mask, positions = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(block(x, attention_mask=mask, position_ids=positions)[mask],
                                   full(x, attention_mask=mask, position_ids=positions)[mask], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("query_size", [None, 1])
def test_top_k_reads_the_blocks_the_selection_rule_picks_and_the_tail(query_size):
    """One query, by hand: its query block's selection query σ (the query block's first query plus the block_size
    queries before it; query blocks of block_size or of 1 query), each selectable block's mean key, the top-k of
    their scores; the far triple is softmax over those blocks' keys and the tail (far keys past the selectable
    blocks), and differs from reading every far key."""
    torch.manual_seed(0)
    layer = build_attention("block_window", config(block_query_size=query_size), 0, True).double().eval()
    size, window, sinks, topk = 3, 4, 2, 2
    step = query_size or size
    q = torch.randn(1, 4, 40, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 40, 8, dtype=torch.float64), torch.randn(1, 2, 40, 8, dtype=torch.float64)
    position = torch.arange(40)[None]
    num, den, lse, _, _ = layer.far.parallel(FarInputs(q, k, v, position < 40, position))
    query, head = 37, 3  # key/value head 1
    start = query - query % step
    selection = q[0, head, start] + q[0, head, start - size:start].sum(0)
    selectable = int(selectable_blocks(torch.tensor(start), window, sinks, size))
    means = torch.stack([k[0, 1, sinks + m * size:sinks + (m + 1) * size].mean(0) for m in range(selectable)])
    chosen = (means @ selection).topk(topk).indices.tolist()
    read = [p for m in chosen for p in range(sinks + m * size, sinks + (m + 1) * size)]
    read += list(range(sinks + selectable * size, query - window + 1))
    logits = k[0, 1, read] @ q[0, head, query] / math.sqrt(8)
    torch.testing.assert_close(num[0, head, query], logits.softmax(-1) @ v[0, 1, read], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse[0, head, query], logits.logsumexp(-1), rtol=1e-10, atol=1e-12)
    assert den[0, head, query] == 1
    every = list(range(sinks, query - window + 1))
    assert len(read) < len(every)
    assert (lse[0, head, query] - (k[0, 1, every] @ q[0, head, query] / math.sqrt(8)).logsumexp(-1)).abs() > 1e-3


def test_decoding_keeps_each_far_key_once_and_one_sum_per_block():
    torch.manual_seed(0)
    model = ZooHybridForCausalLM(config()).double().eval()
    ids = torch.randint(1, 37, (2, 30))
    out = model(ids[:, :20], use_cache=True)
    for t in range(20, 30):
        out = model(ids[:, t:t + 1], cache=output_cache(out), use_cache=True)
    state = far_state(output_cache(out).layers[0])
    assert {"block_keys", "block_values", "block_key_sums", "block_query_sum", "block_query_sums_before",
            "block_selection", "block_selected"} <= set(state)
    held = 30 - 4  # keys that left the window
    assert state["block_keys"].shape[:2] == (2, 2) and held <= state["block_keys"].shape[2] <= held + 4
    assert state["block_key_sums"].shape[:2] == (2, 2) and state["block_key_sums"].shape[2] <= math.ceil(held / 3) + 4
    assert state["block_selection"].shape == (2, 4, 2)
    with torch.no_grad():
        cached = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False)
        uncached = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.tolist() == uncached.tolist()


@pytest.mark.parametrize("field", ["block_size", "block_topk"])
def test_bad_block_settings_are_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=rf"{field}=0 is invalid: set a positive integer"):
        config(**{field: 0})


@pytest.mark.parametrize("query_size", [0, 2, 4])
def test_a_query_block_that_does_not_divide_the_key_block_is_refused(query_size):
    with pytest.raises(ValueError, match=rf"block_query_size={query_size} is invalid: set a divisor of block_size=3"):
        config(block_query_size=query_size)


def test_an_encoder_layer_is_refused():
    with pytest.raises(ValueError, match=r"'block_window' is for causal \(decoder\) layers"):
        build_attention("block_window", config(), 0, False)


@pytest.mark.parametrize("query_size", [None, 1])
@pytest.mark.parametrize("gathered", [1, 200])  # one query block per group; groups that do not divide the blocks
def test_groups_of_query_blocks_equal_the_reference(gathered, query_size, monkeypatch):
    """Long prompts gather the blocks of a group of query blocks at a time (a cache bound); any group size gives the
    reference's values and gradients, with query blocks of block_size and of one query."""
    import attnzoo.modeling.attention.block_window as block_window
    from attnzoo.modeling.attention.conformance import fast_equals_reference

    monkeypatch.setattr(block_window, "GATHERED_KEYS", gathered)
    fast_equals_reference("block_window", block_size=3, block_topk=2, block_query_size=query_size)


def test_with_gradients_the_gathered_keys_are_gathered_again_not_kept(monkeypatch):
    """A backward pass keeps no group's gathered keys, values or scores (each group is recomputed): what autograd
    saves is far less than the gathered keys of all groups, which it kept before; the gradients still equal the
    reference's (above)."""
    import attnzoo.modeling.attention.block_window as block_window

    monkeypatch.setattr(block_window, "GATHERED_KEYS", 1)  # one query block a group
    torch.manual_seed(0)
    layer = build_attention("block_window", config(), 0, True).double()
    length, dim = 60, 8
    q = torch.randn(1, 4, length, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, length, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    position = torch.arange(length)[None]
    saved = {}  # the bytes of each storage autograd keeps (a tensor saved by several operations counts once)

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer.far.parallel(FarInputs(q, k, v, position < length, position))
    query_blocks, read = length // 3, 2 + 2  # query blocks of block_size 3; topk 2 blocks and the 2-block tail
    gathered = 2 * 4 * query_blocks * read * 3 * dim * 8  # bytes of the keys and values all groups gather
    assert sum(saved.values()) < gathered / 2  # kept, they were 1.7x it (every group's keys, values and scores)
    (out.num.sum() + out.den.sum()).backward()
    assert q.grad is not None and k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


def graph_nodes(tensor: torch.Tensor) -> int:
    """The autograd nodes `tensor` was computed through."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def test_the_graph_holds_one_node_for_all_groups_not_nodes_per_group(monkeypatch):
    """The groups run outside autograd's graph: a forward pass with gradients leaves as many graph nodes with one
    query block a group as with one group for the whole sequence (nodes kept per group, small allocations between
    each group's gathered keys, kept glibc from reusing the freed keys: gigabytes at a few thousand tokens)."""
    import attnzoo.modeling.attention.block_window as block_window

    torch.manual_seed(0)
    layer = build_attention("block_window", config(), 0, True).double()
    length = 60
    q = torch.randn(1, 4, length, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, length, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    position = torch.arange(length)[None]
    nodes = {}
    for gathered in (1, 1 << 20):
        monkeypatch.setattr(block_window, "GATHERED_KEYS", gathered)
        out = layer.far.parallel(FarInputs(q, k, v, position < length, position))
        nodes[gathered] = graph_nodes(out.num) + graph_nodes(out.log_scale)
    assert nodes[1] == nodes[1 << 20] < 40


@pytest.mark.parametrize("needs_grad", ["q", "k", "v"])
def test_a_backward_pass_gives_gradients_to_just_the_inputs_that_want_them(needs_grad, monkeypatch):
    """One input wanting gradients (as LoRA on one projection) gets the gradient it gets when all three want them
    (which equals the reference's: test_groups_of_query_blocks_equal_the_reference), and the others get none."""
    import attnzoo.modeling.attention.block_window as block_window

    monkeypatch.setattr(block_window, "GATHERED_KEYS", 1)
    torch.manual_seed(0)
    layer = build_attention("block_window", config(), 0, True).double()
    length = 40
    q = torch.randn(1, 4, length, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, length, 8, dtype=torch.float64), torch.randn(1, 2, length, 8, dtype=torch.float64)
    position = torch.arange(length)[None]
    weights = torch.randn(1, 4, length, 8, dtype=torch.float64), torch.randn(1, 4, length, dtype=torch.float64)
    found = {}
    for wanting in (needs_grad, "qkv"):
        inputs = {name: x.clone().requires_grad_(name in wanting) for name, x in zip("qkv", (q, k, v), strict=True)}
        out = layer.far.parallel(FarInputs(*inputs.values(), position < length, position))
        lse = torch.where(torch.isfinite(out.log_scale), out.log_scale, 0.0)
        ((out.num * weights[0]).sum() + (lse * weights[1]).sum()).backward()
        found[wanting] = {name: x.grad for name, x in inputs.items()}
    assert all(found[needs_grad][name] is None for name in "qkv" if name != needs_grad)
    assert found[needs_grad][needs_grad].abs().sum() > 0
    torch.testing.assert_close(found[needs_grad][needs_grad], found["qkv"][needs_grad], rtol=1e-12, atol=1e-14)


def test_under_autocast_the_backward_pass_recomputes_as_the_forward_computed(monkeypatch):
    """bfloat16 autocast (as Trainer's bf16 runs): the gradients equal those of the groups differentiated by autograd
    directly, which keeps what the forward pass computed; a recomputation outside autocast would differ by bfloat16's
    rounding."""
    import attnzoo.modeling.attention.block_window as block_window

    monkeypatch.setattr(block_window, "GATHERED_KEYS", 1)
    torch.manual_seed(0)
    layer = build_attention("block_window", config(), 0, True)
    length = 40
    tensors = [torch.randn(1, heads, length, 8) for heads in (4, 2, 2)]
    position = torch.arange(length)[None]
    weights = torch.randn(1, 4, length, 8)
    found = {}
    for path in ("function", "autograd"):
        if path == "autograd":
            monkeypatch.setattr(block_window._GroupedFarTriple, "apply",
                                lambda part, group, *inputs: part._groups(group, *inputs))
        inputs = [x.clone().requires_grad_(True) for x in tensors]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer.far.parallel(FarInputs(*inputs, position < length, position))
        (out.num.float() * weights).sum().backward()
        found[path] = [x.grad for x in inputs]
    for a, b in zip(*found.values(), strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
