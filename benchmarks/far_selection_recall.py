"""Which selection rule finds the pass key's block: block retrieval's exact scores against angular LSH, on the real
model's own queries and keys (issue 47: why LSH's far part misses what block retrieval finds).

A converted design with block retrieval (`block_window` far parts; default: `benchmarks/pretrained_long_context.py`'s
`block_heads` model in its models folder) reads pass-key prompts (`attnzoo.evaluation.passkey`, the repeated
filler). In every far part, the prompt's last query block selects far-key blocks with its selection query σ (its
first query plus the block_size queries before it) against each block's mean key (block_window.py's rule). Per query
head that reads a far part, this records whether the top-k blocks under each rule hold a block of the key line:

- `exact`: σ · mean key, block retrieval's own ranking;
- `cosine`, `cosine_centred`: the angle between σ and the mean key, as they are and with the head's mean of the
  mean keys subtracted: the ranking angular LSH estimates (it hashes directions and drops norms), without the noise
  of hashing;
- `lsh_BxR_raw|centred|mips`: collision counts of R rounds of angular LSH with B buckets (random rotations, argmax
  over [xR, -xR], as `lsh_hashing.hash_buckets` hashes; seeded), ties to the more recent block, on the mean keys as
  they are, centred, or through Simple-LSH's transform for inner products (keys divided by the largest norm and given
  the coordinate sqrt(1 - |k|^2), the query a 0 there: "On Symmetric and Asymmetric LSHs for Inner Product Search",
  arXiv 1410.5410), under which the angle ranks as the dot product does.

    python benchmarks/far_selection_recall.py            # benchmarks/results/far_selection_recall.json and .png

Each prompt's row is kept in the report as it is measured; a rerun with the same setup measures only the prompts the
report lacks (`--remeasure`: all). On 2 cores a prompt costs the design's prefill (about 25 s at 8K, 2 min at 32K for
`block_heads`).
"""

from __future__ import annotations

import argparse
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
COMMITTED = ROOT / "benchmarks" / "results" / "far_selection_recall.json"
LABEL = "benchmarks/far_selection_recall.py"
#: (buckets, rounds) of the LSH rules
HASHINGS = ["8x8", "16x16", "8x32", "16x32", "64x32"]
VARIANTS = ("raw", "centred", "mips")



def default_model() -> str | None:
    found = sorted((ROOT / "runs" / "pretrained_long_context").glob("block_heads-*"))
    return str(found[-1]) if found else None


def rule_names(hashings: list[str]) -> list[str]:
    return ["exact", "cosine", "cosine_centred", *(f"lsh_{h}_{v}" for h in hashings for v in VARIANTS)]


def parse_hashing(text: str) -> tuple[int, int]:
    """'BxR' -> (buckets, rounds); BadArgument naming --hashings and the fix."""
    try:
        buckets, rounds = (int(part) for part in text.split("x"))
    except ValueError:
        raise BadArgument(f"--hashings {text!r}: give BUCKETSxROUNDS, e.g. 16x32.") from None
    if buckets < 2 or buckets % 2 or rounds < 1:
        raise BadArgument(f"--hashings {text!r}: give an even number of buckets >= 2 and rounds >= 1.")
    return buckets, rounds


def recorded_selections(model, record: list):
    """Within the block, each block far part's parallel form appends (σ [H, d], block mean keys [H, M, d]) of the
    last query block of the first row to `record`, per layer in order."""
    def wrap(index, far, x, original):
        record.append(last_selection(far, x.q[0], x.k[0], int(x.n_real[0])))
        return original(x)

    return patched_far_parts(block_far_parts(model, "a design with block_window far parts (e.g. block_heads)"), wrap)


