"""Passkey retrieval: can a checkpoint repeat a 5-digit pass key hidden at some depth in filler text? The test of
"Landmark Attention: Random-Access Infinite Context Length for Transformers" (arXiv 2305.16300) and "Extending
Context Window of Large Language Models via Positional Interpolation" (arXiv 2306.15595), generated offline by
attnzoo.evaluation.passkey (prompt layout, scoring and stopping rules are in its docstrings). Converted
linear-attention models are known to lose this kind of recall ("LoLA: Low-Rank Linear Attention With Sparse
Caching", arXiv 2505.23666).

    python benchmarks/passkey_retrieval.py --model_name_or_path runs/quickstart --model_name_or_path PATH2 \\
        --lengths 1024 2048 4096 8192 --depths 0 0.25 0.5 0.75 1 --trials 10 --seed 0 \\
        --max_seconds_per_length 600 --results benchmarks/results/passkey_retrieval.json

Any causal LM that AutoModelForCausalLM loads works (attnzoo checkpoints, with their remote code, or plain
transformers ones such as a LlamaForCausalLM); its tokenizer is loaded from the same folder unless --tokenizer names
one. Lengths are prompt lengths in the model's own tokens (one per byte for attnzoo's byte-level tokenizer), run
shortest first, "as far as each model can go": a length beyond a learned/axial position table is not run ("not run
(beyond max_position_embeddings=N)"; rotary and position-free models run at any length), out of memory halves the
batch down to 1 and then stops, and once a length takes longer than --max_seconds_per_length the longer ones are
not run. Every cell not run says why.

Writes the JSON given by --results (setup, per model: accuracy per length and depth, per-cell details, seconds per
length, cells not run and why; the command) and, per model, a heatmap <results stem>_<model>.png beside it (depth x
length, accuracy as colour, "n/a" where not run). With --model_card auto (the default), a local model folder's model
card (README.md) gets the accuracy per length, as model-index results and a "Passkey retrieval" table. The JSON and
its heatmaps are replaced only by a report of the same setup (another setup's goes beside it, with its heatmaps; a
file that is not this benchmark's report is refused: benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

# attnzoo's package import registers its families with the Auto classes (checkpoints saved without remote code)
from attnzoo.evaluation.passkey import FILLERS, SCORING, passkey_accuracy
from attnzoo.training.model_card import add_eval_results, passkey_eval_results

sys.path.insert(0, str(Path(__file__).parent))
from owned_outputs import Refused, exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/passkey_retrieval"
#: what makes a results file this benchmark's report (the committed one, from before reports were marked, too)
REPORT_CHECK = require_keys("setup", "models", "command", benchmark="passkey_retrieval")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # --model elsewhere means model settings (NAME=VALUE); here it is the older spelling of --model_name_or_path
    p.add_argument("--model_name_or_path", "--model", dest="model", type=Path, action="append", required=True,
                   help="a checkpoint folder (or Hub id) that AutoModelForCausalLM loads; repeat for several")
    p.add_argument("--tokenizer", default=None, help="the tokenizer to use for every model (default: each model's "
                                                     "own folder)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                   help="prompt lengths in tokens, run shortest first")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="fraction of the filler before the key line: 0 = at the start, 1 = right before the question")
    p.add_argument("--trials", type=int, default=10, help="prompts (keys) per length and depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=8, help="prompts per generate() call (halved on out of memory)")
    p.add_argument("--max_seconds_per_length", type=float, default=None,
                   help="once a length takes longer than this, longer lengths are not run (default: no limit)")
    p.add_argument("--digits", type=int, default=5, help="digits of the pass key")
    p.add_argument("--filler", choices=FILLERS, default="repeat",
                   help="'repeat': Landmark Attention's fixed sentences; 'corpus': prose sentences of the default "
                        "corpus drawn with the seed")
    p.add_argument("--no_task_description", dest="task_description", action="store_false",
                   help="leave out the opening task description (shorter minimum length)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--results", type=Path, default=RESULTS / "passkey_retrieval.json")
    p.add_argument("--model_card", choices=["auto", "none"], default="auto",
                   help="auto: write each local model folder's accuracies into its model card (README.md), beside "
                        "its other measured results; none: only the JSON")
    return p


def relative(path: Path) -> str:
    """`path` as written from the repository root when it lies inside it (results stay machine-independent)."""
    path = Path(path).absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def model_names(paths: list[Path]) -> list[str]:
    """A short unique name per model (its folder name; numbered when two folders share one), used as the JSON key
    and in the heatmap's file name."""
    names = [re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(p).name) or "model" for p in paths]
    return [f"{name}_{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def load(path: Path, tokenizer_name: str | None, device: str, dtype: str):
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or path, trust_remote_code=True)
    return model.to(device).eval(), tokenizer


