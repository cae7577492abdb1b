"""Causal LARA (this project's extension) against causal Performer and softmax on a byte-level LM.

    python benchmarks/causal_lara_lm.py                    # CPU-sized defaults
    python benchmarks/causal_lara_lm.py --steps 2000 --block_size 1024

Each family trains the same decoder (same sizes, data, seed, optimiser and number of steps) with scripts/train_lm.py
on the English text CPython ships, and is scored by held-out bits/dim. Results:
benchmarks/results/causal_lara_lm.json and .png (the training curves), replaced only by a report of the same setup
(another setup's goes beside it); --output_dir is a folder of this benchmark's own runs (benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared benchmark helpers

from owned_outputs import OutputFolder, exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/causal_lara_lm"
# LARA pins the noise scale its committed results were measured with (the family default was "official" then).
FAMILY_SETTINGS = {"softmax": [], "performer": ["num_random_features=64"],
                   "lara": ["lara_num_samples=16", "lara_chunk_size=64", "sample_noise_std=official"]}


def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "scripts" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--output_dir", type=Path, default=Path("runs/causal_lara_lm"))
    args = p.parse_args(argv)
    setup = {k: getattr(args, k) for k in ("steps", "block_size", "batch", "hidden", "layers")}
    setup["family_settings"] = FAMILY_SETTINGS
    # before anything is trained: the folder of runs and the report file are the benchmark's own (or new)
    runs = OutputFolder(args.output_dir, SCRIPT)
    target = report_target(RESULTS / "causal_lara_lm.json", setup,
                           require_keys("setup", "results", "summary", benchmark="causal_lara_lm"), f"{SCRIPT}.py",
                           flag="the report")
    script = train_lm()
    results = {}
    for family, extra in FAMILY_SETTINGS.items():
        out = args.output_dir / family
        runs.clear(family)  # the benchmark's earlier run, by its record: each run starts over
        bpd = script.main([
            "--family", family, "--output_dir", str(out),
            "--max_train_steps", str(args.steps),
            "--block_size", str(args.block_size), "--per_device_train_batch_size", str(args.batch),
            "--learning_rate", "2e-3", "--num_warmup_steps", str(max(1, args.steps // 15)), "--sample_tokens", "0",
            "--eval_steps", str(max(25, args.steps // 6 // 25 * 25)),
            "--model", f"hidden_size={args.hidden}", f"num_hidden_layers={args.layers}", "num_attention_heads=4",
            f"intermediate_size={4 * args.hidden}", "hidden_dropout_prob=0.0", *extra,
        ])
        curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        seconds = json.loads((out / "all_results.json").read_text())["train_seconds"]
        results[family] = {"eval_bits_per_dim": bpd, "train_seconds": seconds, "curve": curve}
        print(f"{family}: held-out bits/dim {bpd:.3f} after {args.steps} steps ({seconds:.0f} s)")
    summary = {f"{family}_minus_softmax_bits_per_dim": r["eval_bits_per_dim"] - results["softmax"]["eval_bits_per_dim"]
               for family, r in results.items() if family != "softmax"}
    print(json.dumps(summary, indent=2))
    write_report(target, {"benchmark": "causal_lara_lm", "setup": setup, "results": results, "summary": summary},
                 indent=2)
    plot(results, target.with_suffix(".png"), setup)


def plot(results, path, setup):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for family, r in results.items():
        train = [(c["step"], c["train_bits_per_dim"]) for c in r["curve"]]
        held_out = [(c["step"], c["eval_bits_per_dim"]) for c in r["curve"] if "eval_bits_per_dim" in c]
        line, = ax.plot(*zip(*train, strict=True), alpha=0.5, label=f"{family} train")
        if held_out:
            ax.plot(*zip(*held_out, strict=True), "o-", color=line.get_color(),
                    label=f"{family} held-out (final {r['eval_bits_per_dim']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("bits/dim")
    ax.set_ylim(top=4.0)
    ax.set_title(f"byte-level causal LM, {setup['layers']} layers x {setup['hidden']}, block {setup['block_size']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
