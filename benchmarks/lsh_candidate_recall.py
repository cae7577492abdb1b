"""Where LSH's far part loses the pass key, in the model itself: per far query head of a converted design with LSH far
parts (`lsh_window`, separate queries and keys), how much of the far attention its candidates hold (issue 47: the
LSH line).

`benchmarks/far_selection_recall.py` ranks block mean keys by rules that imitate hashing; this reads what the LSH far
part really returns. A converted design (default: `benchmarks/pretrained_long_context.py`'s `lsh_heads_centred`
model in its models folder) reads pass-key prompts (`attnzoo.evaluation.passkey`, the repeated filler) in one
forward. In every LSH far part, for the prompt's last query (the one that predicts the answer's first token), with s_j
its exact far score of key j (the far part's own q, k and scale), this records per query head:

- `candidates`: the log-sum-exp over the far part's candidates, its own returned log mass (each key counted once);
- `all_far`: the log-sum-exp over every far key (at least `window_size` back, past the sinks): a dense far part's;
- `key_line`: the log-sum-exp over the tokens of the pass-key line alone, and the rank of its best token among the
  far keys (0: the first).

Candidates that held the whole key line would have candidates >= key_line. A head with candidates < key_line
(`short`) certainly lost some of it, and one whose key line carries most of its far mass (key_line - all_far >=
log 1/2, `reading`) is a head that reads the key: the summary counts, per length, the reading heads whose candidates
fall short, the share of the far mass the candidates hold, exp(candidates - all_far), in reading heads and in all,
and, with no threshold, the part of the key line's far attention (its shares exp(key_line - all_far) summed over all
heads) that sits in heads whose candidates fall short.
The checks are exact sums of the model's own scores, no imitation of the hashing.

    python benchmarks/lsh_candidate_recall.py    # 4K, 8K, 16K: benchmarks/results/lsh_candidate_recall.json, .png

Each prompt's row is kept in the report as it is measured; a rerun with the same setup measures only the prompts the
report lacks (`--remeasure`: all). On 2 cores a prompt costs the design's prefill and its load: for
`lsh_heads_centred` about 25 s at 4K, 100 s at 8K and 2.5 minutes at 16K.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import rows_report_check, save_figure  # noqa: E402
from owned_outputs import BadArgument, exit_on_refusal  # noqa: E402
from passkey_probe import (  # noqa: E402
    KEY,
    add_probe_arguments,
    checked_model,
    patched_far_parts,
    probed_prompt,
    run_probe,
)

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "results" / "lsh_candidate_recall.json"
LABEL = "benchmarks/lsh_candidate_recall.py"
#: a head reads the key line when the line carries at least half of its far mass
READING = math.log(0.5)
#: candidates below the key line's log mass by more than this have certainly lost some of it (float32 sums)
TOLERANCE = 1e-3


def default_model() -> str | None:
    found = sorted((ROOT / "runs" / "pretrained_long_context").glob("lsh_heads_centred-*"))
    return str(found[-1]) if found else None


def lsh_far_parts(model) -> dict:
    """{layer index: its LSH far part} of every layer with one; BadArgument naming --model when there is none."""
    from attnzoo.evaluation.retrieval_layers import far_layers
    from attnzoo.modeling.attention.lsh_window import LSHFarPart

    parts = {index: layer.far for index, layer in far_layers(model).items() if isinstance(layer.far, LSHFarPart)}
    if not parts:
        raise BadArgument("--model: it has no LSH far part; give a design with lsh_window layers (e.g. "
                          "pretrained_long_context's lsh_heads_centred).")
    return parts


def recorded_heads(model, key_line, record: list):
    """Within the block, each LSH far part's parallel form appends, per query head of the first row's last real
    query, (layer, head, candidates, all_far, key_line, best rank) to `record` (see the module docstring)."""
    import torch

    def wrap(index, far, x, original):
        out = original(x)
        position = int(x.n_real[0]) - 1
        q = x.q[0, :, position]  # [H, d]
        keys = far.expand_kv(x.k[:1])[0, :, :position + 1]  # [H, N, d]
        scores = torch.einsum("hd,hnd->hn", q.float(), keys.float()) * far.scale
        far_keys = torch.zeros(position + 1, dtype=torch.bool, device=scores.device)
        far_keys[far.sinks:max(position - far.window_size + 1, far.sinks)] = True
        far_scores = scores.masked_fill(~far_keys, float("-inf"))
        line = far_scores[:, key_line]
        candidates = out.den[0, :, position].float().log() + out.log_scale[0, :, position].float()
        rank = (far_scores > line.amax(-1, keepdim=True)).sum(-1)
        record.extend((index, head, *values) for head, values in enumerate(zip(
            candidates.tolist(), far_scores.logsumexp(-1).tolist(), line.logsumexp(-1).tolist(), rank.tolist(),
            strict=True)))
        return out

    return patched_far_parts(lsh_far_parts(model), wrap)


def measure(job: dict) -> dict:
    """One prompt's row: each far query head's log masses (see the module docstring) and the first answer token."""
    import torch

    record = []
    _, prompt, first = probed_prompt(job, lambda model, prompt: recorded_heads(
        model, torch.arange(prompt.key_position, prompt.key_end), record))
    return {"heads": [{"layer": layer, "head": head, "candidates": cand, "all_far": every, "key_line": line,
                       "key_rank": rank} for layer, head, cand, every, line, rank in record],
            "first_answer_token": first, "passkey": prompt.passkey}


def is_short(head: dict) -> bool:
    """Its candidates weigh less than the key line alone: they lost part of it."""
    return head["candidates"] < head["key_line"] - TOLERANCE


def head_summary(heads: list[dict]) -> dict:
    """Counts and far-mass shares over some heads' records (see the module docstring)."""
    reading = [h for h in heads if h["key_line"] - h["all_far"] >= READING]
    short = [h for h in reading if is_short(h)]

    def held(chosen):
        return (sum(math.exp(min(h["candidates"] - h["all_far"], 0.0)) for h in chosen) / len(chosen)
                if chosen else None)

    line_mass = [math.exp(h["key_line"] - h["all_far"]) for h in heads]
    lost = sum(m for h, m in zip(heads, line_mass, strict=True) if is_short(h))
    return {"far_query_heads": len(heads), "reading_heads": len(reading), "reading_heads_short": len(short),
            "reading_heads_holding_share": 1 - len(short) / len(reading) if reading else None,
            "far_mass_held": held(heads), "far_mass_held_reading": held(reading),
            "heads_short": sum(map(is_short, heads)),
            "key_line_mass_in_short_heads": lost / sum(line_mass) if heads else None}


