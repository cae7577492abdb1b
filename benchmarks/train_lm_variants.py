"""Train several variants of one language model with scripts/train_lm.py and compare their held-out bits/dim curves.

    python benchmarks/train_lm_variants.py benchmarks/recipes/reformer_shared_qk_reversible.yaml   # Figure 3
    python benchmarks/train_lm_variants.py benchmarks/recipes/reformer_hash_rounds.yaml            # Figure 4

(Figures 3 and 4 of "Reformer: The Efficient Transformer", arXiv 2001.04451, at CPU scale.)

An experiment file (YAML) holds:
  experiment   a title;
  prepare      optional: a command (list of arguments, run from the repository root) that makes the data, run when
               the file named by `prepare_creates` is missing;
  train_lm     the train_lm.py arguments every variant shares (as in a recipe; `model` is a list of NAME=VALUE);
  variants     name -> train_lm.py arguments of that variant (its `model` list is appended to the shared one);
  panels       optional: lists of variant names, one plot panel each (default: one panel with every variant);
  output       the results JSON (the plot is written beside it as .png).

Each variant runs as its own train_lm.py process with one thread (`--jobs` at once), writing to
OUTPUT_DIR/<variant>; the results JSON keeps each variant's held-out bits/dim curve, final figure, parameter count and
training time. Variants whose folder already holds all_results.json are read, not retrained (`--retrain` to redo);
`--partial` trains nothing and reports the finished variants, plus the held-out curve logged so far by unfinished
ones (listed under "missing", dashed in the plot). OUTPUT_DIR is a folder of this benchmark's own runs (a folder
holding anything else is refused; a variant retrained is cleared by its run's record), and `output` is replaced only
when it holds this benchmark's report (benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))  # the shared benchmark helpers

from owned_outputs import OutputFolder, exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/train_lm_variants"


def command_line(shared: dict, variant: dict, output_dir: Path) -> list[str]:
    """train_lm.py arguments for one variant: the shared ones, overridden by the variant's; model lists concatenate."""
    values = {**shared, **variant, "model": [*shared.get("model", []), *variant.get("model", [])]}
    values.update(output_dir=str(output_dir), report_to="jsonl")
    args = [sys.executable, str(ROOT / "scripts" / "train_lm.py")]
    for key, value in values.items():
        if key == "model":
            args += ["--model", *[str(v) for v in value]] if value else []
        elif isinstance(value, bool):
            args += [f"--{key}"] if value else []
        else:
            args += [f"--{key}", str(value)]
    return args


def read_curves(output_dir: Path) -> tuple[list[dict], list[dict]]:
    """(held-out curve, training curve) from a run's metrics.jsonl: one point per step, the last one logged (a
    resumed run logs again the steps between its checkpoint and the kill)."""
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]

    def curve(key: str) -> list[dict]:
        by_step = {m["step"]: m[key] for m in metrics if key in m}
        return [{"step": step, key: by_step[step]} for step in sorted(by_step)]

    return curve("eval_bits_per_dim"), curve("train_bits_per_dim")


def run_variant(name: str, argv: list[str], runs: OutputFolder, retrain: bool) -> dict:
    output_dir = runs.root / name
    results_file = output_dir / "all_results.json"
    if retrain or not results_file.is_file():
        runs.clear(name)  # the benchmark's own earlier run of the variant, by its record: a retrain starts over
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        log_file = runs.root / f"{name}.train.log"  # beside the run: the run owns its folder
        with open(log_file, "w") as log:
            done = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"variant {name} failed (exit {done.returncode}); see {log_file}")
    final = json.loads(results_file.read_text())
    curve, train = read_curves(output_dir)
    print(f"{name}: held-out bits/dim {final['eval_bits_per_dim']:.4f}, {final['num_parameters']:,} parameters, "
          f"{final['train_seconds']:.0f} s", flush=True)
    return {"eval_bits_per_dim": final["eval_bits_per_dim"], "num_parameters": final["num_parameters"],
            "train_seconds": final["train_seconds"], "eval_curve": curve, "train_curve": train,
            "command": " ".join(argv[1:])}


