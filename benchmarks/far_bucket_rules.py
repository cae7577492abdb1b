"""Which bucketing of the far keys finds the pass key, on the real model's own queries and keys: angular LSH with
random rotations against content buckets learned from a calibration text, and block retrieval's position blocks, each
with the number of keys it reads (issue 47: the LSH line).

`benchmarks/lsh_candidate_recall.py` showed that `lsh_heads_centred`'s candidates miss the key line in half of the
heads that read it. This asks why, and what bucketing would not. A converted design with block retrieval far parts in
every head (default: `benchmarks/pretrained_long_context.py`'s `block_wide_quantised` model) reads pass-key prompts
(`attnzoo.evaluation.passkey`, the repeated filler) in one forward; every far part's queries and keys are recorded,
and the same model's far keys over the last --calibration_length tokens of the default corpus (the text
`lsh_heads_centred` centres its keys on) give each key-value head its centre and its k-means centroids (Lloyd's
iterations from evenly spaced keys: no randomness). For the prompt's last query (the one that predicts the answer's
first token) in every far query head, with p_j its exact softmax over the far keys (at least `window_size` back,
past the sinks), each rule chooses a set of far keys:

- `blocks_T`: the T blocks of `block_size` consecutive far keys whose mean key scores highest against the query
  (block retrieval's rule, for one query);
- `rotations_BxR`: angular LSH as `lsh_heads_centred` hashes (keys minus the calibration centre; per round a random
  rotation into B / 2 directions, the bucket the argmax over [xR, -xR]; seeded): per round the K most recent far keys
  of the query's bucket, the union over R rounds;
- `centroids_CxP`: content buckets: each far key in the bucket of its nearest centroid (after the centre), the query
  probing the P buckets whose members' mean key (over the prompt's far keys: what a decoder can keep, a sum and a
  count per bucket) scores highest, reading each one's K most recent members;
- `centroids_CxP_fixed`: the same buckets probed by the calibration's centroids themselves;
- `centroids_CxP_mass`: the same buckets ranked by their members' log mass, q·m / √d + log n (m their mean key, n
  their number): by Jensen's inequality a lower bound on log Σ exp(q·k / √d) over the members, the bucket's share of
  the exact softmax (`lsh_member_score="log_mass"`), where the mean alone ranks one key above a thousand that score
  a little lower.

A row counts the far query heads and holds, per head whose far attention gives the key line at least 5% and per
rule, the share of the key line's far attention the set holds, the share of all far attention, and the keys read (the
set's size; the blocks' mean keys and the buckets' scores are not counted). The summary counts heads that read the
key line (it carries at least half of their far mass): their mean key-line share and share of all far attention, how
many hold at least half of the key line's, and the median keys read.

    python benchmarks/far_bucket_rules.py     # 8K and 16K: benchmarks/results/far_bucket_rules.json, .png
    python benchmarks/far_bucket_rules.py --lengths 32768    # the log mass at 32K: a report beside (its rules)

Each prompt's row is kept in the report as it is measured; a rerun with the same setup measures only the prompts the
report lacks (`--remeasure`: all). On 2 cores a prompt costs the design's prefill (about 1 minute at 8K for
`block_wide_quantised`) and a run the calibration's forward and k-means once.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import rows_report_check, save_figure  # noqa: E402
from owned_outputs import BadArgument, exit_on_refusal  # noqa: E402
from passkey_probe import (  # noqa: E402
    KEY,
    add_probe_arguments,
    block_far_parts,
    checked_model,
    patched_far_parts,
    probed_prompt,
    run_probe,
)

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "results" / "far_bucket_rules.json"
LABEL = "benchmarks/far_bucket_rules.py"
RULES = ["blocks_8", "rotations_64x8", "rotations_64x32", "centroids_256x8", "centroids_256x16",
         "centroids_256x16_fixed", "centroids_256x16_mass"]
#: how a centroids rule ranks the buckets: its suffix, none for the members' mean
RANKINGS = ("fixed", "mass")
#: a head reads the key line when the line carries at least half of its far mass
READING = 0.5
#: rows keep the heads whose far attention gives the key line at least this share (the others hold nothing the
#: summary reads; all of them would make a report of a few dozen prompts tens of megabytes)
KEPT_SHARE = 0.05
#: Lloyd's iterations of the calibration's k-means
KMEANS_ITERATIONS = 20
#: {(model, calibration length): {layer: calibration keys [kv_heads, n, d]}} and each key-value head's centre and
#: centroids: one calibration forward and k-means per run
_CALIBRATION: dict = {}


def default_model() -> str | None:
    found = sorted((ROOT / "runs" / "pretrained_long_context").glob("block_wide_quantised-*"))
    return str(found[-1]) if found else None


def parse_rule(rule: str) -> tuple[str, tuple[int, ...], str | None]:
    """'blocks_T' | 'rotations_BxR' | 'centroids_CxP[_fixed|_mass]' -> (kind, numbers, the ranking suffix or None);
    BadArgument naming --rules."""
    parts = rule.split("_")
    ranking = parts[-1] if parts[-1] in RANKINGS and parts[0] == "centroids" else None
    parts = parts[:-1] if ranking else parts
    try:
        if len(parts) != 2 or parts[0] not in ("blocks", "rotations", "centroids"):
            raise ValueError
        numbers = tuple(int(n) for n in parts[1].split("x"))
        if len(numbers) != (1 if parts[0] == "blocks" else 2) or min(numbers) < 1:
            raise ValueError
    except ValueError:
        raise BadArgument(f"--rules {rule!r}: give blocks_T, rotations_BxR or centroids_CxP[_fixed|_mass] with "
                          "positive numbers, e.g. rotations_64x8.") from None
    if parts[0] == "rotations" and (numbers[0] < 2 or numbers[0] % 2):
        raise BadArgument(f"--rules {rule!r}: rotations hash into an even number of buckets >= 2.")
    if parts[0] == "centroids" and numbers[1] > numbers[0]:
        raise BadArgument(f"--rules {rule!r}: a query cannot probe more buckets than the {numbers[0]} there are.")
    return parts[0], numbers, ranking


def recorded_far_inputs(model, record: dict):
    """Within the block, each block far part's parallel form puts (q [H, n, d], k [kv_heads, n, d]) of the first
    row's real tokens in `record` under its layer index."""
    def wrap(index, far, x, original):
        n = int(x.n_real[0])
        record[index] = (x.q[0, :, :n].float(), x.k[0, :, :n].float())
        return original(x)

    parts = block_far_parts(model, "a design with block_window far parts in every head (e.g. block_wide_quantised)")
    return patched_far_parts(parts, wrap)


