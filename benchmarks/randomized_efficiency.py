"""Table 6 of "Linear Complexity Randomized Self-attention Mechanism" (arXiv 2204.04667, §5.5 and appendix H.5):
time and peak memory of softmax, Performer, LARA and RA, side by side in one run.

    python benchmarks/randomized_efficiency.py --device cuda
    python benchmarks/randomized_efficiency.py --device cpu --lengths 1024 2048   # the committed CPU result

Set-up (the paper's appendix H.5 and Table 6): an 8-layer encoder, hidden 192, 3 heads, 16 random features
(Performer) and 16 samples (LARA), lengths 1K-8K. The paper does not state the FFN width or RA's sample count:
here FFN 768 (4x hidden) and one sample. One forward + backward of the encoder on random inputs (`inputs_embeds`,
batch `--batch`). Every configuration runs in its own worker process; see benchmarks/harness.py for how time
(median) and peak memory are read. Results: benchmarks/results/randomized_efficiency_<device>.json/.png (`--output`),
with every figure also given as a ratio to softmax at the same length; replaced only by a report of the same setup
(another setup's goes beside it; a file that is not this benchmark's report is refused: benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import cuda_device_name, run_worker, timed_step_with_peak  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/randomized_efficiency"
#: what makes a results file this benchmark's report (the committed ones, from before reports were marked, too)
REPORT_CHECK = require_keys("setup", "rows", "summary", benchmark="randomized_efficiency")
IMPLS = {
    "softmax": ("attnzoo_softmax", {}),
    "performer": ("attnzoo_performer", {"num_random_features": 16}),
    "lara": ("attnzoo_lara", {"lara_num_samples": 16}),
    "ra": ("attnzoo_ra", {"ra_num_samples": 1}),
}


def worker(impl: str, length: int, device: str, batch: int, repeats: int) -> dict:
    from transformers import AutoConfig, AutoModel

    import attnzoo  # noqa: F401

    model_type, extra = IMPLS[impl]
    config = AutoConfig.for_model(model_type, hidden_size=192, num_hidden_layers=8, num_attention_heads=3,
                                  intermediate_size=768, max_position_embeddings=length,
                                  position_embedding_type="none", hidden_dropout_prob=0.0, **extra)
    torch.manual_seed(0)
    model = AutoModel.from_config(config).to(device).train()
    x = torch.randn(batch, length, 192, device=device)

    def step():
        model.zero_grad(set_to_none=True)
        model(inputs_embeds=x).last_hidden_state.float().pow(2).mean().backward()

    seconds, peak = timed_step_with_peak(step, device, repeats)
    return {"impl": impl, "length": length, "ms": 1000 * seconds, "peak_MiB": peak}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 3072, 4096, 8192])
    p.add_argument("--impls", nargs="+", default=list(IMPLS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", type=Path, default=None,
                   help="default: benchmarks/results/randomized_efficiency_<device>.json")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        impl, length, device, batch, repeats = args.worker
        print(json.dumps(worker(impl, int(length), device, int(batch), int(repeats))))
        return

    device = cuda_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    setup = {"device": device, "batch": args.batch, "layers": 8, "hidden": 192, "heads": 3, "samples": 16,
             "lengths": args.lengths, "impls": args.impls, "repeats": args.repeats}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    out = report_target(args.output or RESULTS / f"randomized_efficiency_{args.device}.json", setup, REPORT_CHECK,
                        f"{SCRIPT}.py", flag="--output")
    rows = []
    for length in args.lengths:
        for impl in args.impls:
            row = run_worker(__file__, [impl, str(length), args.device, str(args.batch), str(args.repeats)])
            if row:
                rows.append(row)
                print(json.dumps(row))
    by = {(r["impl"], r["length"]): r for r in rows}
    for r in rows:
        base = by.get(("softmax", r["length"]))
        if base:
            r["ms_vs_softmax"] = r["ms"] / base["ms"]
            r["memory_vs_softmax"] = r["peak_MiB"] / max(base["peak_MiB"], 1e-9)
    summary = {}
    for length in args.lengths:
        lara, perf, soft = by.get(("lara", length)), by.get(("performer", length)), by.get(("softmax", length))
        if lara and perf:
            summary[f"lara_vs_performer_time_{length}"] = lara["ms"] / perf["ms"]
            summary[f"lara_vs_performer_memory_{length}"] = lara["peak_MiB"] / max(perf["peak_MiB"], 1e-9)
        if lara and soft:
            summary[f"lara_vs_softmax_time_{length}"] = lara["ms"] / soft["ms"]
    for key, value in summary.items():
        print(f"{key}: {value:.2f}")
    result = {"benchmark": "randomized_efficiency", "setup": setup, "torch": torch.__version__, "rows": rows,
              "summary": summary}
    write_report(out, result, indent=2)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for impl, style in zip(IMPLS, ("s--", "o-", "^-", "v:"), strict=True):
        rows = [r for r in result["rows"] if r["impl"] == impl]
        for ax, key in zip(axes, ("ms", "peak_MiB"), strict=True):
            ax.plot([r["length"] for r in rows], [r[key] for r in rows], style, label=impl)
    for ax, title in zip(axes, ("forward+backward time (ms)", "peak memory (MiB)"), strict=True):
        ax.set_xlabel("sequence length")
        ax.set_yscale("log")
        ax.set_title(f"{title}\n8-layer encoder, hidden 192, 3 heads, 16 samples; {result['setup']['device']}, "
                     f"batch {result['setup']['batch']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
