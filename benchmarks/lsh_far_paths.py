"""Separate-QK LSH's far part in an `lsh_window` layer, its fast form against its dense reference, forward and
backward: the sorted blocks the layer runs (queries laid out by where their candidates end among each round's
(bucket, position)-sorted keys, each block scoring one span of K + 32 keys; docs/lsh_attention.md, §7) against the
layer's `reference_forward` (every earlier key scored and all but the candidates masked, one [L, L] softmax, the
form the layer ran at training lengths until the blocks beat it at every length). Both give the same values.

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
EXPERIMENT = "separate-QK LSH far part, sorted blocks vs the dense masked reference"
#: what makes a results file this benchmark's report (the committed one, from before reports were marked, too)
REPORT_CHECK = report_check("config", "seconds", "blocks_over_reference_time", benchmark="lsh_far_paths",
                            experiment=EXPERIMENT)
#: the setup of a report from before reports stored theirs: its config (every argument) but the output path
LEGACY_SETUP = setup_or_legacy(lambda r: {**{k: v for k, v in r["config"].items() if k != "output"},
                                          "device": r["device"]})
#: the forms timed: the layer's forward, and its dense reference
PATHS = ("sorted_blocks", "reference")


def layer(args) -> torch.nn.Module:
    config = ZooReformerConfig(hidden_size=128, num_attention_heads=4, window_size=32, num_sink_tokens=4,
                               lsh_chunk_length=32, lsh_num_hashes=args.rounds, lsh_shared_qk=False,
                               lsh_hash_seed=0, position_embedding_type="rotary", attention_probs_dropout_prob=0.0,
                               max_position_embeddings=max(args.lengths), attn_layers=["lsh_window"])
    return build_attention("lsh_window", config, 0, True).train()


def measure(attn, path: str, length: int, args) -> float:
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens // length, length, 128, requires_grad=True)
    forward = attn if path == "sorted_blocks" else attn.reference_forward
    seconds, _ = timed_step_with_peak(lambda: forward(hidden).sum().backward(), "cpu", args.repeats)
    return seconds


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, points in report["seconds"].items():
        lengths = sorted(int(n) for n in points)
        ax.plot(lengths, [points[str(n)] for n in lengths], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"sequence length (batch x length = {report['config']['tokens']} tokens)")
    ax.set_ylabel("seconds per forward + backward")
    ax.set_title("Separate-QK LSH far part: sorted blocks vs dense reference (CPU)")
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
    ratio = {str(n): seconds["sorted_blocks"][str(n)] / seconds["reference"][str(n)] for n in args.lengths}
    slower = [n for n in args.lengths if ratio[str(n)] > 1.0]
    report = {"benchmark": "lsh_far_paths", "experiment": EXPERIMENT, "setup": setup,
              "device": "cpu", "config": vars(args) | {"output": str(output)}, "seconds": seconds,
              "blocks_over_reference_time": ratio, "candidates_per_query": candidates,
              "sorted_block": lsh_window.SORTED_BLOCK,
              "longest_length_reference_is_faster": max(slower) if slower else None}
    write_report(output, report)
    plot(report, output.with_suffix(".png"))
    print(f"sorted blocks / reference time: {ratio}")
    print(f"wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
