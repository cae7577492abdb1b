"""The PyTorch windowed chunk-attention kernel that LSH and local attention share
(`ops/chunked_attention/torch_chunks.py`): its backward against autograd of the same math, and the
duplicate-correction mask against a dense construction."""

import pytest
import torch

from attnzoo.ops.chunked_attention.torch_chunks import ChunkMask, chunked_attention, neighbour_chunks


@pytest.mark.parametrize("save_probs", [False, True])
def test_chunked_attention_backward_equals_autograd_of_the_same_math(save_probs):
    torch.manual_seed(0)
    n, chunks, m, d = 6, 3, 4, 5  # 2 groups of 3 hash rounds
    q, k, v = (torch.randn(n, chunks, m, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    positions = torch.arange(chunks * m).view(1, chunks, m).expand(n, -1, -1)
    valid = torch.rand(n, chunks, m) > 0.2
    valid[0, 0] = False  # a chunk whose queries see nothing (padding): finite, no gradient
    mask = ChunkMask(positions, valid, before=1, after=1, causal=True, self_penalty=True,
                      groups=torch.randint(0, 2, (n, chunks, m)), group_band=(-5, 2),
                      round_locations=torch.randint(0, 4, (n, chunks, m, 3)), round_band=(-1, 1))

    def plain(q, k, v):
        scores = mask.apply_(q @ neighbour_chunks(k, 1, 1, 0, 1).transpose(-1, -2) * 0.5)
        lse = scores.logsumexp(-1).clamp(min=-1e9)
        probs = (scores - lse[..., None]).exp()
        # rows left with only their own (penalised, constant) key carry no gradient to it
        only_self = (lse <= -5e4)[..., None]
        probs = torch.where(only_self, probs.detach(), probs)
        return probs @ neighbour_chunks(v, 1, 1, 0, 1), lse

    fast, slow = chunked_attention(q, k, v, mask, 0.5, 0.0, save_probs), plain(q, k, v)
    assert torch.isfinite(fast[0]).all() and torch.isfinite(fast[1]).all()
    weights = [torch.randn_like(t) for t in fast]
    grads = [torch.autograd.grad(sum((t * w).sum() for t, w in zip(out, weights, strict=True)), (q, k, v))
             for out in (fast, slow)]
    for a, b in zip(fast + grads[0], slow + grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    def with_dropout(q, k, v):
        torch.manual_seed(5)  # the same dropout mask on every call
        return chunked_attention(q, k, v, mask, 0.5, 0.3, save_probs)

    assert torch.autograd.gradcheck(with_dropout, (q, k, v))


def test_window_mask_drops_keys_an_earlier_round_listed():
    # Rows of 3 hash rounds: a round-r row may use a window key only if no round before r listed it (its location
    # gap there within the band); written out densely per (group, round, query, key).
    torch.manual_seed(1)
    groups, rounds, chunks, m, before, after, band = 2, 3, 4, 2, 1, 0, (-2, 1)
    n, width = groups * rounds, (before + 1 + after) * m
    positions = torch.arange(chunks * m).view(1, chunks, m).expand(n, -1, -1)
    valid = torch.rand(n, chunks, m) > 0.1
    locations = torch.randint(0, 6, (n, chunks, m, rounds))
    plain = ChunkMask(positions, valid, before, after)
    mask = ChunkMask(positions, valid, before, after, round_locations=locations, round_band=band)
    key_locations = neighbour_chunks(locations, before, after, 0, rest_dims=1)  # [n, C, W, R]
    gap = key_locations[:, :, None, :, :] - locations[:, :, :, None, :]  # [n, C, m, W, R]
    listed = (gap >= band[0]) & (gap <= band[1])
    round_of_row = torch.arange(n) % rounds
    earlier = torch.arange(rounds)[None, :] < round_of_row[:, None]  # [n, R]: round e is before the row's round
    listed_earlier = (listed & earlier[:, None, None, None, :]).any(-1)
    expected = plain.disallowed() | listed_earlier
    assert listed_earlier[round_of_row == 0].sum() == 0 and listed_earlier.any()
    assert mask.disallowed().shape == (n, chunks, m, width)
    torch.testing.assert_close(mask.disallowed(), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="whole groups"):
        ChunkMask(positions[:5], valid[:5], before, after, round_locations=locations[:5], round_band=band).disallowed()


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_float32_probabilities_with_bfloat16_inputs_give_bfloat16_gradients(dropout_p, monkeypatch):
    """CUDA autocast runs the forward's softmax in float32 and the matmuls in bfloat16, so the backward meets float32
    probabilities beside bfloat16 values and output gradients (the first GPU run failed there). The softmax is made
    float32 here the same way, on the CPU; the gradients must come back in the inputs' dtype and equal those of the
    float32 probabilities applied in float64 to the same bfloat16 inputs."""
    from attnzoo.ops.chunked_attention import torch_chunks

    bf16_softmax = torch_chunks._softmax_

    def float32_softmax(scores):
        probs, lse = bf16_softmax(scores.float())
        return probs, lse

    torch.manual_seed(2)
    n, chunks, m, d = 2, 3, 4, 8
    q, k, v = (torch.randn(n, chunks, m, d).bfloat16().requires_grad_() for _ in range(3))
    positions = torch.arange(chunks * m).view(1, chunks, m).expand(n, -1, -1)
    mask = ChunkMask(positions, torch.ones(n, chunks, m, dtype=torch.bool), before=1, after=0, causal=True)
    expected = torch.autograd.grad(_summed(chunked_attention(q, k, v, mask, 0.5, 0.0)[0]), (q, k, v))
    monkeypatch.setattr(torch_chunks, "_softmax_", float32_softmax)
    torch.manual_seed(3)
    out, _ = chunked_attention(q, k, v, mask, 0.5, dropout_p)
    grads = torch.autograd.grad(_summed(out), (q, k, v))
    assert all(g.dtype == torch.bfloat16 for g in grads)
    if dropout_p == 0.0:  # the same math as the all-bfloat16 run, up to bfloat16 rounding of the probabilities
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)


def _summed(out: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype)
    return (out * weights).sum()


def test_backward_outside_autocast_takes_mixed_dtype_inputs(monkeypatch):
    """Under autocast q can be bfloat16 beside float32 keys and values (shared QK's normalised keys are made in
    float32), and the forward's matmuls cast them; the backward runs outside autocast, so it must cast them itself
    (a reversible Reformer's bfloat16 backward failed on the GPU). The gradients come back in each input's dtype and
    equal those of the all-bfloat16 run. The softmax runs in float32 under autocast here, as CUDA autocast runs it:
    the backward's recomputed probabilities must be those float32 ones, the probabilities a recomputing forward
    saves (`save_probs`, a reversible stack's replay), or the two stacks' gradients differ."""
    from attnzoo.ops.chunked_attention import torch_chunks

    plain_softmax = torch_chunks._softmax_
    monkeypatch.setattr(torch_chunks, "_softmax_", lambda scores: plain_softmax(
        scores.float() if torch.is_autocast_enabled("cpu") else scores))
    torch.manual_seed(4)
    n, chunks, m, d = 2, 3, 4, 8
    q = torch.randn(n, chunks, m, d).bfloat16().requires_grad_()
    k, v = (torch.randn(n, chunks, m, d).requires_grad_() for _ in range(2))
    positions = torch.arange(chunks * m).view(1, chunks, m).expand(n, -1, -1)
    mask = ChunkMask(positions, torch.ones(n, chunks, m, dtype=torch.bool), before=1, after=0, causal=True)
    runs = []
    for save_probs in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = chunked_attention(q, k, v, mask, 0.5, 0.0, save_probs)
        runs.append(torch.autograd.grad(_summed(out), (q, k, v)))
    grads = runs[0]
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]
    for got, saved in zip(*runs, strict=True):
        torch.testing.assert_close(got, saved, rtol=0, atol=0)
    same = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(_summed(chunked_attention(*same, mask, 0.5, 0.0)[0]), same)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
