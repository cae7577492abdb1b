"""The reversible stack: activation memory independent of depth, gradients delivered the way DDP expects."""

import torch

from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM
from attnzoo.transformers_compat import enable_activation_checkpointing, output_cache


def build(depth, reversible, **kw):
    torch.manual_seed(0)
    kw.setdefault("hidden_dropout_prob", 0.0)
    config = ZooSoftmaxConfig(vocab_size=50, hidden_size=32, num_hidden_layers=depth, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=64, reversible=reversible,
                              is_decoder=True, **kw)
    return ZooSoftmaxForCausalLM(config).train()


def saved_bytes(model, ids):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return total


def test_activations_saved_for_backward_do_not_grow_with_depth():
    ids = torch.randint(0, 50, (2, 48))
    reversible = [saved_bytes(build(depth, True), ids) for depth in (2, 8)]
    standard = [saved_bytes(build(depth, False), ids) for depth in (2, 8)]
    assert reversible[0] == reversible[1]
    assert standard[1] > 3 * standard[0]


def test_each_parameter_gradient_arrives_once_through_autograd():
    # DistributedDataParallel hooks each parameter's gradient accumulation; a nested .backward() inside the
    # reversible backward (transformers' Reformer) trips it. Here every gradient must arrive exactly once.
    model = build(3, True, hidden_dropout_prob=0.1)
    calls = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    ids = torch.randint(0, 50, (2, 20))
    model(ids, labels=ids).loss.backward()
    assert calls == {name: 1 for name, _ in model.named_parameters()}


def test_eval_output_equals_training_path_without_dropout():
    model = build(3, True)
    ids = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        plain = model.eval()(ids).logits
    model.train()
    assert torch.allclose(model(ids).logits, plain, atol=1e-6)


def test_gradient_checkpointing_on_the_standard_stack_matches():
    ids = torch.randint(0, 50, (2, 20))
    model = build(3, False).double()
    model(ids, labels=ids).loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    enable_activation_checkpointing(model)
    assert all(block.gradient_checkpointing for block in model.model.transformer.blocks)
    model(ids, labels=ids).loss.backward()
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_a_cache_is_left_out_while_blocks_are_checkpointed():
    """A checkpointed block is run twice (forward, then again in the backward pass): a cache would be written twice.
    attnzoo drops it itself, on every transformers version (the keyword transformers' own layer nulls was renamed)."""
    ids = torch.randint(0, 50, (2, 20))
    model = build(2, False).double()
    enable_activation_checkpointing(model)
    model.train()
    out = model(ids, labels=ids, use_cache=True)
    out.loss.backward()
    assert output_cache(out).get_seq_length() == 0  # returned untouched: nothing was written into it
    model.eval()
    assert output_cache(model(ids, use_cache=True)).get_seq_length() == 20  # evaluation caches as usual
