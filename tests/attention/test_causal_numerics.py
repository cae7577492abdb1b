"""Exact causal numerics of the linear attentions at the scale of trained models: with query/key weights of standard
deviation 6, changing the last 128 of 512 tokens must leave the earlier outputs in place, everything must stay
finite, and the parallel (training) form must equal recurrent decoding, in float32 and bf16.

Stabilising keys by one maximum over the whole sequence failed all three here (earlier outputs moved by ~1e8 for
Performer, ~1e12 for causal LARA); keys are now stabilised by their running maximum
(docs/random_feature_attention.md, section 2)."""

import copy
import math

import pytest
import torch

from attnzoo import ZooLARAConfig, ZooPerformerConfig
from attnzoo.modeling.attention import EluAttention, FavorAttention, InitialisesBuffers, LinearRandomizedAttention
from attnzoo.modeling.cache import ZooCache

KINDS = {
    "favor": (FavorAttention, ZooPerformerConfig(hidden_size=128, num_attention_heads=2, num_random_features=64)),
    "elu": (EluAttention, ZooPerformerConfig(hidden_size=128, num_attention_heads=2)),
    "lara": (LinearRandomizedAttention, ZooLARAConfig(hidden_size=128, num_attention_heads=2, lara_num_samples=8,
                                                      lara_chunk_size=64)),
}


def large_scale_layer(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    cls, config = KINDS[kind]
    attn = cls(config, 0, causal=True).eval()
    if isinstance(attn, InitialisesBuffers):
        attn.init_buffers()
    with torch.no_grad():  # q/k projections as large as a trained model's can be
        attn.q_proj.weight.normal_(0.0, 6.0)
        attn.k_proj.weight.normal_(0.0, 6.0)
    return attn.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_later_tokens_do_not_move_earlier_outputs_at_large_scale(kind, dtype):
    attn = large_scale_layer(kind, dtype)
    x = torch.randn(1, 512, 128).to(dtype)
    changed = x.clone()
    changed[:, 384:] = torch.randn(1, 128, 128).to(dtype)
    with torch.no_grad():
        before, after = attn(x), attn(changed)
    assert torch.isfinite(before).all() and torch.isfinite(after).all()
    if kind == "lara":
        # LARA's key stabiliser also covers the key features of proposals that become available later (so they
        # can never overflow); in exact arithmetic that cancels, in float it can move earlier outputs by rounding.
        torch.testing.assert_close(after[:, :384], before[:, :384], rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(after[:, :384], before[:, :384])
    if dtype == torch.float32:  # the later outputs do see the change (in bf16 one early key can dominate them)
        assert not torch.allclose(after[:, 384:], before[:, 384:])


def rounding_tolerance(attn, x, probes: int = 3) -> float:
    """How far two exact forms of `attn` may differ on `x` from rounding alone.

    Parallel training and recurrent decoding compute the same function but not from the same rounded inputs: the
    q/k/v projections of a 200-token sequence and of a single token run through different matrix-multiply kernels,
    so their last bits differ, by up to sqrt(d) units of roundoff u for a d-term dot product. At trained-model scales
    that is not small (FAVOR's log-features here reach 3.6e4, where one float32 ulp is 0.004), and how much of it
    reaches the output depends on the layer's conditioning, which differs between CPUs' kernels only through these
    last bits. So the conditioning is measured: the projections' weights are perturbed by sqrt(d) u with random signs
    (the size of that rounding) and the largest output change over a few draws, with a factor of 10 for unluckier
    rounding, is the tolerance; 4 sqrt(N r) u max|out| more covers the two forms' own sums (Higham's probabilistic
    bound for N r positive terms). A wrong recurrence (a lost or doubled token, a stale maximum) moves outputs by
    far more."""
    u = torch.finfo(x.dtype).eps
    with torch.no_grad():
        reference = attn(x).double()
        change = 0.0
        for seed in range(probes):
            generator = torch.Generator().manual_seed(seed)
            probe = copy.deepcopy(attn)
            for proj in (probe.q_proj, probe.k_proj, probe.v_proj):
                signs = torch.randint(0, 2, proj.weight.shape, generator=generator).to(x.dtype) * 2 - 1
                proj.weight.mul_(1 + math.sqrt(proj.weight.shape[1]) * u * signs)
            change = max(change, (probe(x).double() - reference).abs().max().item())
    terms = x.shape[1] * x.shape[-1]
    return 10 * change + 4 * math.sqrt(terms) * u * reference.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_parallel_form_equals_recurrent_decoding_at_large_scale(kind, dtype):
    attn = large_scale_layer(kind, dtype)
    x = torch.randn(1, 200, 128).to(dtype)
    with torch.no_grad():
        parallel = attn(x).float()
        cache = ZooCache([attn.new_cache_layer()])
        steps = [attn(x[:, :100], cache=cache)]  # a prefill, then one token at a time
        steps += [attn(x[:, t:t + 1], cache=cache) for t in range(100, 200)]
    recurrent = torch.cat(steps, dim=1).float()
    assert torch.isfinite(recurrent).all()
    if dtype == torch.bfloat16:  # 8 bits of mantissa: outputs are compared at bf16's own resolution
        torch.testing.assert_close(recurrent, parallel, rtol=1e-2, atol=1e-2 * parallel.abs().max().item())
        return
    tolerance = rounding_tolerance(attn, x)
    assert tolerance < 1e-2 * parallel.abs().max().item()  # the bound itself stays well below the outputs' size
    torch.testing.assert_close(recurrent.double(), parallel.double(), rtol=0, atol=tolerance)


def test_both_forms_agree_tightly_from_the_same_features():
    """Given the same rounded features, Performer's recurrence (a prefill, then token by token) and the chunked
    parallel form agree to the float32 summation bound: the differences above come from the inputs, not the
    recurrence."""
    from attnzoo.modeling.attention.random_features import running_max_key_features, stabilised_query_features
    from attnzoo.ops.decayed_linear_attention import decayed_linear_attention, decayed_linear_attention_step

    attn = large_scale_layer("favor", torch.float32)
    with torch.no_grad():
        q, k, v = attn._heads(torch.randn(1, 200, 128))
        phi_q = stabilised_query_features(attn.log_features(q))
        phi_k, running_max = running_max_key_features(attn.log_features(k), None, None)
        parallel = decayed_linear_attention(phi_q, phi_k, v, running_max, 64)
        out, state = decayed_linear_attention(phi_q[:, :, :100], phi_k[:, :, :100], v[:, :, :100],
                                              running_max[:, :, :100], 64, return_state=True)
        steps = [out]
        for t in range(100, 200):
            out, state = decayed_linear_attention_step(phi_q[:, :, t:t + 1], phi_k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                       running_max[:, :, t:t + 1], state)
            steps.append(out)
    terms = 200 * phi_q.shape[-1]
    bound = 4 * math.sqrt(terms) * torch.finfo(torch.float32).eps * v.abs().max().item()
    torch.testing.assert_close(torch.cat(steps, dim=2), parallel, rtol=0, atol=bound)
