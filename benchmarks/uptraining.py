"""Uptraining at CPU scale: does a softmax checkpoint converted to another attention family and fine-tuned beat the
same family trained from scratch for as many steps?

    nice -n 5 python benchmarks/uptraining.py            # about 25 minutes on 2 busy CPU cores

One command does all of it, on the English text CPython ships (byte-level, held-out = its last 5%):
1. trains a small GPT-2 with transformers' own `GPT2LMHeadModel` through scripts/train_lm.py
   (`--model_name_or_path` on a freshly initialised GPT-2 saved with attnzoo's byte-level tokenizer): the source;
2. converts it with `python -m attnzoo.convert.gpt2` to each family (default: Performer and causal LARA) and
   measures the converted model's held-out bits/dim before any training (scripts/evaluate.py);
3. fine-tunes each converted model for `--finetune_steps` steps with scripts/train_lm.py and
   recipes/uptrain_lm.yaml (the recipe a user would run), and, as the softmax reference, the source itself for the
   same steps;
4. trains each family from scratch (the converted model's exact config, new weights) for source + fine-tune steps,
   with the source's training settings.
Writes benchmarks/results/uptraining.json (held-out bits/dim of every run, curves, setup, the commands) and
uptraining.png (held-out bits/dim against the total number of training steps). Runs whose folder already holds
all_results.json are read instead of retrained (`--retrain` redoes them). --output_dir is a folder of this benchmark's
own runs, and --results is replaced only by a report of the same setup (benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared benchmark helpers

from owned_outputs import OutputFolder, exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

from attnzoo.training.run_dir import record_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/uptraining"
#: what makes a results file this benchmark's report (with the same setup, it is replaced)
REPORT_KEYS = ("setup", "summary", "source_runs", "families", "commands")
RESULTS = Path(__file__).parent / "results"
FINETUNE_RECIPE = ROOT / "recipes" / "uptrain_lm.yaml"
#: attention settings of each converted family (`--model` of the converter); the from-scratch runs use the same
FAMILY_SETTINGS = {"performer": ["num_random_features=64"], "lara": ["lara_chunk_size=64"],
                   "ra": [], "reformer": ["attn_layers=[local,lsh]"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["performer", "lara"], choices=sorted(FAMILY_SETTINGS))
    p.add_argument("--source_steps", type=int, default=300, help="training steps of the softmax GPT-2 source")
    p.add_argument("--finetune_steps", type=int, default=100, help="K: fine-tuning steps after the conversion")
    p.add_argument("--source_learning_rate", type=float, default=2e-3, help="source and from-scratch runs")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--eval_every", type=int, default=50, help="held-out evaluation every N steps of each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", type=Path, default=Path("runs/uptraining"))
    p.add_argument("--results", type=Path, default=RESULTS / "uptraining.json")
    p.add_argument("--retrain", action="store_true", help="redo runs that already finished")
    return p


def run(command: list[str], log: list[str], execute: bool = True) -> None:
    """Record a repository command and, if `execute`, run it (a fresh process per run, so no state leaks between
    runs). A run reused from an earlier invocation is recorded without running, so the report lists every command."""
    log.append(" ".join(str(c) for c in command))
    if execute:
        print("$", log[-1], flush=True)
        subprocess.run([sys.executable, *[str(c) for c in command]], cwd=ROOT, check=True)


def save_gpt2_source_init(folder: Path, args) -> None:
    """A freshly initialised transformers GPT2LMHeadModel (no dropout) with attnzoo's byte-level tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnzoo.tokenization import byte_level_tokenizer

    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=256, n_positions=args.block_size, n_embd=args.hidden, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                        eos_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(folder)
    byte_level_tokenizer(model_max_length=args.block_size).save_pretrained(folder)


