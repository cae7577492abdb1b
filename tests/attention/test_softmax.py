"""Exact attention: the SDPA path against the written-out reference, masks, the KV cache and cross-attention."""

import pytest
import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from attnzoo import ZooSoftmaxConfig
from attnzoo.modeling.attention import ATTENTION_REGISTRY, SoftmaxAttention, SoftmaxCrossAttention
from attnzoo.modeling.attention.base import allowed_keys
from attnzoo.modeling.cache import ZooCache
from tests.attention.helpers import assert_same_values_and_gradients


def config(**kw):
    values = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
                  attention_probs_dropout_prob=0.0)
    values.update(kw)
    return ZooSoftmaxConfig(**values)


def attention(causal):
    torch.manual_seed(0)
    return SoftmaxAttention(config(), layer_idx=0, causal=causal).double().eval()


def padding_mask(lengths, total, left=False):
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = 1 if left else 0
        if not left:
            mask[row, :n] = 1
    return mask


def test_registry_names_full_softmax():
    assert ATTENTION_REGISTRY["full"] is SoftmaxAttention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left", [False, True])
def test_sdpa_path_equals_reference(causal, left):
    attn = attention(causal)
    x = torch.randn(3, 11, 32, dtype=torch.double, requires_grad=True)
    mask = padding_mask([11, 7, 3], 11, left=left)
    for m in (None, mask):
        fast = attn(x, attention_mask=m)
        slow = attn.reference_forward(x, attention_mask=m)
        assert_same_values_and_gradients(attn, x, None if m is None else m.bool(), fast, slow)


def test_reference_equals_hand_computed_softmax():
    q = torch.randn(1, 1, 4, 8, dtype=torch.double)
    k, v = torch.randn_like(q), torch.randn_like(q)
    from attnzoo.modeling.attention import softmax_attention_reference

    expected = torch.stack([
        sum(torch.exp(q[0, 0, i] @ k[0, 0, j] / 8 ** 0.5) * v[0, 0, j] for j in range(i + 1))
        / sum(torch.exp(q[0, 0, i] @ k[0, 0, j] / 8 ** 0.5) for j in range(i + 1))
        for i in range(4)
    ])
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.testing.assert_close(softmax_attention_reference(q, k, v, causal)[0, 0], expected)


def test_padded_keys_get_no_weight():
    attn = attention(causal=False)
    x = torch.randn(1, 6, 32, dtype=torch.double)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    changed = x.clone()
    changed[:, 4:] = torch.randn(1, 2, 32, dtype=torch.double) * 100
    torch.testing.assert_close(attn(x, attention_mask=mask)[:, :4], attn(changed, attention_mask=mask)[:, :4])


def test_fully_padded_query_rows_are_finite():
    allowed = allowed_keys(torch.tensor([[False, False, True]]), 3, 3, causal=True, device="cpu")
    assert allowed.any(-1).all(), "every query row must allow at least one key"
    attn = attention(causal=True)
    out = attn(torch.randn(1, 3, 32, dtype=torch.double), attention_mask=torch.tensor([[0, 0, 1]]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("step", [1, 3])
def test_cached_incremental_equals_full(step):
    attn = attention(causal=True)
    x = torch.randn(2, 12, 32, dtype=torch.double)
    full = attn(x)
    cache = ZooCache([attn.new_cache_layer()])
    pieces = [attn(x[:, i:i + step], cache=cache) for i in range(0, 12, step)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-12)
    assert cache.get_seq_length() == 12


def test_cross_attention_cache_computes_encoder_keys_once():
    torch.manual_seed(0)
    cross = SoftmaxCrossAttention(config(), layer_idx=0).double().eval()
    enc = torch.randn(2, 5, 32, dtype=torch.double)
    enc_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    dec = torch.randn(2, 4, 32, dtype=torch.double)
    full = cross(dec, enc, enc_mask)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    first = cross(dec[:, :2], enc, enc_mask, cache)
    second = cross(dec[:, 2:], enc * 0 + 1e6, enc_mask, cache)  # the cached keys must be reused, not recomputed
    torch.testing.assert_close(torch.cat([first, second], dim=1), full)


def test_mask_of_wrong_length_raises():
    attn = attention(causal=False)
    with pytest.raises(ValueError, match="expected"):
        attn(torch.randn(2, 5, 32, dtype=torch.double), attention_mask=torch.ones(2, 6))