def calibration_keys(job: dict) -> dict:
    """{layer: keys [kv_heads, n, d]} of the model's far parts over the last --calibration_length tokens of the
    default corpus (as pretrained_long_context's `centre_keys` takes them), once per run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnzoo.corpus import default_corpus_text

    cached = (job["model"], job["calibration_length"])
    if cached not in _CALIBRATION:
        length = job["calibration_length"]
        model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(job["model"])
        ids = list(tokenizer(default_corpus_text()[-8 * length:], add_special_tokens=False)["input_ids"])[-length:]
        record: dict = {}
        with torch.inference_mode(), recorded_far_inputs(model, record):
            model(torch.tensor([ids]), logits_to_keep=1)
        _CALIBRATION.clear()  # another model's or length's keys and buckets are not needed again
        _CALIBRATION[cached] = {index: k for index, (_, k) in record.items()}
    return _CALIBRATION[cached]


def calibrated_buckets(job: dict, calibration: dict, layer: int, kv_head: int, counts: list[int]):
    """(centre [d], {count: centroids [count, d]}) of a key-value head's calibration keys (centroids fitted to the
    keys minus the centre), once per run."""
    cached = ("buckets", job["model"], job["calibration_length"], layer, kv_head)
    if cached not in _CALIBRATION:
        _CALIBRATION[cached] = (calibration[layer][kv_head].mean(0), {})
    centre, centroids = _CALIBRATION[cached]
    for count in counts:
        if count not in centroids:
            centroids[count] = kmeans(calibration[layer][kv_head] - centre, count)
    return centre, centroids


def kmeans(x, count: int):
    """Centroids [count, d] of points x [n, d] after KMEANS_ITERATIONS of Lloyd's, started from evenly spaced points
    (an emptied centroid keeps its place)."""
    import torch

    centroids = x[torch.linspace(0, len(x) - 1, count).long()].clone()
    for _ in range(KMEANS_ITERATIONS):
        nearest = torch.cdist(x, centroids).argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, nearest, x)
        counts = torch.bincount(nearest, minlength=count)[:, None]
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
    return centroids


def most_recent_members(buckets, wanted, recent: int):
    """[n] bool: for buckets [n] (far keys in position order) and the wanted bucket ids [P], each wanted bucket's
    `recent` most recent members."""

    member = buckets[:, None] == wanted[None, :]  # [n, P]
    later = member.flip(0).cumsum(0).flip(0)  # members at or after each key
    return (member & (later <= recent)).any(1)


def chosen_keys(rule: str, query, keys, centre, centroids: dict, generator, block_size: int, recent: int):
    """[n] bool: the far keys `rule` gives the query [d], from the far keys [n, d] (position order)."""
    import torch

    kind, numbers, ranking = parse_rule(rule)
    n = keys.shape[0]
    if kind == "blocks":
        blocks = n // block_size
        means = keys[:blocks * block_size].view(blocks, block_size, -1).mean(1)
        top = (means @ query).topk(min(numbers[0], blocks)).indices
        chosen = torch.zeros(blocks, dtype=torch.bool)
        chosen[top] = True
        return torch.cat([chosen.repeat_interleave(block_size), chosen.new_zeros(n - blocks * block_size)])
    centred = keys - centre
    if kind == "rotations":
        buckets, rounds = numbers
        rotations = torch.randn(rounds, keys.shape[-1], buckets // 2, generator=generator)

        def hashed(x):
            turned = torch.einsum("nd,rdb->rnb", x, rotations)
            return torch.cat([turned, -turned], -1).argmax(-1)  # [R, n]

        key_buckets, query_buckets = hashed(centred), hashed(query[None])
        return torch.stack([most_recent_members(key_buckets[r], query_buckets[r], recent)
                            for r in range(rounds)]).any(0)
    count, probes = numbers
    fitted = centroids[count]
    nearest = torch.cdist(centred, fitted).argmin(1)
    if ranking == "fixed":
        score = fitted @ query
    else:  # members' mean key (with "mass", plus log n); an empty bucket is never probed
        members = torch.bincount(nearest, minlength=count)
        means = torch.zeros_like(fitted).index_add_(0, nearest, keys) / members.clamp(min=1)[:, None]
        score = means @ query
        if ranking == "mass":
            score = score / math.sqrt(keys.shape[-1]) + members.clamp(min=1).log()
        score = score.masked_fill(members == 0, float("-inf"))
    return most_recent_members(nearest, score.topk(probes).indices, recent)


def measure(job: dict) -> dict:
    """One prompt's row: the far query heads counted, and per head (layer, head) whose far attention gives the key
    line at least KEPT_SHARE, the key line's share, and per rule the shares of the key line's and of all far
    attention its keys hold and how many it reads."""
    import torch

    record: dict = {}
    model, prompt, first = probed_prompt(job, lambda model, prompt: recorded_far_inputs(model, record))
    config = model.config
    window, sinks, block_size = config.window_size, config.num_sink_tokens, config.block_size
    calibration = calibration_keys(job)
    counts = sorted({parse_rule(rule)[1][0] for rule in job["rules"] if rule.startswith("centroids")})
    generator = torch.Generator().manual_seed(job["seed"])
    last = len(prompt.input_ids) - 1
    heads, far_heads = [], 0
    for index in sorted(record):
        q, k = record[index]
        query_heads, kv_heads, dim = q.shape[0], k.shape[0], q.shape[-1]
        far_end = last - window + 1  # far keys: positions [sinks, far_end)
        if far_end <= sinks:
            continue
        for kv in range(kv_heads):
            keys = k[kv, sinks:far_end]
            centre, centroids = calibrated_buckets(job, calibration, index, kv, counts)
            for head in range(kv * query_heads // kv_heads, (kv + 1) * query_heads // kv_heads):
                query = q[head, last]
                p = torch.softmax(keys @ query / math.sqrt(dim), 0)
                line = torch.zeros(len(keys), dtype=torch.bool)
                line[prompt.key_position - sinks:prompt.key_end - sinks] = True
                line_mass = p[line].sum()
                far_heads += 1
                # every rule draws its rotations, so a head left out of the row draws them too
                chosen = {rule: chosen_keys(rule, query, keys, centre, centroids, generator, block_size,
                                            job["recent"]) for rule in job["rules"]}
                if line_mass < KEPT_SHARE:
                    continue
                heads.append({"layer": index, "head": head, "key_line_share": line_mass.item(), "rules": {
                    rule: {"key_line_held": (p[keys_of & line].sum() / line_mass).item(),
                           "far_held": p[keys_of].sum().item(), "keys_read": int(keys_of.sum())}
                    for rule, keys_of in chosen.items()}})
    return {"far_keys": last - window + 1 - sinks, "far_query_heads": far_heads, "heads": heads,
            "first_answer_token": first}


def summary(rows: list[dict], rules: list[str]) -> dict:
    """Per length, over its prompts' heads that read the key line: per rule the mean key-line share held and the mean
    share of all far attention, the heads holding at least half of the key line's, the median keys read."""
    out = {}
    for length in sorted({r["length"] for r in rows}):
        reading = [h for r in rows if r["length"] == length for h in r["heads"] if h["key_line_share"] >= READING]
        entry = {"prompts": sum(r["length"] == length for r in rows),
                 "far_query_heads": sum(r["far_query_heads"] for r in rows if r["length"] == length),
                 "reading_heads": len(reading), "rules": {}}
        for rule in rules:
            held = [h["rules"][rule] for h in reading if rule in h["rules"]]
            if held:
                entry["rules"][rule] = {
                    "key_line_held_mean": statistics.mean(h["key_line_held"] for h in held),
                    "far_held_mean": statistics.mean(h["far_held"] for h in held),
                    "heads_holding_half": sum(h["key_line_held"] >= 0.5 for h in held),
                    "keys_read_median": statistics.median(h["keys_read"] for h in held)}
        out[str(length)] = entry
    return out


