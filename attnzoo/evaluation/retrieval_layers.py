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

A head that reads the key is not the same as a layer that needs a far part: on SmolLM2-135M, a layout with block
retrieval in only the six layers whose heads read the key most (7, 14, 18, 20, 21, 23) misses pass keys that block
retrieval in every layer finds (benchmarks/pretrained_long_context.py, `block_bounded` against `block_fixed`). The
second score, `far_part_attributions`, asks the converted model itself what each far part is worth to the answer
(DuoAttention's question, answered without optimising gates):

- the model is a conversion whose layers all have a far part (e.g. `block_window` everywhere); each far part's mass
  in each head is scaled by a gate α (its log-scale plus log α, so α = 0 is the window-only layer exactly and
  α = 1 the model as converted);
- on the same calibration prompts, the answer's teacher-forced NLL is differentiated with respect to every gate at
  α = s for all gates together, s at the midpoints of `steps` equal intervals of (0, 1]; a head's score is the
  integrated gradient (arXiv 1703.01365), the mean over s of -∂NLL/∂α: how much of the fall in the answer's NLL from
  window-only to all-far that head's far part carries, the others moving with it; a layer's score sums its heads;
- the far parts run without gradients (their outputs enter as constants; the gate's gradient still flows through
  every near part, norm and feed-forward after it): the gathered keys of block retrieval at 4K tokens would need tens
  of gigabytes for a backward pass, and what is measured is the far part's output, not how it moves with its inputs.

On SmolLM2-135M (4K prompts, 4 of them, 4 steps) the attribution's top six differ from the attention's in one layer:
4 for 7, whose far part lowers the answer's likelihood (the benchmark's `block_attributed`).

