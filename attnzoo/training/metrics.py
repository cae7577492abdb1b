"""Metrics shared by the scripts."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def summed_token_nats(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token negative log-likelihoods in nats, number of predicted tokens) for one causal-LM batch."""
    labels = batch["labels"] if "labels" in batch else batch["input_ids"]
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=labels,
                use_cache=False)
    count = (labels[:, 1:] != -100).sum()
    return out.loss.float() * count, count


def bits_per_dim(total_nats: float, total_tokens: float) -> float:
    """Mean negative log-likelihood per predicted token (byte or sub-pixel) in bits."""
    return total_nats / max(total_tokens, 1) / math.log(2)
