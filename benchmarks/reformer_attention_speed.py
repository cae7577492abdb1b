"""Figure 5 (right) of "Reformer: The Efficient Transformer" (arXiv 2001.04451) at CPU scale: attention speed as
the length grows with the total number of tokens fixed.

    python benchmarks/reformer_attention_speed.py --recipe benchmarks/recipes/reformer_attention_speed.yaml

Every point runs the same number of tokens (batch = total_tokens / length) through one causal self-attention layer
(hidden 256, 4 heads of 64, as the Reformer benchmark): "full" is the softmax family's attention (SDPA, the exact
O(L^2) baseline), "lsh-N" is the Reformer's LSH attention with N hash rounds and chunks of 64. The paper times
attention evaluation (a forward pass); `--backward` adds the backward pass. Time is the median of `--repeats` runs,
one thread by default so the machine's other work moves every point alike. Full attention's time per token grows
with the length; LSH's should stay flat. Results: benchmarks/results/reformer_attention_speed.{json,png} (`--output`),
replaced only by a report of the same setup (another setup's goes beside it; a file that is not this benchmark's
report is refused: benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import report_check, setup_or_legacy, timed_step_with_peak  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, write_report  # noqa: E402

from attnzoo import ZooReformerConfig  # noqa: E402
from attnzoo.modeling.attention import ATTENTION_REGISTRY  # noqa: E402
from attnzoo.training.recipes import parse_with_recipe  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/reformer_attention_speed"
EXPERIMENT = "Reformer (arXiv 2001.04451) Figure 5, right (attention speed, fixed total tokens)"
#: what makes a results file this benchmark's report (the committed ones, from before reports were marked, too)
REPORT_CHECK = report_check("config", "seconds", "device", benchmark="reformer_attention_speed", experiment=EXPERIMENT)
#: the setup of a report from before reports stored theirs: its config (every argument but the paths) and device
LEGACY_SETUP = setup_or_legacy(lambda r: {**r["config"], "device": r["device"]})


def attention_layer(kind: str, args) -> torch.nn.Module:
    """'full' -> exact softmax attention; 'lsh-N' -> LSH attention with N rounds (training and evaluation)."""
    rounds = int(kind.split("-")[1]) if kind.startswith("lsh-") else 1
    if kind != "full" and not (kind.startswith("lsh-") and kind[4:].isdigit()):
        raise ValueError(f"attention {kind!r} must be 'full' or 'lsh-N' (N hash rounds), e.g. lsh-4")
    config = ZooReformerConfig(hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
                               lsh_chunk_length=args.chunk_length, lsh_num_hashes=rounds, lsh_num_hashes_eval=rounds,
                               attention_probs_dropout_prob=0.0, lsh_full_attention_threshold=0)
    return ATTENTION_REGISTRY["full" if kind == "full" else "lsh"](config, layer_idx=0, causal=True)


def measure(kind: str, length: int, args) -> float:
    layer = attention_layer(kind, args).to(args.device)
    batch = args.total_tokens // length
    hidden = torch.randn(batch, length, args.hidden_size, device=args.device, requires_grad=args.backward)

    def step():
        if args.backward:
            layer(hidden).sum().backward()
        else:
            with torch.no_grad():
                layer(hidden)

    torch.manual_seed(0)
    seconds, _ = timed_step_with_peak(step, args.device, args.repeats)  # synchronises around every step
    return seconds


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for kind, points in report["seconds"].items():
        lengths = sorted(int(n) for n in points)
        ax.plot(lengths, [points[str(n)] for n in lengths], marker="o", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"sequence length (batch x length = {report['config']['total_tokens']} tokens)")
    ax.set_ylabel("seconds per attention " + ("forward+backward" if report["config"]["backward"] else "forward"))
    ax.set_title(f"Attention speed at a fixed token count ({report['device']})")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total_tokens", type=int, default=16384)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--attentions", nargs="+", default=["full", "lsh-1", "lsh-2", "lsh-4", "lsh-8"])
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--chunk_length", type=int, default=64)
    p.add_argument("--backward", action="store_true", help="time forward+backward instead of the forward alone")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", type=Path, default=RESULTS / "reformer_attention_speed.json")
    args = parse_with_recipe(p, argv)
    bad = [n for n in args.lengths if args.total_tokens % n]
    if bad:
        raise ValueError(f"lengths {bad} do not divide --total_tokens {args.total_tokens}; use powers of two up to it.")
    config = {k: v for k, v in vars(args).items() if k not in {"output", "recipe", "device"}}
    setup = {**config, "device": args.device}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    output = report_target(args.output, setup, REPORT_CHECK, f"{SCRIPT}.py", flag="--output", setup_of=LEGACY_SETUP)
    if args.threads:
        torch.set_num_threads(args.threads)
    seconds = {kind: {} for kind in args.attentions}
    for length in args.lengths:
        for kind in args.attentions:
            seconds[kind][str(length)] = measure(kind, length, args)
            print(f"length {length:6d} x batch {args.total_tokens // length:4d}  {kind:6s} "
                  f"{seconds[kind][str(length)] * 1000:9.1f} ms", flush=True)
    first, last = str(args.lengths[0]), str(args.lengths[-1])
    growth = {kind: points[last] / points[first] for kind, points in seconds.items()}
    report = {"benchmark": "reformer_attention_speed", "experiment": EXPERIMENT, "setup": setup,
              "device": args.device, "config": config, "seconds": seconds,
              f"time_at_{last}_over_time_at_{first}": growth}
    write_report(output, report)
    plot(report, output.with_suffix(".png"))
    print(f"time at length {last} / time at length {first}: " + ", ".join(f"{k} {v:.2f}x" for k, v in growth.items()))
    print(f"wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