def evaluate(path: Path, args) -> dict:
    model, tokenizer = load(path, args.tokenizer, args.device, args.dtype)
    started = time.time()
    result = passkey_accuracy(model, tokenizer, args.lengths, args.depths, trials=args.trials, seed=args.seed,
                              batch_size=args.batch_size, max_seconds_per_length=args.max_seconds_per_length,
                              digits=args.digits, filler=args.filler, task_description=args.task_description,
                              log=lambda line: print("  " + line, flush=True))
    not_run = [{"length": c["length"], "depth": c["depth"], "reason": c["status"]}
               for c in result["cells"] if c["status"] != "run"]
    return {"path": relative(path) if Path(path).exists() else str(path), "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "position_embedding_type": getattr(model.config, "position_embedding_type", None),
            "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
            "accuracy": result["accuracy"], "seconds_per_length": {n: v["seconds"] for n, v in
                                                                   result["lengths"].items()},
            "not_run": not_run, "stopped": result["stopped"], "lengths": result["lengths"], "cells": result["cells"],
            "wall_seconds": round(time.time() - started, 1)}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    started = time.time()
    setup = {"models": [str(path) for path in args.model], "tokenizer": args.tokenizer,
             "lengths": sorted(set(args.lengths)), "depths": args.depths, "trials": args.trials,
             "seed": args.seed, "batch_size": args.batch_size, "max_seconds_per_length": args.max_seconds_per_length,
             "digits": args.digits, "filler": args.filler, "task_description": args.task_description,
             "scoring": SCORING, "device": args.device, "dtype": args.dtype,
             "device_name": (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                             else platform.processor() or platform.machine())}
    # decided before evaluating: a file that is not this benchmark's report is refused with nothing run
    results = results_target(args, setup)
    report = {"benchmark": "passkey_retrieval", "setup": setup,
              "environment": {"torch": torch.__version__, "transformers": transformers.__version__}, "models": {}}
    for name, path in zip(model_names(args.model), args.model, strict=True):
        print(f"{name} ({path}):", flush=True)
        report["models"][name] = evaluate(path, args)
    report["command"] = "python benchmarks/passkey_retrieval.py " + " ".join(
        str(a) for a in (argv if argv is not None else sys.argv[1:]))
    report["wall_seconds"] = round(time.time() - started, 1)
    results.parent.mkdir(parents=True, exist_ok=True)
    for name, result in report["models"].items():
        png = heatmap_path(results, name)
        plot(name, result, png)
        result["heatmap"] = relative(png)
    if args.model_card == "auto":
        for (name, result), path in zip(report["models"].items(), args.model, strict=True):
            if Path(path).is_dir():
                card = Path(path) / "README.md"
                add_eval_results(card, passkey_eval_results(result["accuracy"], report["setup"]), name)
                result["model_card"] = relative(card)
    write_report(results, report, indent=2)
    print(f"wrote {relative(results)}", flush=True)
    return report


def heatmap_path(results: Path, name: str) -> Path:
    return results.with_name(f"{results.stem}_{name}.png")


def results_target(args, setup: dict) -> Path:
    """Where the report goes (owned_outputs.report_target); its heatmaps are drawn only beside a report of this
    benchmark's, never over a picture with none beside it."""
    target = report_target(args.results, setup, REPORT_CHECK, f"{SCRIPT}.py", companions=())
    if not target.exists():
        for png in (heatmap_path(target, name) for name in model_names(args.model)):
            if png.exists():
                raise Refused(f"{png} exists with no report of {SCRIPT}.py at {target} beside it; the benchmark would "
                              "draw over it. It is left as it is and nothing was written: name another --results (or "
                              "move that file away).")
    return target


def plot(name: str, result: dict, path: Path) -> None:
    """Depth (rows, 0 at the top) x length (columns) heatmap of accuracy; cells not run are grey, marked "n/a"."""
    import matplotlib

    matplotlib.use("Agg")
    import textwrap

    import matplotlib.pyplot as plt
    import numpy as np

    lengths = list(result["accuracy"])
    depths = list(next(iter(result["accuracy"].values())))
    grid = np.array([[np.nan if result["accuracy"][n][d] is None else 100 * result["accuracy"][n][d]
                      for n in lengths] for d in depths], dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.4 + 0.5 * len(depths)))
    colours = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=colours, vmin=0, vmax=100, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            text = "n/a" if np.isnan(grid[i, j]) else f"{grid[i, j]:.0f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [f"{int(n) // 1024}K" if int(n) % 1024 == 0 else n for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * float(d):.0f}%" for d in depths])
    reasons = sorted({cell["reason"] for cell in result["not_run"]})
    ax.set_xlabel("\n".join(["prompt length (tokens)", *(textwrap.fill("n/a: " + r, 60) for r in reasons)]),
                  fontsize=8)
    ax.set_ylabel("depth of the key")
    ax.set_title(f"{name}: pass key accuracy (%)", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05, label="accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
