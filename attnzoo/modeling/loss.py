"""Language-model losses, optionally chunked over the sequence so [batch, length, vocab] logits are never held."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def upcast(t: torch.Tensor) -> torch.Tensor:
    """At least float32 for losses (bf16/fp16 logits are upcast; float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _chunk_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head) -> torch.Tensor:
    logits = upcast(head(hidden))
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def token_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, head, chunk_size: int = 0,
                        num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """Cross-entropy (nats) of `head(hidden)` against `labels`, summed over positions whose label is not -100 and
    divided by their count, or by `num_items_in_batch` when given: the Trainer passes the number of labelled tokens
    of all the micro-batches of one optimizer step, so that gradient accumulation gives the loss (and gradients) of
    one large batch.

    With `chunk_size > 0` the sequence is processed in chunks whose logits are recomputed in the backward pass
    (activation checkpointing), so peak memory holds one chunk's logits instead of all of them.
    """
    if num_items_in_batch is None:
        count = (labels != IGNORE_INDEX).sum().clamp(min=1)
    else:
        count = torch.as_tensor(num_items_in_batch, device=hidden.device).clamp(min=1)
    if chunk_size <= 0 or hidden.shape[1] <= chunk_size:
        return _chunk_loss_sum(hidden, labels, head) / count
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[1], chunk_size):
        part = slice(start, start + chunk_size)
        total = total + checkpoint(_chunk_loss_sum, hidden[:, part], labels[:, part], head, use_reentrant=False)
    return total / count


def causal_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head, chunk_size: int = 0,
                   num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """Next-token loss: position t predicts labels[t + 1] (the Trainer counts `labels[..., 1:]` for
    `num_items_in_batch` likewise)."""
    return token_cross_entropy(hidden[:, :-1], labels[:, 1:], head, chunk_size, num_items_in_batch)
