"""Local (chunked) attention: the fast path against its dense reference (values and gradients), the exact window
it sees, and decoding by index."""

import itertools

import pytest
import torch

from attnzoo.modeling.attention.local import LocalAttention
from tests.attention.helpers import HIDDEN, assert_same_values_and_gradients, config, padding_mask


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
