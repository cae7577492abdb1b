"""The language-model loss with the answer tokens of passkey sequences weighted up.

A passkey block's answer is about 6 of its tokens, and the filler around it is easy to predict, so with plain
next-token loss the retrieval skill carries about 1% of the gradient and small models never learn it (issue 36 found
0% passkey accuracy after 3,000 steps at 256 tokens with half the blocks passkeys). Weighting the answer tokens by w
(the loss a weighted mean over tokens) gives retrieval the share of the gradient it needs, while every other token
keeps its ordinary loss; bits/dim is always measured unweighted, on text."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def answer_weighted_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, answer_mask: torch.Tensor,
                            answer_weight: float) -> torch.Tensor:
    """Mean next-token cross-entropy over [B, N] tokens, token t+1 predicted from logits [B, t], where the tokens that
    `answer_mask` marks count `answer_weight` times: sum(w * loss) / sum(w)."""
    if logits.shape[:2] != input_ids.shape or answer_mask.shape != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)} and answer_mask "
                         f"{tuple(answer_mask.shape)} must share [batch, length].")
    targets = input_ids[:, 1:]
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    weights = 1.0 + (answer_weight - 1.0) * answer_mask[:, 1:].flatten().to(losses.dtype)
    return (losses * weights).sum() / weights.sum()
