"""The CPU flash path of causal sliding-window attention with sinks against its dense reference: outputs,
log-sum-exps and gradients (through the output alone, and through both), in float64, over the layouts that take
the pieces' edge cases (one block, lengths that are not whole blocks, a one-token window, sinks wider than the
window, grouped heads, sink queries of their own, a constant own-key score)."""

import pytest
import torch

from attnzoo.ops.window_attention.flash_cpu import flash_cpu_available, flash_window_attention
from attnzoo.ops.window_attention.naive import naive_window_attention

pytestmark = pytest.mark.skipif(not flash_cpu_available(), reason="this PyTorch has no CPU flash-attention kernels")

CASES = {  # batch, heads, kv heads (or key heads, value heads), length, window, sinks, sink queries, own score
    "blocks_and_sinks": (2, 4, 2, 37, 8, 2, False, None),
    "sink_queries": (1, 3, 1, 50, 16, 4, True, None),
    "one_block": (2, 2, 2, 20, 32, 3, False, None),
    "own_score": (1, 2, 1, 33, 4, 2, True, -30.0),
    "one_token_window": (1, 2, 2, 9, 1, 2, False, -5.0),
    "one_token_window_no_sinks": (1, 2, 2, 9, 1, 0, False, None),
    "own_score_no_sinks": (1, 2, 1, 12, 3, 0, False, -3.0),
    "keys_per_query_head": (1, 4, (4, 2), 21, 5, 2, True, None),
    "more_sinks_than_window": (1, 2, 2, 17, 4, 6, False, None),
    "whole_blocks": (1, 2, 1, 16, 4, 1, False, None),
}


def inputs(batch, heads, kv_heads, length, sink_queries, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def draw(h):
        return torch.randn(batch, h, length, 8, dtype=dtype, generator=gen).requires_grad_()

    key_heads, value_heads = kv_heads if isinstance(kv_heads, tuple) else (kv_heads, kv_heads)
    return draw(heads), draw(key_heads), draw(value_heads), draw(heads) if sink_queries else None


def outputs_and_gradients(fn, q, k, v, sink_q, window, sinks, own_score, through_lse):
    out, lse = fn(q, k, v, window, sinks, 0.4, sink_q=sink_q, own_score=own_score)
    gen = torch.Generator().manual_seed(5)
    loss = (out * torch.randn(out.shape, dtype=out.dtype, generator=gen)).sum()
    if through_lse:
        loss = loss + (lse * torch.randn(lse.shape, dtype=lse.dtype, generator=gen)).sum()
    leaves = [x for x in (q, k, v, sink_q) if x is not None]
    return [out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("through_lse", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_flash_path_equals_the_dense_reference(case, through_lse):
    batch, heads, kv_heads, length, window, sinks, sink_queries, own_score = CASES[case]
    q, k, v, sink_q = inputs(batch, heads, kv_heads, length, sink_queries)
    got, expected = (outputs_and_gradients(fn, q, k, v, sink_q, window, sinks, own_score, through_lse)
                     for fn in (flash_window_attention, naive_window_attention))
    names = ["out", "lse", "dq", "dk", "dv", "dsink_q"]
    for name, a, b in zip(names, got, expected, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_the_reference_sees_only_the_window_and_the_sinks():
    """The comparison can fail: moving one key outside a query's window changes that query's output, in both."""
    q, k, v, _ = inputs(1, 2, 2, 12, False)
    base = flash_window_attention(q, k, v, 4, 1, 0.4)[0]
    wider = flash_window_attention(q, k, v, 5, 1, 0.4)[0]
    # every key of the first 4 queries is in both windows (query 4 sees sink 0 as a sink in one, in the window in
    # the other: the same key, the same output)
    torch.testing.assert_close(base[:, :, :5], wider[:, :, :5], rtol=1e-12, atol=1e-13)
    assert (base[:, :, 5:] - wider[:, :, 5:]).abs().amax() > 1e-3
    torch.testing.assert_close(wider, naive_window_attention(q, k, v, 5, 1, 0.4)[0], rtol=1e-10, atol=1e-12)


def test_bfloat16_follows_float64():
    q, k, v, sink_q = inputs(1, 4, 2, 40, True, seed=3)
    exact = flash_window_attention(q, k, v, 8, 2, 0.4, sink_q=sink_q)[0]
    low = flash_window_attention(*(x.bfloat16() for x in (q, k, v)), 8, 2, 0.4, sink_q=sink_q.bfloat16())[0]
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), exact, rtol=3e-2, atol=3e-2)