def last_selection(far, q, k, n_real: int):
    """(σ [H, d], mean keys [H, M, d]) of the query block holding the row's last real token (block_window.py's
    rule: its first query and the `block_size` queries before it; the M blocks whose every key is far from it)."""
    size, qsize = far.size, far.query_size
    start = (n_real - 1) // qsize * qsize
    sigma = q[:, start] + q[:, max(start - size, 0):start].sum(1)
    blocks = max((start - far.window_size - far.sinks + 1) // size, 0)
    keys = k[:, far.sinks:far.sinks + blocks * size].reshape(k.shape[0], blocks, size, k.shape[-1]).mean(2)
    return sigma.double(), far.expand_kv(keys[None])[0].double()


def top_by_rule(sigma, keys, topk: int, rule: str, generator):
    """[H, min(topk, M)] block indices that `rule` ranks first."""
    import torch

    blocks = keys.shape[1]
    if rule == "exact":
        score = (sigma[:, None] * keys).sum(-1)
    elif rule.startswith("cosine"):
        keys = keys - keys.mean(1, keepdim=True) if rule.endswith("centred") else keys
        score = (sigma[:, None] * keys).sum(-1) / keys.norm(dim=-1).clamp(min=1e-30)
    else:
        _, shape, variant = rule.split("_")
        buckets, rounds = parse_hashing(shape)
        if variant == "centred":
            keys = keys - keys.mean(1, keepdim=True)
        elif variant == "mips":
            keys = keys / keys.norm(dim=-1, keepdim=True).amax(1, keepdim=True).clamp(min=1e-30)
            keys = torch.cat([keys, (1 - (keys * keys).sum(-1, keepdim=True)).clamp(min=0).sqrt()], -1)
            sigma = torch.cat([sigma, torch.zeros_like(sigma[:, :1])], -1)
        rotations = torch.randn(rounds, keys.shape[-1], buckets // 2, generator=generator, dtype=keys.dtype)

        def hashed(x):
            turned = torch.einsum("...d,rdb->...rb", x / x.norm(dim=-1, keepdim=True).clamp(min=1e-30), rotations)
            return torch.cat([turned, -turned], -1).argmax(-1)

        counts = (hashed(keys) == hashed(sigma)[:, None]).sum(-1).to(keys.dtype)
        score = counts + torch.arange(blocks, dtype=keys.dtype) / (10 * blocks)  # ties to the more recent block
    return score.topk(min(topk, blocks), dim=-1).indices


def measure(job: dict) -> dict:
    """One prompt's row: per rule, the query heads (of all far parts) whose top-k holds a block of the key line."""
    import torch

    record = []
    model, prompt, first = probed_prompt(job, lambda model, prompt: recorded_selections(model, record))
    topk = model.config.block_topk
    size, sinks = model.config.block_size, model.config.num_sink_tokens
    key_blocks = set(range((prompt.key_position - sinks) // size, (prompt.key_end - 1 - sinks) // size + 1))
    generator = torch.Generator().manual_seed(job["seed"])
    found = dict.fromkeys(rule_names(job["hashings"]), 0)
    heads = 0
    for sigma, keys in record:
        heads += sigma.shape[0]
        for rule in found:
            chosen = top_by_rule(sigma, keys, topk, rule, generator)
            found[rule] += sum(bool(key_blocks & set(row.tolist())) for row in chosen)
    return {"heads": heads, "found": found, "selectable_blocks": record[0][1].shape[1] if record else 0,
            "key_blocks": sorted(key_blocks), "first_answer_token": first}


def summary(rows: list[dict], rules: list[str]) -> dict:
    """Per length: the share of far query heads (over its prompts) whose top-k under each rule holds the key."""
    out = {}
    for length in sorted({r["length"] for r in rows}):
        chosen = [r for r in rows if r["length"] == length]
        heads = sum(r["heads"] for r in chosen)
        out[str(length)] = {"prompts": len(chosen), "far_query_heads": heads,
                            "found_share": {rule: sum(r["found"].get(rule, 0) for r in chosen) / heads
                                            for rule in rules if heads}}
    return out


validate = rows_report_check(LABEL, *KEY, "heads", "found")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(report["summary"])
    rules = report["setup"]["rules"]
    fig, axis = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / max(len(lengths), 1)
    for i, length in enumerate(lengths):
        shares = [report["summary"][length]["found_share"].get(rule, 0.0) for rule in rules]
        axis.bar([j + i * width for j in range(len(rules))], shares, width, label=f"{length} tokens")
    axis.set_xticks([j + width * (len(lengths) - 1) / 2 for j in range(len(rules))], rules, rotation=60, ha="right")
    axis.set(ylabel="far query heads whose top-k holds the key", ylim=(0, 1))
    axis.legend()
    fig.suptitle("The pass key's block in the top-k: block retrieval's scores against angular LSH")
    save_figure(fig, path)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_arguments(parser, COMMITTED, "a converted design with block_window far parts (default: "
                                           "pretrained_long_context's block_heads model)", [8192, 32768])
    parser.add_argument("--hashings", nargs="+", default=HASHINGS, help="LSH settings as BUCKETSxROUNDS")
    args = parser.parse_args(argv)
    model = checked_model(args, default_model(), "a saved converted design with block_window far parts (run "
                                                 "benchmarks/pretrained_long_context.py --designs block_heads first "
                                                 "for the default)")
    for hashing in args.hashings:
        parse_hashing(hashing)
    rules = rule_names(args.hashings)
    return run_probe(args, model, {"rules": rules}, validate, LABEL, measure, lambda rows: summary(rows, rules), plot,
                     hashings=args.hashings)


if __name__ == "__main__":
    exit_on_refusal(main, LABEL)