validate = rows_report_check(LABEL, *KEY, "heads", "far_keys", "far_query_heads")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, rules = list(report["summary"]), report["setup"]["rules"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(len(lengths), 1)
    for i, length in enumerate(lengths):
        entry = report["summary"][length]["rules"]
        at = [j + i * width for j in range(len(rules))]
        axes[0].bar(at, [entry.get(r, {}).get("key_line_held_mean", 0.0) for r in rules], width,
                    label=f"{length} tokens")
        axes[1].bar(at, [entry.get(r, {}).get("keys_read_median", 0.0) for r in rules], width,
                    label=f"{length} tokens")
    for axis, label in zip(axes, ("key line's far attention held (mean over reading heads)",
                                  "far keys read (median)"), strict=True):
        axis.set_xticks([j + width * (len(lengths) - 1) / 2 for j in range(len(rules))], rules, rotation=45,
                        ha="right")
        axis.set(ylabel=label)
        axis.legend()
    axes[0].set_ylim(0, 1)
    if any(bar.get_height() > 0 for bar in axes[1].patches):  # (a log axis of nothing but zeros warns)
        axes[1].set_yscale("log")
    fig.suptitle("Bucketing the far keys: random rotations, learned content buckets, position blocks")
    save_figure(fig, path)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_arguments(parser, COMMITTED, "a converted design with block_window far parts in every head (default: "
                                           "pretrained_long_context's block_wide_quantised model)", [8192, 16384])
    parser.add_argument("--rules", nargs="+", default=RULES,
                        help="blocks_T, rotations_BxR, centroids_CxP[_fixed|_mass]")
    parser.add_argument("--recent", type=int, default=512,
                        help="K: the most recent keys of a bucket a query reads (lsh_heads_centred's 512)")
    parser.add_argument("--calibration_length", type=int, default=4096,
                        help="tokens of the default corpus' end that give the centres and centroids")
    args = parser.parse_args(argv)
    model = checked_model(args, default_model(), "a saved converted design with block_window far parts in every "
                                                 "head (run benchmarks/pretrained_long_context.py --designs "
                                                 "block_wide_quantised first for the default)")
    for rule in args.rules:
        parse_rule(rule)
    for name in ("recent", "calibration_length"):
        if getattr(args, name) < 1:
            raise BadArgument(f"--{name}={getattr(args, name)}: give a positive integer.")
    largest = max([parse_rule(r)[1][0] for r in args.rules if r.startswith("centroids")], default=0)
    if largest > args.calibration_length:
        raise BadArgument(f"--calibration_length={args.calibration_length}: k-means needs at least as many "
                          f"calibration keys as the {largest} centroids --rules asks for.")
    rules = list(dict.fromkeys(args.rules))
    return run_probe(args, model, {"rules": rules, "recent": args.recent,
                                   "calibration_length": args.calibration_length}, validate, LABEL, measure,
                     lambda rows: summary(rows, rules), plot, rules=rules, recent=args.recent,
                     calibration_length=args.calibration_length)


if __name__ == "__main__":
    exit_on_refusal(main, LABEL)
