"""The two forms of separate-QK LSH's far part in an `lsh_window` layer, timed against each other: every earlier key
scored and all but the candidates masked (one [L, L] softmax), or each query's R x K candidates gathered. They give
the same values; the layer picks the masked form while the length is at most `DENSE_FAR_RATIO` x R x K. This
measures where the two cross on this machine, so that the setting rests on a measurement.

    python benchmarks/lsh_far_paths.py          # about a minute on 2 CPU cores

One causal layer (hidden 128, 4 heads of 32, window 32 + 4 sinks, 2 rounds, chunks of 32: the long-context
benchmark's layer, R x K = 64), forward and backward over a fixed number of tokens (batch = tokens / length), the
median of `--repeats` runs. Results: benchmarks/results/lsh_far_paths.{json,png} (`--output`), replaced only by a
report of the same setup (another setup's goes beside it; a file that is not this benchmark's report is refused:
benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import report_check, setup_or_legacy, timed_step_with_peak  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, write_report  # noqa: E402

import attnzoo.modeling.attention.lsh_window as lsh_window  # noqa: E402
from attnzoo import ZooReformerConfig  # noqa: E402
from attnzoo.modeling.attention import build_attention  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/lsh_far_paths"
EXPERIMENT = "separate-QK LSH far part, masked [L, L] scores vs gathered candidates"
#: what makes a results file this benchmark's report (the committed one, from before reports were marked, too)
REPORT_CHECK = report_check("config", "seconds", "gathered_over_masked_time", benchmark="lsh_far_paths",
                            experiment=EXPERIMENT)
#: the setup of a report from before reports stored theirs: its config (every argument) but the output path
LEGACY_SETUP = setup_or_legacy(lambda r: {**{k: v for k, v in r["config"].items() if k != "output"},
                                          "device": r["device"]})
#: DENSE_FAR_RATIO settings that force each form
PATHS = {"masked_scores": 10**9, "gathered_candidates": 0}


def layer(args) -> torch.nn.Module:
    config = ZooReformerConfig(hidden_size=128, num_attention_heads=4, window_size=32, num_sink_tokens=4,
                               lsh_chunk_length=32, lsh_num_hashes=args.rounds, lsh_shared_qk=False,
                               lsh_hash_seed=0, position_embedding_type="rotary", attention_probs_dropout_prob=0.0,
                               max_position_embeddings=max(args.lengths), attn_layers=["lsh_window"])
    return build_attention("lsh_window", config, 0, True).train()


def measure(attn, path: str, length: int, args) -> float:
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens // length, length, 128, requires_grad=True)
    saved = lsh_window.DENSE_FAR_RATIO
    lsh_window.DENSE_FAR_RATIO = PATHS[path]
    try:
        seconds, _ = timed_step_with_peak(lambda: attn(hidden).sum().backward(), "cpu", args.repeats)
    finally:
        lsh_window.DENSE_FAR_RATIO = saved
    return seconds


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, points in report["seconds"].items():
        lengths = sorted(int(n) for n in points)
        ax.plot(lengths, [points[str(n)] for n in lengths], marker="o", label=name)
    limit = report["dense_far_ratio"] * report["candidates_per_query"]
    ax.axvline(limit, color="grey", linestyle=":", label=f"layer's switch (L = {limit})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"sequence length (batch x length = {report['config']['tokens']} tokens)")
    ax.set_ylabel("seconds per forward + backward")
    ax.set_title("Separate-QK LSH far part: masked scores vs gathered candidates (CPU)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    p.add_argument("--output", type=Path, default=RESULTS / "lsh_far_paths.json")
    args = p.parse_args(argv)
    bad = [n for n in args.lengths if n < 1 or args.tokens % n]
    if bad:
        raise ValueError(f"--lengths {bad} must be positive and divide --tokens {args.tokens}.")
    setup = {**{k: v for k, v in vars(args).items() if k != "output"}, "device": "cpu"}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    output = report_target(args.output, setup, REPORT_CHECK, f"{SCRIPT}.py", flag="--output", setup_of=LEGACY_SETUP)
    if args.threads:
        torch.set_num_threads(args.threads)
    attn = layer(args)
    seconds = {name: {} for name in PATHS}
    for length in args.lengths:
        for name in PATHS:
            seconds[name][str(length)] = measure(attn, name, length, args)
        print(f"length {length:5d}: " + ", ".join(f"{name} {seconds[name][str(length)] * 1000:8.1f} ms"
                                                  for name in PATHS), flush=True)
    candidates = args.rounds * attn.far.recent_size
    ratio = {str(n): seconds["gathered_candidates"][str(n)] / seconds["masked_scores"][str(n)] for n in args.lengths}
    faster = [n for n in args.lengths if ratio[str(n)] > 1.0]
    report = {"benchmark": "lsh_far_paths", "experiment": EXPERIMENT, "setup": setup,
              "device": "cpu", "config": vars(args) | {"output": str(output)}, "seconds": seconds,
              "gathered_over_masked_time": ratio, "candidates_per_query": candidates,
              "dense_far_ratio": lsh_window.DENSE_FAR_RATIO,
              "longest_length_masked_is_faster": max(faster) if faster else None}
    write_report(output, report)
    plot(report, output.with_suffix(".png"))
    print(f"gathered / masked time: {ratio}; the layer switches at L = {lsh_window.DENSE_FAR_RATIO * candidates}")
    print(f"wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
