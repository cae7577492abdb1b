"""Which layers of a pretrained causal LM read a pass key from far back: a calibration without training, for layouts
that keep a far part only in the layers that read it (window-only elsewhere, so that the decoding state stays
bounded).

Retrieval heads ("Retrieval Head Mechanistically Explains Long-Context Factuality", arXiv 2404.15574, §2) are the few
heads that attend to the needle while the model copies it out; DuoAttention (arXiv 2410.10819, §3) finds such heads
on synthetic pass-key data and keeps the full context for them only. Here a layer's retrieval score is measured on the
source model itself, inside its training length, from its own attention weights:

- calibration prompts are `attnzoo.evaluation.passkey` prompts of `length` tokens whose key line ends at least
  `min_distance` tokens before the question (the key is far, as it will be for a windowed layer), at evenly spaced
  depths, the keys drawn from `seed`;
- each prompt is read with its answer in one teacher-forced forward; for every query that predicts an answer token,
  each head's softmax weight on the key line's tokens is recorded;
- a layer's score is the mean over prompts of its heads' largest weight (averaged over the answer's queries): a
  layer needs one head that reads the key for the layer to need a far part.

The weights come from the model's own attention: an attention function registered with transformers'
`AttentionInterface` computes each layer's output as SDPA does and, beside it, the weights of the answer's queries
only (the full weights of 30 layers at 4K tokens would take gigabytes).

    python -m attnzoo.evaluation.retrieval_layers SOURCE --length 4096 --min_distance 1024 --top 6
prints the scores and the `attn_layers=[...]` and `far_positions=[...]` of a layout with a far part in the top layers
only, for `python -m attnzoo.convert.llama ... --family hybrid --model "attn_layers=[...]" "far_positions=[...]" ...`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

#: the name the probe's attention function is registered under with transformers' AttentionInterface
PROBE = "attnzoo_retrieval_probe"

_RECORD: dict = {}


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA over one unpadded sequence (query [1, H, L, d], key and value [1, KV, L, d]), and the weights of
    the recorded rows on the recorded span, per head, into _RECORD["layers"][layer]."""
    batch, heads, length, dim = query.shape
    if batch != 1 or key.shape[2] != length:
        raise ValueError("the retrieval probe reads one prompt a forward, without a cache")
    scale = dim ** -0.5 if scaling is None else scaling
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    rows = torch.as_tensor(_RECORD["rows"], device=query.device)
    start, end = _RECORD["span"]
    logits = (query[:, :, rows].float() @ key.float().transpose(-1, -2)) * scale  # [1, H, R, L]
    later = torch.arange(length, device=query.device)[None, :] > rows[:, None]
    weights = logits.masked_fill(later, -math.inf).softmax(-1)
    _RECORD["layers"][module.layer_idx] = weights[0, :, :, start:end].sum(-1).mean(-1).double().cpu()  # [H]
    return output.transpose(1, 2).contiguous(), None


def calibration_depths(prompts: int) -> list[float]:
    """Evenly spaced depths in (0, 1): the fractions of the room before the far limit where the key line goes."""
    return [(i + 0.5) / prompts for i in range(prompts)]


