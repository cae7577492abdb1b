"""The reversible residual stack's memory-saving backward ("Reformer: The Efficient Transformer", arXiv 2001.04451,
§3, after "The Reversible Residual Network", arXiv 1707.04585).

Forward, per block:  y1 = x1 + F(x2),  y2 = x2 + G(y1)   (F = attention branch, G = feed-forward branch).
Backward, per block in reverse: recompute G(y1) to get x2 = y2 - G(y1), recompute F(x2) to get x1 = y1 - F(x2),
and backpropagate through both recomputations. Only the last block's outputs are stored, so activation memory does
not grow with depth.

The recomputation must repeat the forward exactly: the RNG state (dropout, drop-path, random attention draws) is
captured before each branch and restored before it is recomputed; autocast is re-entered as it was; each attention
gets the same `Recomputation` on the forward pass and on its recomputation (e.g. LSH saves its buckets there, so
nothing is rehashed).

Parameter gradients are returned from `backward` like any autograd function's (the parameters are inputs of the
function) instead of being written by a nested `.backward()`, so DistributedDataParallel sees each gradient exactly
once; transformers' Reformer fails under DDP for that reason.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from attnzoo.modeling.attention import Recomputation


def _capture_rng(device: torch.device):
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda_state


@contextmanager
def _restored_rng(state, device: torch.device):
    cpu_state, cuda_state = state
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        yield


def stream_step(block, x1, x2, context, block_kwargs, recompute=None, rng_device=None):
    """One reversible block, y1 = x1 + F(x2), y2 = x2 + G(y1): the forward of every reversible path (plain,
    checkpointed under compilation, and this module's recomputing one). With `rng_device` it also returns the RNG
    states taken before F and before G, which the recomputing backward restores to replay both exactly."""
    rng_f = _capture_rng(rng_device) if rng_device is not None else None
    y1 = x1 + block.attention_branch(x2, context, recompute=recompute, **block_kwargs)
    rng_g = _capture_rng(rng_device) if rng_device is not None else None
    y2 = x2 + block.feed_forward_branch(y1)
    return (y1, y2) if rng_device is None else (y1, y2, (rng_f, rng_g))


def _attention_parameters(block):
    modules = [block.attn_norm, block.attn] + ([block.cross_norm, block.cross_attn] if block.cross_attn else [])
    return [p for m in modules for p in m.parameters() if p.requires_grad]


def _feed_forward_parameters(block):
    return [p for p in [*block.ffn_norm.parameters(), *block.ffn.parameters()] if p.requires_grad]


def _chunked_feed_forward_backward(block, x, grad_out, params):
    """The backward's step for a chunked G: recompute G(x) and backpropagate `grad_out` through it one chunk at a
    time, so only one chunk's [chunk, intermediate_size] activations ever exist (chunking saves memory in the
    backward pass too, Reformer §3). Call under the RNG state of the forward's G.
    Returns (G(x) detached, dL/dx, gradients of `params`)."""
    scale = block._residual_scale(x)  # the forward drew nothing before this, so the draws match
    out, grad_x = torch.empty_like(x), torch.empty_like(x)
    grads = [None] * len(params)
    for start in range(0, x.shape[1], block.ffn_chunk_size):
        span = slice(start, start + block.ffn_chunk_size)
        part = x[:, span].detach().requires_grad_()
        with torch.enable_grad():
            g = block._feed_forward(part)
        grad = grad_out[:, span] if scale is None else grad_out[:, span] * scale[:, span]
        part_grads = torch.autograd.grad(g, [part, *params], grad, allow_unused=True)
        with torch.no_grad():
            out[:, span] = g if scale is None else g * scale[:, span]
        grad_x[:, span] = part_grads[0]
        for i, p_grad in enumerate(part_grads[1:]):
            if p_grad is not None:
                grads[i] = p_grad if grads[i] is None else grads[i] + p_grad
    return out, grad_x, grads


class ReversibleStackFunction(torch.autograd.Function):
    """apply(blocks, block_kwargs, concat, x, context, *params) -> (y1 + y2) / 2 for the two streams started at x,
    or [y1, y2] side by side when `concat`.

    `context` is the encoder output for decoders with cross-attention (or None); its gradient is accumulated over
    every block. `params` are all trainable parameters of `blocks`, in `blocks.parameters()` order.
    """

    @staticmethod
    def forward(ctx, blocks, block_kwargs, concat, x, context, *params):
        device_type = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), device_type)
        ctx.blocks, ctx.block_kwargs, ctx.device = blocks, block_kwargs, x.device
        ctx.records = []
        x1 = x2 = x
        for block in blocks:
            recompute = Recomputation()
            x1, x2, (rng_f, rng_g) = stream_step(block, x1, x2, context, block_kwargs, recompute, x.device)
            ctx.records.append((rng_f, rng_g, recompute))
        ctx.save_for_backward(x1, x2, context)
        ctx.param_index = {id(p): i for i, p in enumerate(params)}
        ctx.concat = concat
        return torch.cat([x1, x2], dim=-1) if concat else (x1 + x2) / 2

    @staticmethod
    def backward(ctx, grad_out):
        y1, y2, context = ctx.saved_tensors
        enabled, dtype, device_type = ctx.autocast
        grads = [None] * len(ctx.param_index)
        if ctx.concat:
            dy1, dy2 = (part.contiguous() for part in grad_out.chunk(2, dim=-1))
        else:
            dy1 = grad_out / 2
            dy2 = dy1.clone()  # updated in place below, so the two must not share storage
        context_grad = None
        context_in = None if context is None else context.detach().requires_grad_(context.requires_grad)

        def accumulate(params, param_grads):
            for p, g in zip(params, param_grads, strict=True):
                if g is not None:
                    i = ctx.param_index[id(p)]
                    grads[i] = g if grads[i] is None else grads[i] + g

        # Stream-sized tensors dominate the backward's memory at long lengths, so the streams are updated in place;
        # only the last block's outputs, saved by autograd, are left intact.
        owned = False

        def minus(a, b):
            return a.sub_(b) if owned else a - b

        for block, (rng_f, rng_g, recompute) in zip(reversed(ctx.blocks), reversed(ctx.records), strict=True):
            recompute.replaying = True
            g_params = _feed_forward_parameters(block)
            if block.chunked_feed_forward(y1):
                # Recompute and backpropagate G one chunk at a time: the backward never holds the whole
                # [length, intermediate_size] activations either.
                with _restored_rng(rng_g, ctx.device), torch.autocast(device_type, dtype, enabled):
                    g_out, g_dy1, g_param_grads = _chunked_feed_forward_backward(block, y1, dy2, g_params)
                dy1.add_(g_dy1)
                accumulate(g_params, g_param_grads)
                del g_dy1
            else:
                with torch.enable_grad(), _restored_rng(rng_g, ctx.device), \
                        torch.autocast(device_type, dtype, enabled):
                    y1_in = y1.detach().requires_grad_()
                    g_out = block.feed_forward_branch(y1_in)
                g_grads = torch.autograd.grad(g_out, [y1_in, *g_params], dy2, allow_unused=True)
                dy1.add_(g_grads[0])
                accumulate(g_params, g_grads[1:])
                del y1_in, g_grads
            with torch.no_grad():
                x2 = minus(y2, g_out)
            del g_out

            f_params = _attention_parameters(block)
            with torch.enable_grad(), _restored_rng(rng_f, ctx.device), torch.autocast(device_type, dtype, enabled):
                x2_in = x2.detach().requires_grad_()
                f_out = block.attention_branch(x2_in, context_in, recompute=recompute, **ctx.block_kwargs)
            wrt = [x2_in] + ([context_in] if context_in is not None and context_in.requires_grad else []) + f_params
            f_grads = list(torch.autograd.grad(f_out, wrt, dy1, allow_unused=True))
            dx2 = dy2.add_(f_grads[0])
            offset = 1
            if len(wrt) > 1 + len(f_params):
                c = f_grads[1]
                if c is not None:
                    context_grad = c if context_grad is None else context_grad + c
                offset = 2
            accumulate(f_params, f_grads[offset:])
            del f_grads
            with torch.no_grad():
                x1 = minus(y1, f_out)
            del f_out, x2_in
            y1, y2, dy2 = x1, x2, dx2  # dy1 is already dx1
            owned = True

        ctx.records = None
        return (None, None, None, dy1 + dy2, context_grad, *grads)
