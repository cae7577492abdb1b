"""Windowed chunk attention: the Triton kernels (interpreter on CPU) and FlexAttention against the PyTorch path
`torch_chunks.chunked_attention`, on the exact ChunkMasks that LocalAttention and LSHAttention build (captured from
their forward), plus a hand-made mask with rows that have no allowed key."""

import dataclasses
import warnings

import pytest
import torch

import attnzoo.modeling.attention.local as local_module
import attnzoo.modeling.attention.lsh as lsh_module
from attnzoo import ZooReformerConfig
from attnzoo.modeling.attention.local import LocalAttention
from attnzoo.modeling.attention.lsh import LSHAttention
from attnzoo.ops.chunked_attention import chunked_attention
from attnzoo.ops.chunked_attention.naive import naive_chunked_attention
from attnzoo.ops.chunked_attention.torch_chunks import ChunkMask
from attnzoo.ops.chunked_attention.torch_chunks import chunked_attention as torch_chunked_attention
from tests.attention.helpers import named
from tests.ops.triton_helpers import DEVICE, needs_triton

HIDDEN = 16


def captured_call(module, attention_cls, monkeypatch, batch, length, key_mask=None, seed=0, **overrides):
    """(q, k, v, mask, scale) of the `chunked_attention` call inside a tiny attention layer's forward."""
    values = dict(hidden_size=HIDDEN, num_attention_heads=2, lsh_chunk_length=4, lsh_full_attention_threshold=0,
                  lsh_num_buckets=4, lsh_hash_seed=seed, local_chunk_length=4, hidden_dropout_prob=0.0)
    values.update(overrides)
    causal = values.pop("causal")
    torch.manual_seed(seed)
    attn = attention_cls(ZooReformerConfig(**values), 0, causal).eval()
    calls = []

    def capture(q, k, v, mask, scale=1.0, dropout_p=0.0, save_probs=False, backend="auto"):
        assert backend == "auto"  # the plain layers let the dispatcher pick the kernel
        calls.append((q.detach(), k.detach(), v.detach(), mask, scale))
        return torch_chunked_attention(q, k, v, mask, scale, dropout_p, save_probs)

    monkeypatch.setattr(module, "chunked_attention", capture)
    with torch.no_grad():
        attn(torch.randn(batch, length, HIDDEN), attention_mask=key_mask)
    assert len(calls) == 1
    return calls[0]


def padding(batch, length):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, -3:] = False  # right padding
    if batch > 1:
        mask[1, :2] = False  # left padding
    return mask


def local_case(monkeypatch, causal):
    return captured_call(local_module, LocalAttention, monkeypatch, 2, 10, padding(2, 10), causal=causal,
                         local_num_chunks_before=1, local_num_chunks_after=1)


def lsh_case(monkeypatch, causal, window):
    return captured_call(lsh_module, LSHAttention, monkeypatch, 1, 14, padding(1, 14), causal=causal,
                         lsh_num_hashes=2, lsh_attend_to=window, lsh_num_chunks_after=1, seed=3)


def no_key_rows_case():
    """Hand-made: m = 5 and d = 6 (tiles masked at both edges), chunk 0 of row 0 all padding, causal, no self
    penalty: its queries see no key at all (probabilities 0, lse at the floor)."""
    generator = torch.Generator().manual_seed(0)
    rows, chunks, m, d = 2, 3, 5, 6
    q, k, v = (torch.randn(rows, chunks, m, d, generator=generator) for _ in range(3))
    valid = torch.rand(rows, chunks, m, generator=generator) > 0.2
    valid[0, 0] = False
    positions = torch.arange(chunks * m).view(1, chunks, m).expand(rows, -1, -1)
    mask = ChunkMask(positions, valid, before=1, after=1, causal=True)
    return q, k, v, mask, 0.5


CASES = {
    "local-causal": lambda mp: local_case(mp, True),
    "local-bidirectional": lambda mp: local_case(mp, False),
    "lsh-bucket-causal": lambda mp: lsh_case(mp, True, "bucket"),
    "lsh-chunk-bidirectional": lambda mp: lsh_case(mp, False, "chunk"),
    "no-key-rows": lambda mp: no_key_rows_case(),
}