def retrieval_scores(model, tokenizer, *, length: int, min_distance: int, prompts: int = 8, seed: int = 0,
                     digits: int = 5, filler: str = "repeat") -> dict:
    """{"layer_scores": [num_layers], "head_scores": [num_layers][heads], "prompts": [...]} for a transformers
    causal LM whose layers use transformers' attention interface (a Llama, ...). See the module docstring."""
    from transformers import AttentionInterface

    from attnzoo.evaluation.passkey import passkey_prompt
    from attnzoo.transformers_compat import attention_implementation

    for name, value in (("length", length), ("min_distance", min_distance), ("prompts", prompts)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: give a positive integer.")
    native = getattr(model.config, "max_position_embeddings", None)
    if native is not None and length > native:
        raise ValueError(f"length={length} is past the model's training length ({native}): calibrate inside it, "
                         "where its attention is what training made it; pass --length <= that.")
    first = passkey_prompt(tokenizer, length, 0.0, seed, digits=digits, filler=filler)
    room = first.filler_tokens - min_distance  # filler tokens that may go before the key line
    if room < 1:
        raise ValueError(f"min_distance={min_distance} leaves no room for the key line in a {length}-token prompt "
                         f"({first.filler_tokens} filler tokens); pass a smaller --min_distance or a longer --length.")
    AttentionInterface.register(PROBE, _probe_attention)
    previous = attention_implementation(model)
    model.set_attn_implementation(PROBE)
    layers = model.config.num_hidden_layers
    per_prompt, head_sums = [], None
    try:
        for index, fraction in enumerate(calibration_depths(prompts)):
            depth = fraction * room / first.filler_tokens
            prompt = passkey_prompt(tokenizer, length, depth, seed * 100_003 + index, digits=digits, filler=filler)
            ids = prompt.input_ids + prompt.answer_ids
            _RECORD.update(layers={}, span=(prompt.key_position, prompt.key_end),
                           rows=list(range(len(prompt.input_ids) - 1, len(ids) - 1)))
            with torch.inference_mode():
                model(torch.tensor([ids], device=model.device), use_cache=False, logits_to_keep=1)
            heads = torch.stack([_RECORD["layers"][i] for i in range(layers)])  # [layers, H]
            head_sums = heads if head_sums is None else head_sums + heads
            per_prompt.append({"passkey": prompt.passkey, "key_position": prompt.key_position,
                               "distance": len(prompt.input_ids) - prompt.key_end,
                               "layer_scores": heads.amax(-1).tolist()})
    finally:
        model.set_attn_implementation(previous)
        _RECORD.clear()
    heads = head_sums / prompts
    layer_scores = [sum(p["layer_scores"][i] for p in per_prompt) / prompts for i in range(layers)]
    return {"layer_scores": layer_scores, "head_scores": heads.tolist(), "prompts": per_prompt,
            "settings": {"length": length, "min_distance": min_distance, "prompts": prompts, "seed": seed,
                         "digits": digits, "filler": filler}}


def top_layers(layer_scores: list[float], top: int) -> list[int]:
    """The `top` layers by score, in layer order (ties: the earlier layer)."""
    if not isinstance(top, int) or not 1 <= top <= len(layer_scores):
        raise ValueError(f"top={top!r}: give a number of layers from 1 to {len(layer_scores)}.")
    ranked = sorted(range(len(layer_scores)), key=lambda i: (-layer_scores[i], i))
    return sorted(ranked[:top])


def layout(num_layers: int, far_layers: list[int], far_kind: str = "block_window", near_kind: str = "window",
           far_positions: str = "fixed") -> dict[str, list[str]]:
    """A hybrid config's per-layer settings: `attn_layers` with `far_kind` in `far_layers` and `near_kind` (no far
    part) elsewhere, and `far_positions` with `far_positions` in the far layers and "rotary" (the window's own) in the
    others."""
    bad = [i for i in far_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"far layers {bad} are not layers of a {num_layers}-layer model; pick from 0 to "
                         f"{num_layers - 1}.")
    far = set(far_layers)
    return {"attn_layers": [far_kind if i in far else near_kind for i in range(num_layers)],
            "far_positions": [far_positions if i in far else "rotary" for i in range(num_layers)]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a causal LM: a saved folder, a Hub id, or a GGUF file or folder")
    p.add_argument("--length", type=int, default=4096, help="calibration prompt tokens (inside the training length)")
    p.add_argument("--min_distance", type=int, default=1024,
                   help="the key line ends at least this many tokens before the question (the window size)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--top", type=int, default=6, help="layers that keep a far part")
    p.add_argument("--far_kind", default="block_window", help="the attention of those layers")
    p.add_argument("--far_positions", default="fixed", help="the far positions of those layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filler", default="repeat", help="attnzoo.evaluation.passkey's filler")
    p.add_argument("--output", type=Path, default=None, help="also write the scores as JSON here (a new file)")
    args = p.parse_args(argv)
    if args.output is not None and args.output.exists():
        raise SystemExit(f"--output {args.output} exists; name a new file (nothing is overwritten).")
    from attnzoo.convert.common import load_text_tokenizer
    from attnzoo.convert.llama import load_source

    model = load_source(args.source).eval()
    result = retrieval_scores(model, load_text_tokenizer(args.source), length=args.length,
                              min_distance=args.min_distance, prompts=args.prompts, seed=args.seed,
                              filler=args.filler)
    chosen = top_layers(result["layer_scores"], args.top)
    result.update(top=chosen, **layout(len(result["layer_scores"]), chosen, args.far_kind,
                                       far_positions=args.far_positions))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(" ".join(f"{i}:{s:.3f}" for i, s in enumerate(result["layer_scores"])))
    print(f"top {args.top} layers: {chosen}")
    print(f'"attn_layers=[{",".join(result["attn_layers"])}]" "far_positions=[{",".join(result["far_positions"])}]"')
    return result


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        raise SystemExit(f"retrieval_layers: error: {error}") from None
