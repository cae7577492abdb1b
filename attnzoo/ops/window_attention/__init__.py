"""Sliding-window attention with attention sinks: the exact near part of every windowed layer, as one op.

Inputs are left-aligned (each row's real tokens first, in order, so a sequence index is a real position): queries
q [B, H, L, d] and keys/values k, v [B, kv_heads, L, .] (query head h reads key/value head h // (H / kv_heads)). A
causal query at position i sees the keys i - W < j <= i (the window) and the first S keys (the sinks) outside it; a
bidirectional one |i - j| < W and the sinks. The op returns the output and the log-sum-exp of the scores over those
keys, so that a windowed layer can merge a far part under the same normalisation.

Backends:
- "flash" (`flash_cpu`): causal layers on the CPU through PyTorch's fused flash-attention kernel, with no mask
  tensor and about L * W work per head; differentiable through both outputs.
- "torch" (`torch_blocks`): blocks of W queries over their neighbour blocks and the sinks, masked. Everything else
  (bidirectional layers, attention dropout, other devices, a compiled graph) and the reference the rewrite kept.
- "auto": "flash" where it applies, else "torch".
`naive.naive_window_attention` is the dense reference both are tested against.
"""

from __future__ import annotations

import torch

from attnzoo.ops.window_attention.flash_cpu import FLASH_DTYPES, flash_cpu_available, flash_window_attention
from attnzoo.ops.window_attention.torch_blocks import blocked_window_attention

WINDOW_BACKENDS = ("auto", "flash", "torch")


def flash_declines(q, k, v, causal: bool, dropout: float, training: bool) -> str | None:
    """Why the fused CPU path cannot take these inputs, or None when it can."""
    if not causal:
        return "the layer is bidirectional"
    if dropout > 0.0 and training:
        return "attention dropout is on (the fused kernel's draws could not be replayed)"
    if q.device.type != "cpu":
        return f"the inputs are on {q.device}, and the fused kernels run on the CPU"
    if not flash_cpu_available():
        return "this PyTorch has no CPU flash-attention kernels"
    if q.dtype not in FLASH_DTYPES:
        return f"the inputs are {q.dtype}; the fused CPU kernels take {[str(t) for t in FLASH_DTYPES]}"
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return "values have another width than queries and keys"
    if torch.compiler.is_compiling():
        return "a compiled graph traces the plain-ops path"
    return None


def window_attention(q, k, v, window: int, sinks: int, scale: float, *, n_real=None, causal: bool = True,
                     sink_q=None, own_score: float | None = None, dropout: float = 0.0, training: bool = False,
                     backend: str = "auto"):
    """(out [B, H, L, e], lse [B, H, L]) over each query's window and sinks (module docstring).

    n_real [B]: real tokens per row (None: all); only padded queries (after the real ones) depend on it, and their
    outputs are never read. sink_q: the queries that score the sink columns when not q (`sink_positions`
    "adjacent"). own_score: a constant score for each query's own key (LSH's shared-QK penalty). dropout: on the
    near probabilities in training (the "torch" path)."""
    if backend not in WINDOW_BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {WINDOW_BACKENDS}.")
    declined = flash_declines(q, k, v, causal, dropout, training) if backend != "torch" else "torch asked for"
    if backend == "flash" and declined is not None:
        raise ValueError(f"backend='flash' cannot run here: {declined}; use backend='torch' or 'auto'.")
    if declined is None:
        return flash_window_attention(q, k, v, window, sinks, scale, sink_q=sink_q, own_score=own_score)
    heads = q.shape[1]
    k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    if n_real is None:
        n_real = torch.full((q.shape[0],), q.shape[2], dtype=torch.long, device=q.device)
    return blocked_window_attention(q, k, v, n_real, window, sinks, causal, scale, sink_q, own_score, dropout,
                                    training)


def merge_far(out: torch.Tensor, lse: torch.Tensor, far_num: torch.Tensor, far_den: torch.Tensor,
              far_scale: torch.Tensor) -> torch.Tensor:
    """The one normalisation of every windowed layer: the near part's output and log-sum-exp with a far part given
    per query as a numerator [..., Q, e], a denominator [..., Q] and their common log scale [..., Q]:

        out = (exp(lse) out_near + exp(c) far_num) / (exp(lse) + exp(c) far_den).

    A far part that is normalised itself (LSH's bucket attention, RA's far values) gives far_den = 1 and its
    log-sum-exp as c; a query without far keys gets c = -inf."""
    top = torch.maximum(lse, far_scale).detach()
    near, far = torch.exp(lse - top), torch.exp(far_scale - top)
    return (near[..., None] * out + far[..., None] * far_num) / (near + far * far_den)[..., None]