def summary(rows: list[dict]) -> dict:
    out = {}
    for length in sorted({r["length"] for r in rows}):
        chosen = [r for r in rows if r["length"] == length]
        out[str(length)] = {"prompts": len(chosen), **head_summary([h for r in chosen for h in r["heads"]]),
                            "first_answer_tokens": [r["first_answer_token"] for r in chosen]}
    return out


validate = rows_report_check(LABEL, *KEY, "heads", "first_answer_token")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    for length in sorted({r["length"] for r in report["rows"]}):
        heads = [h for r in report["rows"] if r["length"] == length for h in r["heads"]]
        axis.scatter([h["key_line"] - h["all_far"] for h in heads],
                     [min(h["candidates"] - h["all_far"], 0.0) for h in heads], s=12, label=f"{length} tokens")
    low = min([min(h["key_line"], h["candidates"]) - h["all_far"] for r in report["rows"] for h in r["heads"]] + [-1.0])
    axis.plot([low, 0], [low, 0], color="grey", linewidth=0.8, label="candidates = key line")
    axis.axvline(READING, color="grey", linestyle=":", linewidth=0.8)
    axis.set(xlabel="log share of the far mass on the key line", ylabel="log share the candidates hold")
    axis.legend()
    fig.suptitle("LSH far part per far query head, last query: below the line, key line lost")
    save_figure(fig, path)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_arguments(parser, COMMITTED, "a converted design with lsh_window far parts (default: "
                                           "pretrained_long_context's lsh_heads_centred model)",
                        [4096, 8192, 16384])
    args = parser.parse_args(argv)
    model = checked_model(args, default_model(), "a saved converted design with lsh_window far parts (run "
                                                 "benchmarks/pretrained_long_context.py --designs lsh_heads_centred "
                                                 "first for the default)")
    config = json.loads((Path(model) / "config.json").read_text())
    reach = config.get("window_size", 0) + config.get("num_sink_tokens", 0)
    if any(n <= reach for n in args.lengths):
        raise BadArgument(f"--lengths {args.lengths}: the model's window and sinks span {reach} tokens, so a prompt "
                          f"of that length or less has no far key; give lengths above {reach}.")
    return run_probe(args, model, {}, validate, LABEL, measure, summary, plot)


if __name__ == "__main__":
    exit_on_refusal(main, LABEL)
