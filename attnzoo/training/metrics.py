"""Metrics shared by the scripts: bits/dim (text and images), BLEU (sacreBLEU with its signature, and a tokenised
BLEU), top-1 accuracy. Sums are taken per process and added across processes, so every metric is token- or
example-weighted over the whole evaluation set."""

from __future__ import annotations

import math
import re

import torch

IGNORE_INDEX = -100


@torch.no_grad()
def summed_token_nats(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token negative log-likelihoods in nats, number of predicted tokens) for one causal-LM batch."""
    labels = batch["labels"] if "labels" in batch else batch["input_ids"]
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=labels,
                use_cache=False)
    count = (labels[:, 1:] != IGNORE_INDEX).sum()
    return out.loss.float() * count, count


def bits_per_dim(total_nats: float, total_tokens: float) -> float:
    """Mean negative log-likelihood per predicted token (byte or sub-pixel) in bits."""
    return total_nats / max(total_tokens, 1) / math.log(2)


@torch.no_grad()
def summed_over_batches(model, loader, accelerator, batch_sums, max_batches: int = 0) -> tuple[float, float]:
    """(total, count) of `batch_sums(model, batch) -> (total, count)` over `loader` (this process's shard, at most
    `max_batches` batches; 0: all), in eval mode, summed over processes."""
    from attnzoo.training.loop import to_device

    was_training = model.training
    model.eval()
    total = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    count = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for index, batch in enumerate(loader):
        if max_batches and index >= max_batches:
            break
        batch_total, batch_count = batch_sums(model, to_device(batch, accelerator))
        total += batch_total.double()
        count += batch_count.double()
    model.train(was_training)
    return accelerator.reduce(total, "sum").item(), accelerator.reduce(count, "sum").item()


def evaluate_bits_per_dim(model, loader, accelerator, max_batches: int = 0) -> float:
    """bits/dim over every predicted token of `loader`, summed over processes."""
    return bits_per_dim(*summed_over_batches(model, loader, accelerator, summed_token_nats, max_batches))


@torch.no_grad()
def summed_top1_correct(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of correct top-1 predictions, number of examples) for one image-classification batch."""
    logits = model(pixel_values=batch["pixel_values"]).logits
    return (logits.argmax(-1) == batch["labels"]).sum(), torch.tensor(batch["labels"].numel())


def evaluate_top1(model, loader, accelerator, max_batches: int = 0) -> float:
    """Top-1 accuracy (a fraction) over every example of `loader`, summed over processes."""
    return top1_accuracy(*summed_over_batches(model, loader, accelerator, summed_top1_correct, max_batches))


def _compound_split(line: str) -> str:
    """fairseq's compound_split_bleu.sh: "Haus-Tür" -> "Haus ##AT##-##AT## Tür" (German compounds count as parts)."""
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def bleu_scores(hypotheses: list[str], references: list[str]) -> dict[str, dict]:
    """Corpus BLEU of detokenised hypotheses against one reference each, four ways, each with its signature:

    - "sacrebleu": the standard sacreBLEU (13a tokenisation, cased) on detokenised text;
    - "sacrebleu_intl" / "sacrebleu_intl_uncased": tok:intl, cased / lower-cased: the two sacreBLEU columns of the
      Reformer paper's Table 4 (arXiv 2001.04451; BLEU+case.{mixed,lc}+...+tok.intl);
    - "tokenized_bleu": the "tokenised BLEU" of Table 4 in arXiv 2001.04451 and in arXiv 2204.04667: text tokenised
      (sacreBLEU's 13a tokeniser standing in for the Moses tokeniser), compounds split at hyphens (fairseq
      compound_split_bleu.sh), then BLEU with no further tokenisation.
    """
    from sacrebleu.metrics import BLEU
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references.")
    if not references:
        raise ValueError("no sentence pairs to score: the evaluation data is empty; check --validation_file / "
                         "--split and the language pair.")
    if not any(reference.strip() for reference in references):
        raise ValueError(f"all {len(references)} references are empty: BLEU against empty text is not a score; check "
                         "the target language column of the evaluation data.")
    scores = {}
    for name, options in (("sacrebleu", {}), ("sacrebleu_intl", {"tokenize": "intl"}),
                          ("sacrebleu_intl_uncased", {"tokenize": "intl", "lowercase": True})):
        metric = BLEU(**options)
        scores[name] = _bleu_entry(metric.corpus_score(hypotheses, [references]), str(metric.get_signature()))
    tokenize = Tokenizer13a()
    metric = BLEU(tokenize="none")
    result = metric.corpus_score([_compound_split(tokenize(h)) for h in hypotheses],
                                 [[_compound_split(tokenize(r)) for r in references]])
    scores["tokenized_bleu"] = _bleu_entry(result, f"{metric.get_signature()}|pre:13a+compound-split")
    return scores


def _bleu_entry(result, signature: str) -> dict:
    return {"score": result.score, "signature": signature, "counts": list(result.counts),
            "totals": list(result.totals), "precisions": [round(p, 4) for p in result.precisions],
            "bp": result.bp, "sys_len": result.sys_len, "ref_len": result.ref_len}


def top1_accuracy(correct: float, total: float) -> float:
    return correct / max(total, 1)