A layer is a coarse unit: `--kv_heads N` chooses the top N key-value heads of all layers instead (a key-value head
scores the sum of its query heads' attributions, or the largest of their attention weights) and lays them out with
the config's `far_kv_heads`, the far part kept in those heads only (DuoAttention's retrieval heads); on SmolLM2 the
attribution is spread over more layers than the best 7 but concentrated in a few heads of each, and 21 heads (as many
far keys as 7 layers) carry more of it (the benchmark's `block_heads`).

    python -m attnzoo.evaluation.retrieval_layers SOURCE --length 4096 --min_distance 1024 --top 6
    python -m attnzoo.evaluation.retrieval_layers CONVERTED --method attribution --length 4096 --top 7
    python -m attnzoo.evaluation.retrieval_layers CONVERTED --method attribution --length 4096 --kv_heads 21
(CONVERTED: a conversion with a far part in every layer) print the scores and the `attn_layers=[...]` and
`far_positions=[...]` (and with --kv_heads `far_kv_heads=[...]`) of a layout with a far part in the top layers or
heads only, for `python -m attnzoo.convert.llama ...
--family hybrid --model "attn_layers=[...]" "far_positions=[...]" ...`.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import contextmanager
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


def check_calibration_length(model, length) -> None:
    native = getattr(model.config, "max_position_embeddings", None)
    if isinstance(length, int) and native is not None and length > native:
        raise ValueError(f"length={length} is past the model's training length ({native}): calibrate inside it, "
                         "where its attention is what training made it; pass --length <= that.")


def calibration_prompts(tokenizer, *, length: int, min_distance: int, prompts: int, seed: int, digits: int = 5,
                        filler: str = "repeat") -> list:
    """The calibration's pass-key prompts (`attnzoo.evaluation.passkey.PasskeyPrompt`): `length` tokens each, the key
    line ending at least `min_distance` tokens before the question, at `calibration_depths(prompts)` of the room
    before that limit, prompt i's key drawn from seed * 100003 + i."""
    from attnzoo.evaluation.passkey import passkey_prompt

    for name, value in (("length", length), ("min_distance", min_distance), ("prompts", prompts)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: give a positive integer.")
    first = passkey_prompt(tokenizer, length, 0.0, seed, digits=digits, filler=filler)
    room = first.filler_tokens - min_distance  # filler tokens that may go before the key line
    if room < 1:
        raise ValueError(f"min_distance={min_distance} leaves no room for the key line in a {length}-token prompt "
                         f"({first.filler_tokens} filler tokens); pass a smaller --min_distance or a longer --length.")
    return [passkey_prompt(tokenizer, length, fraction * room / first.filler_tokens, seed * 100_003 + index,
                           digits=digits, filler=filler)
            for index, fraction in enumerate(calibration_depths(prompts))]


def retrieval_scores(model, tokenizer, *, length: int, min_distance: int, prompts: int = 8, seed: int = 0,
                     digits: int = 5, filler: str = "repeat") -> dict:
    """{"layer_scores": [num_layers], "head_scores": [num_layers][heads], "prompts": [...]} for a transformers
    causal LM whose layers use transformers' attention interface (a Llama, ...). See the module docstring."""
    from transformers import AttentionInterface

    from attnzoo.transformers_compat import attention_implementation

    check_calibration_length(model, length)
    calibration = calibration_prompts(tokenizer, length=length, min_distance=min_distance, prompts=prompts, seed=seed,
                                      digits=digits, filler=filler)
    AttentionInterface.register(PROBE, _probe_attention)
    previous = attention_implementation(model)
    model.set_attn_implementation(PROBE)
    layers = model.config.num_hidden_layers
    per_prompt, head_sums = [], None
    try:
        for prompt in calibration:
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
    return {"layer_scores": layer_scores, "head_scores": heads.tolist(), "prompts": per_prompt, "method": "attention",
            "settings": {"length": length, "min_distance": min_distance, "prompts": prompts, "seed": seed,
                         "digits": digits, "filler": filler}}


def far_layers(model) -> dict[int, torch.nn.Module]:
    """{layer index: its windowed attention} for every layer of a zoo model whose attention has a far part."""
    from attnzoo.modeling.attention.windowed import WindowedAttention

    return {m.layer_idx: m for m in model.modules() if isinstance(m, WindowedAttention) and m.far is not None}


@contextmanager
def gated_far_parts(layers: dict[int, torch.nn.Module], log_gates: dict[int, torch.Tensor]):
    """Within the block, layer i's far part (parallel form) runs without gradients and its mass in head h is scaled
    by exp(log_gates[i][h]): its log-scale plus the gate, the near part and the merge unchanged."""
    patched = []
    try:
        for index, layer in layers.items():
            far, gate = layer.far, log_gates[index]
            if layer.far_kv_heads is not None:  # the far part runs on the chosen heads only
                gate = gate[layer.far_head_indices(gate.device)[0]]

            def parallel(x, original=far.parallel, gate=gate):
                with torch.no_grad():
                    out = original(x)
                return out._replace(log_scale=out.log_scale + gate.to(out.log_scale.dtype)[None, :, None])

            far.parallel = parallel  # an instance attribute over the class's method, deleted after
            patched.append(far)
        yield
    finally:
        for far in patched:
            del far.parallel


def far_part_attributions(model, tokenizer, *, length: int, min_distance: int, prompts: int = 4, steps: int = 4,
                          seed: int = 0, digits: int = 5, filler: str = "repeat") -> dict:
    """{"layer_scores": [num_layers] (0 where a layer has no far part), "head_scores": [num_layers][heads],
    "far_layers": [...], "prompts": [...], "settings": {...}} for a zoo causal LM (a conversion) with far parts:
    each far part's integrated-gradient share of the answer's NLL (the module docstring)."""
    check_calibration_length(model, length)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: give a positive number of gate values to integrate over.")
    layers = far_layers(model)
    if not layers:
        raise ValueError(f"the model ({type(model).__name__}) has no layer with a far part; attribute the far parts "
                         "of a conversion with one in every layer (e.g. attn_layers=[block_window]).")
    calibration = calibration_prompts(tokenizer, length=length, min_distance=min_distance, prompts=prompts, seed=seed,
                                      digits=digits, filler=filler)
    heads = model.config.num_attention_heads
    log_gates = {i: torch.zeros(heads, dtype=torch.float64, requires_grad=True) for i in layers}
    gate_values = [(j + 0.5) / steps for j in range(steps)]
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    totals = torch.zeros(model.config.num_hidden_layers, heads, dtype=torch.float64)
    per_prompt = []
    try:
        with gated_far_parts(layers, log_gates), torch.enable_grad():
            for prompt in calibration:
                ids = torch.tensor([prompt.input_ids + prompt.answer_ids], device=model.device)
                answer = ids[0, len(prompt.input_ids):]
                share, nll_at = torch.zeros_like(totals), []
                for value in gate_values:
                    with torch.no_grad():
                        for gate in log_gates.values():
                            gate.fill_(math.log(value))
                            gate.grad = None
                    logits = model(ids, use_cache=False, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
                    nll = torch.nn.functional.cross_entropy(logits, answer, reduction="sum")
                    nll.backward()
                    for i, gate in log_gates.items():  # d/dα = d/d(log α) / α
                        share[i] -= gate.grad / value / steps
                    nll_at.append(float(nll.detach()))
                totals += share
                per_prompt.append({"passkey": prompt.passkey, "key_position": prompt.key_position,
                                   "distance": len(prompt.input_ids) - prompt.key_end,
                                   "answer_nll_by_gate": dict(zip((f"{v:g}" for v in gate_values), nll_at,
                                                                  strict=True)),
                                   "layer_scores": share.sum(-1).tolist()})
    finally:
        for p, wanted in frozen:
            p.requires_grad_(wanted)
    head_scores = totals / len(calibration)
    return {"layer_scores": head_scores.sum(-1).tolist(), "head_scores": head_scores.tolist(),
            "far_layers": sorted(layers), "prompts": per_prompt, "method": "attribution",
            "far_kinds": {i: layers[i].name for i in sorted(layers)},
            "far_positions_by_layer": {i: layers[i].far_positions for i in sorted(layers)},
            "settings": {"length": length, "min_distance": min_distance, "prompts": prompts, "steps": steps,
                         "seed": seed, "digits": digits, "filler": filler}}


def top_layers(layer_scores: list[float], top: int) -> list[int]:
    """The `top` layers by score, in layer order (ties: the earlier layer)."""
    if not isinstance(top, int) or not 1 <= top <= len(layer_scores):
        raise ValueError(f"top={top!r}: give a number of layers from 1 to {len(layer_scores)}.")
    ranked = sorted(range(len(layer_scores)), key=lambda i: (-layer_scores[i], i))
    return sorted(ranked[:top])


def kv_head_scores(head_scores: list[list[float]], num_kv_heads: int, method: str) -> list[list[float]]:
    """[layers][num_kv_heads]: each key-value head's score from its query heads' (query head h reads key-value head
    h // group): their sum for "attribution" (the shares add up), their largest for "attention" (one head that reads
    the key is enough)."""
    scores = torch.tensor(head_scores, dtype=torch.float64)
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1 or scores.shape[-1] % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads!r} does not divide the {scores.shape[-1]} query heads; give the "
                         "model's num_key_value_heads.")
    grouped = scores.view(scores.shape[0], num_kv_heads, -1)
    return (grouped.sum(-1) if method == "attribution" else grouped.amax(-1)).tolist()


def top_kv_heads(kv_scores: list[list[float]], top: int) -> dict[int, list[int]]:
    """{layer: its chosen key-value heads, ascending} for the `top` key-value heads of all layers by score (ties: the
    earlier layer, then the earlier head), layers in order."""
    cells = [(layer, head) for layer, row in enumerate(kv_scores) for head in range(len(row))]
    if not isinstance(top, int) or not 1 <= top <= len(cells):
        raise ValueError(f"kv_heads={top!r}: give a number of key-value heads from 1 to {len(cells)}.")
    ranked = sorted(cells, key=lambda c: (-kv_scores[c[0]][c[1]], c))
    chosen: dict[int, list[int]] = {}
    for layer, head in sorted(ranked[:top]):
        chosen.setdefault(layer, []).append(head)
    return chosen


def head_layout(num_layers: int, heads_by_layer: dict[int, list[int]], num_kv_heads: int,
                far_kind: str = "block_window", near_kind: str = "window", far_positions: str = "fixed") -> dict:
    """`layout` with a far part in the layers of `heads_by_layer`, kept in their listed key-value heads only:
    `far_kv_heads` lists them (None where a layer keeps every head, or has no far part)."""
    result = layout(num_layers, sorted(heads_by_layer), far_kind, near_kind, far_positions)
    result["far_kv_heads"] = [None if i not in heads_by_layer or len(heads_by_layer[i]) == num_kv_heads
                              else sorted(heads_by_layer[i]) for i in range(num_layers)]
    return result


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


def own_setting(result: dict, field: str, chosen: list[int], flag: str) -> str:
    """The conversion's own setting (result[field], per far layer) shared by the chosen layers; ValueError naming
    `flag` when they differ or a chosen layer has no far part."""
    values = {result[field].get(i) for i in chosen}
    if len(values) != 1 or None in values:
        raise ValueError(f"the chosen layers {chosen} do not share one far part setting ({field}: "
                         f"{ {i: result[field].get(i) for i in chosen} }); pass {flag} for the layout.")
    return values.pop()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a causal LM: a saved folder, a Hub id, or a GGUF file or folder (--method "
                                  "attention); a zoo conversion with a far part in its layers (--method attribution)")
    p.add_argument("--method", default="attention", choices=("attention", "attribution"),
                   help="attention: the source's heads' weights on the key line; attribution: each far part's "
                        "integrated-gradient share of the answer's likelihood in the conversion (module docstring)")
    p.add_argument("--steps", type=int, default=4, help="gate values the attribution integrates over")
    p.add_argument("--length", type=int, default=4096, help="calibration prompt tokens (inside the training length)")
    p.add_argument("--min_distance", type=int, default=1024,
                   help="the key line ends at least this many tokens before the question (the window size)")
    p.add_argument("--prompts", type=int, default=None, help="calibration prompts (default: 8 for attention, 4 for "
                                                                 "attribution, whose prompts cost a backward pass "
                                                                 "per step)")
    p.add_argument("--top", type=int, default=6, help="layers that keep a far part")
    p.add_argument("--kv_heads", type=int, default=None,
                   help="instead of --top layers: the key-value heads (of all layers) that keep a far part, the "
                        "layout's far_kv_heads (a key-value head scores the sum of its query heads' attributions, "
                        "or the largest of their attention weights)")
    p.add_argument("--far_kind", default=None,
                   help="the attention of those layers (default: block_window with --method attention, the "
                        "conversion's own with --method attribution)")
    p.add_argument("--far_positions", default=None,
                   help="the far positions of those layers (default: fixed with --method attention, the "
                        "conversion's own with --method attribution)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filler", default="repeat", help="attnzoo.evaluation.passkey's filler")
    p.add_argument("--output", type=Path, default=None, help="also write the scores as JSON here (a new file)")
    args = p.parse_args(argv)
    if args.output is not None and args.output.exists():
        raise SystemExit(f"--output {args.output} exists; name a new file (nothing is overwritten).")
    from attnzoo.convert.common import load_text_tokenizer

    settings = dict(length=args.length, min_distance=args.min_distance, seed=args.seed, filler=args.filler)
    if args.method == "attribution":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.source).eval()
        result = far_part_attributions(model, load_text_tokenizer(args.source), prompts=args.prompts or 4,
                                       steps=args.steps, **settings)
    else:
        from attnzoo.convert.llama import load_source

        model = load_source(args.source).eval()
        result = retrieval_scores(model, load_text_tokenizer(args.source), prompts=args.prompts or 8, **settings)
    if args.kv_heads is None:
        heads_by_layer = None
        chosen = top_layers(result["layer_scores"], args.top)
    else:
        kv_scores = kv_head_scores(result["head_scores"], model.config.num_key_value_heads, args.method)
        heads_by_layer = top_kv_heads(kv_scores, args.kv_heads)
        chosen = sorted(heads_by_layer)
        result["kv_head_scores"] = kv_scores
    far_kind, far_positions = args.far_kind or "block_window", args.far_positions or "fixed"
    if args.method == "attribution":
        far_kind, far_positions = (flag or own_setting(result, field, chosen, name) for flag, field, name in (
            (args.far_kind, "far_kinds", "--far_kind"), (args.far_positions, "far_positions_by_layer",
                                                         "--far_positions")))
    if heads_by_layer is None:
        result.update(top=chosen, **layout(len(result["layer_scores"]), chosen, far_kind, far_positions=far_positions))
    else:
        result.update(top=chosen, top_kv_heads=heads_by_layer, **head_layout(
            len(result["layer_scores"]), heads_by_layer, model.config.num_key_value_heads, far_kind,
            far_positions=far_positions))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(" ".join(f"{i}:{s:.3f}" for i, s in enumerate(result["layer_scores"])))
    if heads_by_layer is None:
        print(f"top {args.top} layers: {chosen}")
    else:
        print(f"top {args.kv_heads} key-value heads, by layer: {heads_by_layer}")
    settings = [f"attn_layers=[{','.join(result['attn_layers'])}]",
                f"far_positions=[{','.join(result['far_positions'])}]"]
    if heads_by_layer is not None:
        settings.append(f"far_kv_heads={json.dumps(result['far_kv_heads']).replace(' ', '')}")
    print(" ".join(f'"{setting}"' for setting in settings))
    return result


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        raise SystemExit(f"retrieval_layers: error: {error}") from None
