"""GPU-only checks of what the CPU suite cannot reach: CUDA RNG replay and autocast in the reversible backward.
They run wherever CUDA is available (the project's GPU sessions); the CPU suite covers the same logic on the CPU."""

import pytest
import torch

from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM

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
        torch.testing.assert_close(grads_rev[name], grads_ref[name], **tol, msg=name)