def unfinished_variant(output_dir: Path) -> dict | None:
    """What a run that has not finished has logged so far (None if it has logged no evaluation)."""
    if not (output_dir / "metrics.jsonl").is_file():
        return None
    curve, train = read_curves(output_dir)
    if not curve:
        return None
    return {"unfinished": True, "eval_bits_per_dim": curve[-1]["eval_bits_per_dim"], "last_step": curve[-1]["step"],
            "eval_curve": curve, "train_curve": train}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = report["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    colors = {}  # one colour per setting in every panel: "lsh4" and "lsh4_seed1" alike
    for ax, names in zip(axes[0], panels, strict=True):
        for name in names:
            run = report["variants"][name]
            setting, extra_seed = re.subn(r"_seed\d+$", "", name)
            color = colors.setdefault(setting, f"C{len(colors)}")
            curve = run["eval_curve"]
            note = f", unfinished at step {run['last_step']}" if run.get("unfinished") else ""
            # unfinished runs dashed; other seeds of a setting dotted, with square markers
            style = "--" if note else (":" if extra_seed else "-")
            ax.plot([p["step"] for p in curve], [p["eval_bits_per_dim"] for p in curve], color=color, linestyle=style,
                    marker="s" if extra_seed else "o", ms=3, label=f"{name} ({run['eval_bits_per_dim']:.3f}{note})")
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out bits/dim")
        ax.grid(alpha=0.3)
        ax.legend()
        tail = [p["eval_bits_per_dim"] for n in names for p in report["variants"][n]["eval_curve"][1:]]
        if tail:  # the first evaluations are far above the rest; show the part where the variants differ
            ax.set_ylim(min(tail) - 0.05, max(tail) + 0.05)
    fig.suptitle(report["experiment"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", type=Path, help="experiment YAML (see above)")
    p.add_argument("--output_dir", type=Path, default=None, help="runs folder (default: runs/<experiment file stem>)")
    p.add_argument("--jobs", type=int, default=2, help="variants trained at once")
    p.add_argument("--only", nargs="*", default=None, help="train only these variants")
    p.add_argument("--retrain", action="store_true", help="retrain variants that already have results")
    p.add_argument("--partial", action="store_true",
                   help="train nothing: report finished variants, and the curves unfinished ones have logged")
    args = p.parse_args(argv)
    spec = yaml.safe_load(args.experiment.read_text())
    missing = {"experiment", "train_lm", "variants", "output"} - set(spec)
    if missing:
        raise ValueError(f"{args.experiment} lacks the keys {sorted(missing)}; see this script's help.")
    names = list(spec["variants"])
    panels = spec.get("panels") or [names]
    unknown = sorted({n for panel in panels for n in panel} - set(names))
    if unknown:
        raise ValueError(f"panels name variants {unknown} that {args.experiment} does not define")
    if spec.get("prepare") and not (ROOT / spec["prepare_creates"]).exists():
        subprocess.run([sys.executable, *spec["prepare"]], cwd=ROOT, check=True)
    chosen = [n for n in names if args.only is None or n in args.only]
    output = ROOT / spec["output"]
    check_report = require_keys("experiment", "train_lm", "variants", benchmark="train_lm_variants")
    # before anything is trained: the runs folder is the benchmark's own (or new), and so is the report it replaces
    runs = OutputFolder(args.output_dir or ROOT / "runs" / args.experiment.stem, SCRIPT)
    if args.only is None:
        report_target(output, None, check_report, f"{SCRIPT}.py", flag=f"{args.experiment}'s output:")
    if not args.partial:  # claimed here, before the variants run in threads (one writer of the folder's record)
        for name in chosen:
            runs.path(name)
            runs.path(f"{name}.train.log")

    def one(name):
        if args.partial and not (runs.root / name / "all_results.json").is_file():
            return name, unfinished_variant(runs.root / name) if runs.owns(name) else None
        variant = spec["variants"][name] or {}
        return name, run_variant(name, command_line(spec["train_lm"], variant, runs.root / name), runs,
                                 args.retrain and not args.partial)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        variants = dict(pool.map(one, chosen))
    if args.only is not None:
        return
    missing = [n for n in names if variants[n] is None or variants[n].get("unfinished")]
    names = [n for n in names if variants[n] is not None]
    panels = [[n for n in panel if n in names] for panel in panels]
    recipe = args.experiment.resolve()
    report = {"experiment": spec["experiment"],
              "recipe": str(recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe),
              "train_lm": spec["train_lm"], "panels": panels,
              "variants": {n: {"settings": spec["variants"][n], **variants[n]} for n in names},
              "missing": missing}
    report = {"benchmark": "train_lm_variants", **report}
    write_report(output, report)
    plot(report, output.with_suffix(".png"))
    print(f"wrote {output} and {output.with_suffix('.png')}" + (f"; not finished: {missing}" if missing else ""))


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
