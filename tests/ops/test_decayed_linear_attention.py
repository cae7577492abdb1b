"""Decayed causal linear attention: the chunked PyTorch path and the Triton kernels (interpreter on CPU) against the
quadratic reference, in values and gradients; causality and finiteness under large running-max jumps; prefill +
continuation = one call; the recurrent decoding step."""

import pytest
import torch

from attnzoo.ops.decayed_linear_attention import (
    decayed_cumsum,
    decayed_linear_attention,
    decayed_linear_attention_step,
)
from attnzoo.ops.decayed_linear_attention.naive import naive_decayed_linear_attention, naive_final_state
from tests.ops.triton_helpers import DEVICE, needs_triton

JUMP = 200.0  # a running-max jump far beyond float32's exp range (exp(-200) underflows to 0 there)


def features(batch, heads, length, r, e, jumps=(), seed=0, dtype=torch.float64):
    """(φq, φk, v, M) as a Performer-style layer makes them: log-features ℓ, M = running max over positions of the
    per-key max of ℓ, φk = exp(ℓk - M) <= 1, φq = exp(ℓq - its row max) <= 1. At each position in `jumps` every
    later key's log-features rise by JUMP."""
    generator = torch.Generator().manual_seed(seed)
    log_q = 2 * torch.randn(batch, heads, length, r, generator=generator, dtype=torch.float64)
    log_k = 2 * torch.randn(batch, heads, length, r, generator=generator, dtype=torch.float64)
    for position in jumps:
        log_k[:, :, position:] += JUMP
    running_max = torch.cummax(log_k.amax(-1), dim=-1).values
    phi_q = (log_q - log_q.amax(-1, keepdim=True)).exp()
    phi_k = (log_k - running_max[..., None]).exp()
    v = torch.randn(batch, heads, length, e, generator=generator, dtype=torch.float64)
    return phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), running_max.to(dtype)


