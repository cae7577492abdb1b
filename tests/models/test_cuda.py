"""GPU-only checks of what the CPU suite cannot reach: CUDA RNG replay and autocast in the reversible backward, the
LSH/local paths on CUDA against the CPU, cached decoding there, and graph-captured (CUDA graph) static decoding.
They run wherever CUDA is available (the project's GPU sessions); the CPU suite covers the same logic on the CPU.
(The fused kernels' own tests are in tests/ops, which run on CPU through Triton's interpreter.)"""

import pytest
import torch

from attnzoo import ZooReformerForCausalLM, ZooSoftmaxConfig, ZooSoftmaxForCausalLM
from attnzoo.modeling.attention import Recomputation
from attnzoo.modeling.attention.local import LocalAttention
from attnzoo.modeling.attention.lsh import LSHAttention
from tests.attention.helpers import (
    HIDDEN,
    assert_cached_decoding_equals_full_forward,
    config,
    decoding_model,
    lm_config,
    named,
    padding_mask,
)
from tests.models.test_static_cache import compiled_static_decode, static_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _grads(model, ids, use_reversible_backward, autocast_dtype=None):
    for module in model.modules():
        if hasattr(module, "use_reversible_backward"):
            module.use_reversible_backward = use_reversible_backward
    model.zero_grad()
    torch.manual_seed(7)
    with torch.autocast("cuda", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_reversible_backward_on_cuda_replays_dropout_and_autocast(autocast_dtype):
    torch.manual_seed(0)
    config = ZooSoftmaxConfig(vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                              intermediate_size=128, max_position_embeddings=256, hidden_dropout_prob=0.1,
                              drop_path_rate=0.1, attention_probs_dropout_prob=0.1, reversible=True, is_decoder=True)
    dtype = torch.float64 if autocast_dtype is None else torch.float32
    model = ZooSoftmaxForCausalLM(config).to("cuda", dtype).train()
    ids = torch.randint(0, 64, (2, 200), device="cuda")
    loss_rev, grads_rev = _grads(model, ids, True, autocast_dtype)
    loss_ref, grads_ref = _grads(model, ids, False, autocast_dtype)
    torch.testing.assert_close(loss_rev, loss_ref, rtol=0, atol=0)
    tol = dict(rtol=1e-6, atol=1e-9) if autocast_dtype is None else dict(rtol=5e-2, atol=5e-3)
    for name in grads_ref:
        torch.testing.assert_close(grads_rev[name], grads_ref[name], **tol, msg=named(name))


# -- LSH and local attention ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["lsh", "local"])
def test_fast_path_equals_cpu_with_the_same_buckets(kind):
    torch.manual_seed(0)
    cls = LSHAttention if kind == "lsh" else LocalAttention
    attn = cls(config(lsh_num_hashes=3), 0, causal=True).double()
    x = torch.randn(2, 29, HIDDEN, dtype=torch.float64)
    mask = padding_mask(2, 29)
    outputs = []
    saved = {}
    for device in ("cpu", "cuda"):
        attn = attn.to(device)
        xd = x.detach().clone().to(device).requires_grad_()  # a leaf on each device (x.to("cpu") is x itself)
        # The CUDA run replays the buckets the CPU run drew (the two devices' RNGs differ).
        record = Recomputation(replaying=bool(saved), saved={k: v.to(device) for k, v in saved.items()})
        out = attn(xd, attention_mask=mask.to(device), recompute=record)
        saved = saved or record.saved
        out.pow(2).sum().backward()
        outputs.append([out.detach().cpu(), xd.grad.cpu()] + [p.grad.cpu() for p in attn.parameters()])
        attn.zero_grad()
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_reversible_backward_with_hashing_replays_buckets_dropout_and_autocast(autocast_dtype):
    torch.manual_seed(0)
    config = lm_config(reversible=True, hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.1,
                       local_attention_probs_dropout_prob=0.1, lsh_hash_seed=None, num_hidden_layers=4,
                       chunk_size_feed_forward=8, max_position_embeddings=256)
    dtype = torch.float64 if autocast_dtype is None else torch.float32
    model = ZooReformerForCausalLM(config).to("cuda", dtype).train()
    ids = torch.randint(2, 37, (2, 150), device="cuda")
    results = []
    for use_reversible_backward in (True, False):
        model.model.transformer.use_reversible_backward = use_reversible_backward
        model.zero_grad()
        torch.manual_seed(7)
        with torch.autocast("cuda", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    tol = dict(rtol=1e-6, atol=1e-9) if autocast_dtype is None else dict(rtol=5e-2, atol=5e-3)
    for name in results[1][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], **tol, msg=named(name))


def test_cached_decoding_equals_the_full_forward():
    model = decoding_model(max_position_embeddings=64).to("cuda")
    assert_cached_decoding_equals_full_forward(model, torch.randint(2, 37, (2, 30), device="cuda"), prefix=11)


@pytest.mark.parametrize("name", ["softmax_rotary_gqa", "ra", "favor", "elu", "lara", "reformer", "hybrid"])
def test_graph_captured_static_decoding_equals_eager(name):
    """A static cache's decode step compiled with mode="reduce-overhead" (inductor + CUDA graphs: the graph is
    recorded once and replayed, in place on the cache's fixed addresses) gives the eager logits, from one graph."""
    eager, got, frames = compiled_static_decode(static_model(name, torch.float32).cuda(), "inductor",
                                                mode="reduce-overhead")
    assert frames == 1
    torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-4)