def save_scratch_init(converted: Path, folder: Path, seed: int) -> None:
    """The converted model's config (same family, sizes and attention settings) with new random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import attnzoo  # noqa: F401

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(converted)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(converted).save_pretrained(folder)


def train(init: Path, out: Path, steps: int, args, log: list[str], recipe: Path | None = None,
          learning_rate: float | None = None, execute: bool = True, extra: list | None = None) -> None:
    """scripts/train_lm.py from the checkpoint `init` for `steps` steps (the recipe's settings, or the source's),
    with `extra` arguments last. `out` is missing or empty: the caller cleared its own earlier run there
    (OutputFolder.clear), so the run never replaces a folder the benchmark did not make."""
    command = ["scripts/train_lm.py", "--model_name_or_path", init, "--output_dir", out,
               "--max_train_steps", steps,
               "--block_size", args.block_size, "--per_device_train_batch_size", args.batch,
               "--eval_steps", args.eval_every, "--seed", args.seed, "--sample_tokens", 0, "--report_to", "jsonl",
               "--logging_steps", 25]
    if recipe is not None:
        command = [*command[:1], "--recipe", recipe.relative_to(ROOT), *command[1:]]
    else:
        command += ["--learning_rate", learning_rate, "--num_warmup_steps", max(1, steps // 15)]
    run([*command, *(extra or [])], log, execute)


def evaluate(folder: Path, args, log: list[str], execute: bool = True) -> float:
    """Held-out bits/dim of a saved model (scripts/evaluate.py, the same held-out split as train_lm.py)."""
    result_file = folder / "evaluation.json"
    run(["scripts/evaluate.py", "--model_name_or_path", folder, "--block_size", args.block_size,
         "--output_file", result_file], log, execute)
    record_outputs(folder, [result_file.name])  # the model folder's record lists it: a redo deletes it with the rest
    return json.loads(result_file.read_text())["bits_per_dim"]


def read_run(folder: Path) -> dict:
    results = json.loads((folder / "all_results.json").read_text())
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = {m["step"]: m["eval_bits_per_dim"] for m in metrics if "eval_bits_per_dim" in m}
    return {"eval_bits_per_dim": results["eval_bits_per_dim"], "train_steps": results["train_steps"],
            "train_seconds": results["train_seconds"],
            "curve": [{"step": s, "eval_bits_per_dim": curve[s]} for s in sorted(curve)]}


def relative(path: Path) -> str:
    """`path` as written from the repository root when it lies inside it (results stay machine-independent)."""
    path = Path(path).absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def benchmark_setup(args, **derived) -> dict:
    """The report's setup: every argument but --retrain (paths as written from the repository root), and `derived`."""
    setup = {k: (relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "retrain"}
    return {**setup, **derived}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    out, log, reused, started = args.output_dir, [], [], time.time()
    source_init, source = out / "source_init", out / "source"
    total_steps = args.source_steps + args.finetune_steps
    setup = benchmark_setup(args, total_steps=total_steps, finetune_recipe=str(FINETUNE_RECIPE.relative_to(ROOT)),
                            source_model="transformers GPT2LMHeadModel", corpus="CPython pydoc topics, byte-level")
    # before anything is trained: the folder of runs and the report file are the benchmark's own (or new)
    runs = OutputFolder(out, SCRIPT)
    target = report_target(args.results, setup, require_keys(*REPORT_KEYS, benchmark="uptraining"),
                           f"{SCRIPT}.py")

    def fresh(folder: Path, marker: str = "all_results.json") -> bool:
        """Whether `folder`'s run must be (re)done; a finished one is reused unless --retrain. A run to redo is
        cleared by its own record first (a folder the benchmark did not make is refused)."""
        runs.path(folder.name)
        if (folder / marker).is_file() and not args.retrain:
            reused.append(folder.name)
            return False
        runs.clear(folder.name)
        return True

    def save_init(folder: Path, save, *save_args) -> None:
        """A fresh initialisation saved into the benchmark's own folder (its earlier one cleared by its record)."""
        runs.clear(folder.name)
        save(*save_args)
        runs.saved(folder.name, None)

    if execute := fresh(source):
        save_init(source_init, save_gpt2_source_init, source_init, args)
    train(source_init, source, args.source_steps, args, log, learning_rate=args.source_learning_rate,
          execute=execute)
    runs_read = {"source": read_run(source)}
    train(source, out / "softmax_continued", args.finetune_steps, args, log, recipe=FINETUNE_RECIPE,
          execute=fresh(out / "softmax_continued"))
    runs_read["softmax_continued"] = read_run(out / "softmax_continued")
    families = {}
    for family in args.families:
        converted, uptrained = out / f"{family}_converted", out / f"{family}_uptrained"
        scratch_init, scratch = out / f"{family}_scratch_init", out / f"{family}_scratch"
        execute = fresh(converted, "evaluation.json")
        run(["-m", "attnzoo.convert.gpt2", source, converted, "--family", family, "--seed", args.seed,
             "--model", *FAMILY_SETTINGS[family]], log, execute)
        zero_shot = evaluate(converted, args, log, execute)
        train(converted, uptrained, args.finetune_steps, args, log, recipe=FINETUNE_RECIPE,
              execute=fresh(uptrained))
        if execute := fresh(scratch):
            save_init(scratch_init, save_scratch_init, converted, scratch_init, args.seed)
        train(scratch_init, scratch, total_steps, args, log, learning_rate=args.source_learning_rate,
              execute=execute)
        families[family] = {"converted_before_finetuning": zero_shot, "uptrained": read_run(uptrained),
                            "scratch": read_run(scratch), "settings": FAMILY_SETTINGS[family]}
    source_bpd = runs_read["source"]["eval_bits_per_dim"]
    summary = {"source_bits_per_dim": source_bpd,
               "softmax_continued_bits_per_dim": runs_read["softmax_continued"]["eval_bits_per_dim"]}
    for family, r in families.items():
        up, scratch = r["uptrained"]["eval_bits_per_dim"], r["scratch"]["eval_bits_per_dim"]
        summary[family] = {"converted_before_finetuning": r["converted_before_finetuning"], "uptrained": up,
                           "scratch_same_total_steps": scratch, "uptrained_minus_source": up - source_bpd,
                           "uptrained_minus_scratch": up - scratch}
    # wall_seconds covers this invocation; runs listed in reused_runs were read from an earlier one (each run's
    # own train_seconds is kept with it)
    report = {"benchmark": "uptraining", "setup": setup, "summary": summary, "source_runs": runs_read,
              "families": families, "commands": log, "reused_runs": reused,
              "wall_seconds": round(time.time() - started, 1)}
    write_report(target, report, indent=2)
    plot(report, target.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup, source_steps = report["setup"], report["setup"]["source_steps"]
    fig, ax = plt.subplots(figsize=(7, 4.4))

    def curve(points, offset=0, start=None):
        xs = [p["step"] + offset for p in points]
        ys = [p["eval_bits_per_dim"] for p in points]
        if start is not None:
            xs, ys = [offset, *xs], [start, *ys]
        return xs, ys

    source = report["source_runs"]["source"]
    ax.plot(*curve(source["curve"]), "o-", color="black",
            label=f"softmax GPT-2 source ({source['eval_bits_per_dim']:.3f})")
    continued = report["source_runs"]["softmax_continued"]
    ax.plot(*curve(continued["curve"], source_steps, source["eval_bits_per_dim"]), "o--", color="black", alpha=0.6,
            label=f"softmax, fine-tuned further ({continued['eval_bits_per_dim']:.3f})")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for colour, (family, r) in zip(colours, report["families"].items(), strict=False):
        up, scratch = r["uptrained"], r["scratch"]
        ax.plot(*curve(up["curve"], source_steps, r["converted_before_finetuning"]), "o-", color=colour,
                label=f"{family}: converted + fine-tuned ({up['eval_bits_per_dim']:.3f})")
        ax.plot(*curve(scratch["curve"]), "s:", color=colour, alpha=0.8,
                label=f"{family}: from scratch ({scratch['eval_bits_per_dim']:.3f})")
    ax.axvline(source_steps, color="grey", lw=0.8)
    ax.set_xlabel("total training steps (source + fine-tuning)")
    ax.set_ylabel("held-out bits/dim")
    ax.set_title(f"uptraining a byte-level GPT-2 ({setup['layers']} layers x {setup['hidden']}, block "
                 f"{setup['block_size']}, batch {setup['batch']})", fontsize=9)
    finals = [source["eval_bits_per_dim"], continued["eval_bits_per_dim"],
              *[r[k]["eval_bits_per_dim"] for r in report["families"].values() for k in ("uptrained", "scratch")]]
    ax.set_ylim(top=min(ax.get_ylim()[1], max(finals) + 0.6))  # early from-scratch points would flatten the rest
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- lm-eval on attnzoo's local tasks, shared with conversion_recovery.py and long_context.py ------------------
NEWLINE = 10  # the byte-level tokenizer's id of "\n"
#: the lm-eval figures the recovery average is taken over: (key, higher is better)
RECOVERY_METRICS = (("endings/acc_norm", True), ("next_word/exact_match", True), ("perplexity/bits_per_byte", False))


def recovery(scores: dict[str, float], source: dict[str, float]) -> dict:
    """Each lm-eval figure as a ratio to the source's (source / model where lower is better, so 1 = as good as the
    source, above 1 = better), and their average. A figure the source scores 0 on has no ratio: it is listed under
    "undefined" and left out of the average."""
    ratios, undefined = {}, []
    for key, higher in RECOVERY_METRICS:
        model_value, source_value = scores[key], source[key]
        if not source_value:
            undefined.append(key)
        elif higher:
            ratios[key] = model_value / source_value
        else:
            ratios[key] = source_value / model_value if model_value else float("inf")
    return {**ratios, "average": sum(ratios.values()) / len(ratios) if ratios else None, "undefined": undefined}


def lm_eval(folder: Path, out: Path, args, log: list[str], redo: bool = False) -> dict[str, float]:
    """attnzoo's local lm-eval tasks through scripts/evaluate.py (the model card gets the figures): {task/metric:
    value}. Read from `out` when an earlier evaluation left its scores there, unless `redo` (evaluate.py then
    replaces its own results file, and refuses any other)."""
    result_file = out / "lm_eval.json"
    # The byte-level models trained on raw bytes and never saw the tokenizer's special tokens, whose embeddings are
    # still their initial draws: rolling log-likelihoods start after a newline (the start of a paragraph), not
    # after lm-eval's default prefix, the BOS token. The same for every model, the source included.
    run(["scripts/evaluate.py", "--model_name_or_path", folder, "--lm_eval_tasks", "attnzoo_pydoc",
         "--lm_eval_limit", args.lm_eval_limit, "--lm_eval_model_args", f"prefix_token_id={NEWLINE}",
         "--output_file", result_file], log, redo or not result_file.is_file())
    rows = json.loads(result_file.read_text())["lm_eval"]
    return {f"{r['task'].removeprefix('attnzoo_pydoc_')}/{r['metric']}": r["value"] for r in rows}


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