def scaled_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def values_and_grads(fn, inputs, weights):
    """fn's output and the gradients of <output, weights> with respect to `inputs` (leaves made here)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad((out * weights.to(out.dtype)).sum(), leaves)


def reference(q, k, v, m):
    return naive_decayed_linear_attention(q, k, v, m.to(q.dtype))


# -- the decayed prefix sum ------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 5, 32, 33, 100, 1100])  # 1100 > 32 * 32: three levels of blocks
def test_decayed_cumsum_matches_the_recurrence(length):
    generator = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, 3, generator=generator, dtype=torch.float64)
    levels = torch.rand(2, length, generator=generator, dtype=torch.float64).cumsum(-1)
    levels[:, length // 3:] += JUMP
    expected, total = [], torch.zeros(2, 3, dtype=torch.float64)
    for j in range(length):  # Y_j = exp(E_{j-1} - E_j) Y_{j-1} + X_j
        decay = (levels[:, j - 1] - levels[:, j]).exp()[:, None] if j else 1.0
        total = decay * total + x[:, j]
        expected.append(total)
    torch.testing.assert_close(decayed_cumsum(x, levels), torch.stack(expected, 1), rtol=1e-12, atol=1e-12)


def test_decayed_cumsum_gradient_is_the_decayed_suffix_sum():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(70, 2, generator=generator, dtype=torch.float64, requires_grad=True)  # two levels
    levels = (3 * torch.rand(70, generator=generator, dtype=torch.float64)).cumsum(-1)
    assert torch.autograd.gradcheck(lambda x: decayed_cumsum(x, levels), (x,), fast_mode=True)


# -- the chunked PyTorch path ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("length", "chunk_size"), [(1, 16), (5, 16), (16, 16), (40, 16), (100, 32), (37, 7),
                                                   (300, 8)])
def test_chunked_matches_naive_in_float64(length, chunk_size):
    q, k, v, m = features(2, 2, length, 6, 5, jumps=(length // 3, length // 2))
    weights = torch.randn(2, 2, length, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out, grads = values_and_grads(
        lambda q, k, v: decayed_linear_attention(q, k, v, m, chunk_size=chunk_size, backend="torch"), (q, k, v),
        weights)
    ref, ref_grads = values_and_grads(lambda q, k, v: reference(q, k, v, m), (q, k, v), weights)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-11)


def test_chunked_float32_matches_the_float64_reference():
    q, k, v, m = features(2, 3, 300, 16, 8, jumps=(100, 211), dtype=torch.float32)
    weights = torch.randn(2, 3, 300, 8, generator=torch.Generator().manual_seed(3))
    out, grads = values_and_grads(lambda q, k, v: decayed_linear_attention(q, k, v, m, backend="torch"), (q, k, v),
                                  weights)
    # the reference sees the same float32-rounded inputs, in float64
    ref, ref_grads = values_and_grads(lambda q, k, v: reference(q, k, v, m), (x.double() for x in (q, k, v)),
                                      weights)
    assert out.dtype == torch.float32
    assert scaled_error(out, ref) < 1e-5
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert scaled_error(grad, ref_grad) < 1e-5


def test_half_precision_inputs_accumulate_and_return_float32():
    q, k, v, m = features(1, 2, 50, 8, 4, jumps=(20,))
    out = decayed_linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), m.float(), chunk_size=16,
                                   backend="torch")
    assert out.dtype == torch.float32
    ref = reference(*(x.bfloat16().double() for x in (q, k, v)), m.float())
    assert scaled_error(out, ref) < 1e-5


def test_large_jumps_stay_finite_and_later_inputs_do_not_move_earlier_outputs():
    q, k, v, m = features(1, 2, 256, 16, 8, jumps=(30, 64, 150), dtype=torch.float32)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = decayed_linear_attention(q, k, v, m, chunk_size=64, backend="torch")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    q, k, v = q.detach(), k.detach(), v.detach()
    for p in (128, 100):  # a chunk boundary, then a position inside a chunk
        q2, k2, v2, m2 = features(1, 2, 256, 16, 8, jumps=(30, 64, 150, p + 3), seed=9, dtype=torch.float32)
        # new inputs from p on; the running max stays nondecreasing (it only rises by the new jump)
        joined = [torch.cat([a[:, :, :p], b[:, :, p:]], dim=2) for a, b in ((q, q2), (k, k2), (v, v2))]
        new_max = torch.cat([m[..., :p], torch.maximum(m2[..., p:], m[..., p - 1:p])], dim=-1)
        changed = decayed_linear_attention(*joined, new_max, chunk_size=64, backend="torch")
        assert not torch.equal(changed[:, :, p:], out[:, :, p:])
        if p % 64 == 0:
            assert torch.equal(changed[:, :, :p], out[:, :, :p])
        else:
            torch.testing.assert_close(changed[:, :, :p], out[:, :, :p], rtol=1e-6, atol=0)


def test_a_query_that_sees_no_key_outputs_zero():
    q, k, v, m = features(1, 1, 20, 4, 3)
    k[:, :, :3] = 0.0  # padded keys
    out = decayed_linear_attention(q, k, v, m, chunk_size=8, backend="torch")
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    torch.testing.assert_close(out, reference(q, k, v, m), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("split", [45, 48])
def test_initial_state_continues_a_prefill_exactly(split):
    q, k, v, m = features(2, 2, 70, 6, 5, jumps=(20, 50))
    weights = torch.randn(2, 2, 70, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def in_two_calls(q, k, v):
        first, state = decayed_linear_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], m[..., :split],
                                                chunk_size=16, return_state=True, backend="torch")
        second = decayed_linear_attention(q[:, :, split:], k[:, :, split:], v[:, :, split:], m[..., split:],
                                          chunk_size=16, initial_state=state, backend="torch")
        return torch.cat([first, second], dim=2)

    out, grads = values_and_grads(in_two_calls, (q, k, v), weights)
    ref, ref_grads = values_and_grads(lambda q, k, v: reference(q, k, v, m), (q, k, v), weights)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):  # gradients flow back through the state
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-11)
    _, (s, z, last) = decayed_linear_attention(q, k, v, m, chunk_size=16, return_state=True, backend="torch")
    ref_s, ref_z, ref_last = naive_final_state(k, v, m)
    torch.testing.assert_close(s, ref_s, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z, ref_z, rtol=1e-12, atol=1e-14)
    assert torch.equal(last, ref_last)


def test_recurrent_steps_match_the_chunked_form():
    q, k, v, m = features(2, 2, 24, 6, 5, jumps=(7, 15))
    state, outs = None, []
    for t in range(20):
        out, state = decayed_linear_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                   m[..., t:t + 1], state)
        outs.append(out)
    # the last 4 tokens in one multi-token step
    out, state = decayed_linear_attention_step(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], m[..., 20:], state)
    outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), reference(q, k, v, m), rtol=1e-10, atol=1e-12)
    for got, expected in zip(state, naive_final_state(k, v, m), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_bad_inputs_say_what_to_change(monkeypatch):
    q, k, v, m = features(1, 2, 10, 4, 3)
    with pytest.raises(ValueError, match="running_max must be"):
        decayed_linear_attention(q, k, v, m[..., :5])
    with pytest.raises(ValueError, match="v must be"):
        decayed_linear_attention(q, k, v[:, :, :5], m)
    with pytest.raises(ValueError, match="chunk_size"):
        decayed_linear_attention(q, k, v, m, chunk_size=0)
    with pytest.raises(ValueError, match="backend"):
        decayed_linear_attention(q, k, v, m, backend="cuda")
    with pytest.raises(ValueError, match="initial_state shapes"):
        decayed_linear_attention(q, k, v, m, initial_state=(q, k, m))
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            decayed_linear_attention(q.float(), k.float(), v.float(), m.float(), backend="triton")


@needs_triton
def test_inputs_the_kernels_cannot_take_go_to_pytorch_under_auto_and_raise_under_triton():
    """The first GPU run reached the kernels through "auto" with float64 inputs and with a chunk size they have no
    tiles for; "auto" now picks the PyTorch path for those, and an explicit "triton" says what to change."""
    from types import SimpleNamespace

    from attnzoo.ops.triton_utils import resolve_backend

    q, k, v, m = features(1, 2, 10, 4, 3)
    with pytest.raises(ValueError, match=r"chunk_size=4 \(the Triton kernels take one of"):
        decayed_linear_attention(*(x.float().to(DEVICE) for x in (q, k, v, m)), chunk_size=4, backend="triton")
    with pytest.raises(ValueError, match="inputs are float64"):
        decayed_linear_attention(*(x.to(DEVICE) for x in (q, k, v, m)), chunk_size=16, backend="triton")
    on_cuda = SimpleNamespace(is_cuda=True, dtype=torch.float32)
    assert resolve_backend("auto", on_cuda, "op") == "triton"
    assert resolve_backend("auto", on_cuda, "op", "chunk_size=4") == "torch"
    assert resolve_backend("auto", SimpleNamespace(is_cuda=True, dtype=torch.float64), "op") == "torch"
    got = decayed_linear_attention(*(x.to(DEVICE) for x in (q, k, v, m)), chunk_size=4)
    torch.testing.assert_close(got.cpu(), reference(q, k, v, m), rtol=1e-10, atol=1e-12)


# -- the Triton kernels ----------------------------------------------------------------------------------------
def triton_case(length, r, e, chunk_size, jumps, seed=0, dtype=torch.float32):
    q, k, v, m = features(1, 2, length, r, e, jumps=jumps, seed=seed, dtype=torch.float32)
    weights = torch.randn(1, 2, length, e, generator=torch.Generator().manual_seed(seed + 1))
    out, grads = values_and_grads(
        lambda q, k, v: decayed_linear_attention(q, k, v, m.to(DEVICE), chunk_size=chunk_size, backend="triton"),
        (x.to(DEVICE, dtype) for x in (q, k, v)), weights.to(DEVICE))
    ref, ref_grads = values_and_grads(lambda q, k, v: reference(q, k, v, m),
                                      (x.to(dtype).double() for x in (q, k, v)), weights)
    return (out, *grads), (ref, *ref_grads)


@needs_triton
@pytest.mark.parametrize(("length", "r", "e", "chunk_size"), [
    (40, 16, 8, 16),  # a partial last chunk
    (21, 72, 20, 16),  # r over two 64-wide tiles, both feature dims masked at the edge
    (9, 16, 8, 16),  # shorter than one chunk
])
def test_triton_matches_naive_in_values_and_gradients(length, r, e, chunk_size):
    got, expected = triton_case(length, r, e, chunk_size, jumps=(length // 3, 2 * length // 3))
    assert got[0].dtype == torch.float32
    for a, b in zip(got, expected, strict=True):
        assert scaled_error(a.cpu(), b) < 2e-5


@needs_triton
def test_triton_half_precision_inputs():
    got, expected = triton_case(40, 16, 8, 16, jumps=(13,), dtype=torch.float16)
    for a, b in zip(got, expected, strict=True):  # fp16 dot operands, float32 accumulation
        assert scaled_error(a.cpu(), b) < 1e-2


@needs_triton
def test_triton_initial_and_final_state_with_gradients():
    q, k, v, m = features(1, 2, 40, 16, 8, jumps=(10, 30), dtype=torch.float32)
    split = 18
    _, state = decayed_linear_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], m[..., :split],
                                        return_state=True, backend="torch")
    s0, z0, m0 = state
    generator = torch.Generator().manual_seed(5)
    w_out, w_s, w_z = (torch.randn(*shape, generator=generator) for shape in
                       ((1, 2, 40 - split, 8), (1, 2, 16, 8), (1, 2, 16)))

    def run(backend, device, dtype):
        leaves = [x.to(device, dtype).requires_grad_() for x in (q[:, :, split:], k[:, :, split:], v[:, :, split:],
                                                                 s0, z0)]
        out, (s, z, last) = decayed_linear_attention(
            *leaves[:3], m[..., split:].to(device), chunk_size=16, initial_state=(leaves[3], leaves[4], m0.to(device)),
            return_state=True, backend=backend)
        loss = (out * w_out.to(device, out.dtype)).sum() + (s * w_s.to(device, s.dtype)).sum() + (
            z * w_z.to(device, z.dtype)).sum()
        return [out, s, z, *torch.autograd.grad(loss, leaves)]

    got = run("triton", DEVICE, torch.float32)
    expected = run("torch", "cpu", torch.float64)
    for a, b in zip(got, expected, strict=True):
        assert scaled_error(a.cpu(), b) < 2e-5