def run(fn, q, k, v, weights_out, weights_lse):
    """(out, lse, dq, dk, dv) with a loss that weights both outputs (the LSH round combination uses the lse)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = fn(*leaves)
    loss = (out * weights_out.to(out.dtype)).sum() + (lse * weights_lse.to(lse.dtype)).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves))


def random_weights(q, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(q.shape, generator=generator), torch.randn(q.shape[:-1], generator=generator)


def test_the_captured_masks_are_the_interesting_ones(monkeypatch):
    """The cases cover padding, both window shapes, the duplicate correction actually dropping keys, rows left with
    only their own key (lse = self value) and rows with no key at all (lse = floor)."""
    for case in ("lsh-bucket-causal", "lsh-chunk-bidirectional"):
        q, k, v, mask, scale = CASES[case](monkeypatch)
        assert mask.self_penalty and mask.round_locations.shape[-1] == 2 and not mask.valid.all()
        without_rounds = dataclasses.replace(mask, round_locations=None)
        assert (mask.disallowed() & ~without_rounds.disallowed()).any()
        assert (torch_chunked_attention(q, k, v, mask, scale)[1] == -1e5).any()
    assert CASES["lsh-bucket-causal"](monkeypatch)[3].groups is not None
    _, _, _, mask, _ = CASES["local-bidirectional"](monkeypatch)
    assert (mask.before, mask.after) == (1, 1) and not mask.causal and not mask.valid.all()
    q, k, v, mask, scale = no_key_rows_case()
    _, lse = torch_chunked_attention(q, k, v, mask, scale)
    assert (lse[0, 0] == -1e9).all()


@pytest.mark.parametrize("case", list(CASES))
def test_naive_reference_matches_the_pytorch_path(case, monkeypatch):
    q, k, v, mask, scale = CASES[case](monkeypatch)
    q, k, v = q.double(), k.double(), v.double()
    weights = random_weights(q)
    got = run(lambda q, k, v: naive_chunked_attention(q, k, v, mask, scale), q, k, v, *weights)
    expected = run(lambda q, k, v: torch_chunked_attention(q, k, v, mask, scale), q, k, v, *weights)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_the_pytorch_path_in_values_lse_and_gradients(case, monkeypatch):
    q, k, v, mask, scale = CASES[case](monkeypatch)
    weights = random_weights(q)
    device_mask = ChunkMask(**{name: value.to(DEVICE) if torch.is_tensor(value) else value
                                for name, value in vars(mask).items()})
    got = run(lambda q, k, v: chunked_attention(q, k, v, device_mask, scale, backend="triton"),
              *(x.to(DEVICE) for x in (q, k, v)), *(w.to(DEVICE) for w in weights))
    expected = run(lambda q, k, v: torch_chunked_attention(q, k, v, mask, scale), q, k, v, *weights)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=2e-5, msg=named(name))


@pytest.mark.parametrize("case", list(CASES))
def test_flex_forward_matches_the_pytorch_path(case, monkeypatch):
    q, k, v, mask, scale = CASES[case](monkeypatch)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention on the CPU warns that it is unfused
        out, lse = chunked_attention(q, k, v, mask, scale, backend="flex")
        ref_out, ref_lse = torch_chunked_attention(q, k, v, mask, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_flex_block_mask_lists_exactly_the_window_blocks():
    from attnzoo.ops.chunked_attention.flex import chunk_block_mask

    positions = torch.zeros(1, 10, 16, dtype=torch.long)
    mask = ChunkMask(positions, torch.ones(1, 10, 16, dtype=torch.bool), before=2, after=1)
    block_mask = chunk_block_mask(mask, 1, 10, 16, None, "cpu", block_size=32)  # 2 chunks per block
    dense = block_mask.to_dense()[0, 0]  # [query blocks, key blocks]
    chunk = torch.arange(10)
    for q_block in range(5):
        keys = chunk[(chunk >= 2 * q_block - 2) & (chunk <= 2 * q_block + 1 + 1)] // 2
        assert dense[q_block].nonzero().flatten().tolist() == sorted(set(keys.tolist()))


def test_flex_refuses_gradients_on_the_cpu(monkeypatch):
    q, k, v, mask, scale = no_key_rows_case()
    with pytest.raises(ValueError, match="no backward on the CPU"):
        chunked_attention(q.requires_grad_(), k, v, mask, scale, backend="flex")


def test_dropout_runs_the_pytorch_path(monkeypatch):
    q, k, v, mask, scale = CASES["local-causal"](monkeypatch)
    torch.manual_seed(5)
    out, lse = chunked_attention(q, k, v, mask, scale, dropout_p=0.3, backend="triton")
    torch.manual_seed(5)
    ref_out, ref_lse = torch_chunked_attention(q, k, v, mask, scale, dropout_p=0.3)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_bad_inputs_say_what_to_change():
    q, k, v, mask, scale = no_key_rows_case()
    with pytest.raises(ValueError, match="backend"):
        chunked_attention(q, k, v, mask, backend="cuda")
    with pytest.raises(ValueError, match="must all be"):
        chunked_attention(q, k[:, :2], v, mask)
    with pytest.raises(ValueError, match=r"positions and valid must be"):
        chunked_attention(q[:1], k[:1], v[:1], mask)


@pytest.mark.parametrize("backend", ["torch", "triton", "flex", "naive"])
@pytest.mark.parametrize("case", ["local-causal", "lsh-chunk-bidirectional"])
def test_a_row_with_nan_inputs_leaves_every_other_row_unchanged(case, backend, monkeypatch):
    """A window at the end of a row reads the neighbouring row's chunks (masked, probability 0), and 0 * NaN is NaN:
    one example's NaN must not reach another example's outputs, on any backend."""
    q, k, v, mask, scale = CASES[case](monkeypatch)
    if mask.before == 0 and mask.after == 0:
        pytest.skip("no window leaves its row")
    poisoned = 1
    bad = [x.clone() for x in (q, k, v)]
    for x in bad:
        x[poisoned] = float("nan")

    def call(q, k, v):
        if backend == "naive":
            return naive_chunked_attention(q, k, v, mask, scale)[0]
        device_mask = ChunkMask(**{name: value.to(DEVICE) if torch.is_tensor(value) else value
                                    for name, value in vars(mask).items()}) if backend == "triton" else mask
        device = DEVICE if backend == "triton" else "cpu"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention on the CPU warns that it is unfused
            out, _ = chunked_attention(*(x.to(device) for x in (q, k, v)), device_mask, scale, backend=backend)
        return out.cpu()

    with torch.no_grad():
        clean, dirty = call(q, k, v), call(*bad)
    others = [row for row in range(q.shape[0]) if row != poisoned]
    assert torch.isnan(dirty[poisoned]).any()  # the poisoned row itself still shows its NaN
    torch.testing.assert_close(dirty[others], clean[others], rtol=0, atol=0)
