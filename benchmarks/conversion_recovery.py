"""How much of a Llama-architecture source a conversion keeps, measured the way the linearizing literature measures
it, at CPU scale: lm-evaluation-harness scores as ratios to the source (LoLCATs, arXiv 2410.10254, Table 3; Lizard,
arXiv 2507.09025; Liger, arXiv 2503.01496), passkey retrieval beyond the training length (LoLA, arXiv 2505.23666,
§4), and the training-free sliding window with attention sinks that every conversion has to beat at an equal decode
memory budget ("Sliding-window beats linear attention", arXiv 2608.28444).

    nice -n 5 python benchmarks/conversion_recovery.py        # about an hour on 2 idle CPU cores

One command does all of it, on the English text CPython ships (byte-level; held-out = its last 5%):
1. the source: transformers' `LlamaForCausalLM` (GQA, RMSNorm, SwiGLU, RoPE), as benchmarks/llama_uptraining.py
   builds it, trained with scripts/train_lm.py on text with passkey sequences mixed in (`--passkey_fraction`), so
   that it has the retrieval skill a conversion should keep;
2. each conversion (`python -m attnzoo.convert.llama`): every family, every family with the exact window inside each
   layer (favor_window, lara_window, ra_window, lsh_window), and an LSH hybrid; each gets the same token budget:
   attention transfer (scripts/transfer_attention.py, when its attentions have parameters of their own) and
   fine-tuning (scripts/train_lm.py with recipes/uptrain_lm.yaml's schedule), both on the same mixture of text and
   passkey sequences; one conversion is repeated on text alone, to measure what retrieval data adds;
3. the training-free baseline: the source cut to a window of W tokens plus 4 sinks, for several W (the equal-memory
   comparison picks, for each conversion, the smallest of these windows whose decoding state is at least as large);
4. for every model: held-out bits/dim (scripts/evaluate.py), lm-eval on attnzoo's local tasks built from held-out
   text (scripts/evaluate.py --lm_eval_tasks attnzoo_pydoc: multiple-choice endings, next-word generation, rolling
   perplexity), passkey accuracy at 1x, 2x, 4x and 8x the training length (benchmarks/passkey_retrieval.py, which
   also writes each model card's passkey table), the decoding state's size after a prefill of 1x and 8x the training
   length, and the tokens and seconds each conversion took.
Writes benchmarks/results/conversion_recovery.json (every figure, the setup, the commands) and conversion_recovery.png,
and rewrites README.md's recovery table from them (`--readme_only` does just that). Finished runs and evaluations in
--output_dir are read instead of redone (`--retrain` redoes them). --output_dir is a folder of this benchmark's own
runs, --results is replaced only by a report of the same setup (another setup's goes beside it), and README.md's table
is rewritten only from the committed report (benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the uptraining benchmarks' run helpers

from harness import cache_state_bytes, write_between_markers  # noqa: E402
from llama_uptraining import has_own_parameters, save_llama_source_init  # noqa: E402
from owned_outputs import (  # noqa: E402
    OutputFolder,
    exit_on_refusal,
    publishes_tables,
    read_report,
    report_target,
    require_keys,
    write_report,
)
from uptraining import (  # noqa: E402
    FINETUNE_RECIPE,
    RECOVERY_METRICS,
    ROOT,
    lm_eval,
    read_run,
    recovery,
    relative,
    run,
    train,
)

from attnzoo.training.run_dir import record_outputs  # noqa: E402

RESULTS = Path(__file__).parent / "results"
#: the committed report: the only one README.md's table is rendered from
COMMITTED_RESULTS = RESULTS / "conversion_recovery.json"
SCRIPT = "benchmarks/conversion_recovery"
#: what makes a results file this benchmark's report (with the same setup, it is replaced)
REPORT_KEYS = ("setup", "source", "baselines", "conversions", "summary")
README = ROOT / "README.md"
TABLE_START, TABLE_END = "<!-- conversion_recovery table: start -->", "<!-- conversion_recovery table: end -->"
#: 4 sinks, as StreamingLLM (arXiv 2309.17453) and the baseline's paper use
SINKS = 4
WINDOW = ["window_size=32", f"num_sink_tokens={SINKS}"]  # a quarter of the 128-token training length
LEARNED_FAVOR = ["feature_redraw=learned", "num_random_features=64"]
LSH = ["lsh_chunk_length=32", "lsh_num_hashes=2"]
#: name: (family, `--model` settings, passkey data in transfer and fine-tuning)
CONVERSIONS = {
    "performer": ("performer", LEARNED_FAVOR, True),
    "lara": ("lara", ["lara_landmark_transform=true", "lara_chunk_size=32"], True),
    "ra": ("ra", [], True),
    "reformer": ("reformer", ["attn_layers=[local,lsh]", "local_chunk_length=32", *LSH], True),
    "favor_window": ("performer", ["attn_layers=[favor_window]", *WINDOW, *LEARNED_FAVOR], True),
    "lara_window": ("lara", ["attn_layers=[lara_window]", *WINDOW, "lara_landmark_transform=true",
                             "lara_chunk_size=32"], True),
    "ra_window": ("ra", ["attn_layers=[ra_window]", *WINDOW], True),
    "lsh_window": ("reformer", ["attn_layers=[lsh_window]", *WINDOW, *LSH], True),
    "hybrid_favor_lsh_window": ("hybrid", ["attn_layers=[favor_window,lsh_window]", *WINDOW, *LEARNED_FAVOR, *LSH],
                                True),
    "lsh_window_text_only": ("reformer", ["attn_layers=[lsh_window]", *WINDOW, *LSH], False),
}
#: the training-free baseline's window sizes (plus the sinks): the equal-memory comparison's ladder, up to half of
#: the longest passkey prompt (at the training length and below, 124 and more are the source itself)
BASELINE_WINDOWS = (16, 32, 64, 124, 252, 508)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversions", nargs="+", default=list(CONVERSIONS), choices=list(CONVERSIONS))
    p.add_argument("--baseline_windows", type=int, nargs="+", default=list(BASELINE_WINDOWS))
    p.add_argument("--source_steps", type=int, default=4000, help="training steps of the Llama source")
    p.add_argument("--source_train_stride", type=int, default=64,
                   help="the source's training blocks start every N tokens: more distinct blocks, and as many more "
                        "distinct passkey sequences")
    p.add_argument("--source_learning_rate", type=float, default=2e-3)
    p.add_argument("--transfer_steps", type=int, default=150, help="attention-transfer steps")
    p.add_argument("--transfer_learning_rate", type=float, default=1e-2, help="LoLCATs' stage-1 rate")
    p.add_argument("--finetune_steps", type=int, default=300, help="fine-tuning steps after the transfer")
    p.add_argument("--passkey_fraction", type=float, default=0.5,
                   help="passkey sequences in the source's, the transfer's and the fine-tuning's data")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block_size", type=int, default=128, help="the training length")
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--eval_every", type=int, default=100, help="held-out evaluation every N steps of each run")
    p.add_argument("--length_multiples", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="passkey prompt lengths, in training lengths")
    p.add_argument("--passkey_depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--passkey_trials", type=int, default=5, help="keys per length and depth")
    p.add_argument("--lm_eval_limit", type=int, default=200, help="documents per lm-eval task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", type=Path, default=Path("runs/conversion_recovery"))
    p.add_argument("--results", type=Path, default=COMMITTED_RESULTS)
    p.add_argument("--retrain", action="store_true", help="redo runs and evaluations that already finished")
    p.add_argument("--readme_only", action="store_true",
                   help="only rewrite README.md's table from the results file (no runs)")
    return p


def check_arguments(args) -> None:
    for name in ("source_steps", "source_train_stride", "finetune_steps", "batch", "block_size", "passkey_trials",
                 "lm_eval_limit"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: set a positive number.")
    if any(w < 1 for w in args.baseline_windows):
        raise ValueError(f"--baseline_windows={args.baseline_windows}: window sizes must be positive.")
    if any(m < 1 for m in args.length_multiples):
        raise ValueError(f"--length_multiples={args.length_multiples}: multiples must be positive.")
    if not 0.0 <= args.passkey_fraction < 1.0:
        raise ValueError(f"--passkey_fraction={args.passkey_fraction} is invalid: set a fraction in [0, 1).")


# -- measurements -------------------------------------------------------------------------------------------------
def decode_state_bytes(folder: Path, lengths: list[int], seed: int) -> dict[str, int]:
    """Bytes the decoding cache holds (every tensor of every layer, float32) after a prefill of each length: what
    generation keeps per sequence. A recurrent or windowed state stays the same size; a KV cache grows."""
    import torch
    from transformers import AutoModelForCausalLM

    import attnzoo  # noqa: F401
    from attnzoo.transformers_compat import output_cache

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    sizes = {}
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=generator)
        with torch.no_grad():
            cache = output_cache(model(ids, use_cache=True))
        sizes[str(length)] = cache_state_bytes(cache)
    return sizes


def passkey(folder: Path, out: Path, args, log: list[str]) -> dict:
    """benchmarks/passkey_retrieval.py on one model at the length multiples (its model card gets the figures)."""
    lengths = [args.block_size * m for m in args.length_multiples]
    result_file = out / "passkey.json"
    run(["benchmarks/passkey_retrieval.py", "--model_name_or_path", folder, "--lengths", *lengths, "--depths",
         *args.passkey_depths, "--trials", args.passkey_trials, "--seed", args.seed, "--no_task_description",
         "--results", result_file], log, not result_file.is_file())
    model = next(iter(json.loads(result_file.read_text())["models"].values()))
    return {str(args.block_size * m): _mean(model["accuracy"][str(args.block_size * m)].values())
            for m in args.length_multiples}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def bits_per_dim(folder: Path, out: Path, args, log: list[str]) -> float:
    result_file = out / "evaluation.json"
    run(["scripts/evaluate.py", "--model_name_or_path", folder, "--block_size", args.block_size,
         "--output_file", result_file], log, not result_file.is_file())
    return json.loads(result_file.read_text())["bits_per_dim"]




def measure(folder: Path, args, log: list[str]) -> dict:
    """Every figure of one saved model, each computed when its file in `recovery_evaluation/` is missing (a model
    trained anew starts from an empty folder)."""
    out = folder / "recovery_evaluation"
    out.mkdir(exist_ok=True)
    state_file = out / "decode_state_bytes.json"
    if not state_file.is_file():
        state_file.write_text(json.dumps(decode_state_bytes(folder, [args.block_size, 8 * args.block_size],
                                                            args.seed)))
    figures = {"bits_per_dim": bits_per_dim(folder, out, args, log),
               "lm_eval": lm_eval(folder, out, args, log),
               "passkey_accuracy": passkey(folder, out, args, log),
               "decode_state_bytes": json.loads(state_file.read_text())}
    # the model folder's record lists what the evaluations wrote into it (their files and the model card), so that
    # a redo deletes them with the rest
    record_outputs(folder, [out.name, "README.md"])
    return figures


def equal_memory_baseline(state: int, baselines: dict[str, dict], context: str) -> str:
    """The smallest baseline window whose decoding state at `context` tokens is at least `state` bytes (the
    conversion gets no more memory than the baseline), or "source" when none is that large: then only the full KV
    cache, the source itself, spends as much."""
    fitting = [(b["decode_state_bytes"][context], name) for name, b in baselines.items()
               if b["decode_state_bytes"][context] >= state]
    return min(fitting)[1] if fitting else "source"


# -- the report ---------------------------------------------------------------------------------------------------
def goal_multiple(setup: dict) -> int:
    """The length (in training lengths) of the passkey goal: 4x, or the longest measured when 4x was not."""
    multiples = setup["length_multiples"]
    return 4 if 4 in multiples else max(multiples)


def summarize(report: dict) -> dict:
    source = report["source"]
    long = str(8 * report["setup"]["block_size"])
    four_x = str(goal_multiple(report["setup"]) * report["setup"]["block_size"])
    baselines = report["baselines"]
    reference = {**baselines, "source": source}
    rows = {}
    for name, r in {**report["conversions"], **baselines}.items():
        row = {"bits_per_dim": r["bits_per_dim"], "bits_per_dim_ratio": source["bits_per_dim"] / r["bits_per_dim"],
               "lm_eval_recovery": recovery(r["lm_eval"], source["lm_eval"]),
               "passkey_accuracy": r["passkey_accuracy"],
               "decode_state_bytes_per_token": {n: b / int(n) for n, b in r["decode_state_bytes"].items()},
               "decode_state_grows": r["decode_state_bytes"][long] > r["decode_state_bytes"][
                   str(report["setup"]["block_size"])]}
        if name in report["conversions"]:
            match = equal_memory_baseline(r["decode_state_bytes"][long], baselines, long)
            other = reference[match]
            row["equal_memory_baseline"] = match
            row["beats_equal_memory_baseline"] = {
                "bits_per_dim": r["bits_per_dim"] < other["bits_per_dim"],
                "lm_eval_recovery": (row["lm_eval_recovery"]["average"] or 0) > (
                    recovery(other["lm_eval"], source["lm_eval"])["average"] or 0),
                "passkey_at_4x": (r["passkey_accuracy"][four_x] or 0) > (other["passkey_accuracy"][four_x] or 0)}
            row["train_tokens"] = r["train_tokens"]
            row["train_seconds"] = r["train_seconds"]
        rows[name] = row
    passkey_4x = {name: row["passkey_accuracy"][four_x] for name, row in rows.items()}
    return {"rows": rows, "source_passkey_accuracy": source["passkey_accuracy"],
            "source_bits_per_dim": source["bits_per_dim"],
            "goal_every_conversion_beats_the_equal_memory_baseline": all(
                all(row["beats_equal_memory_baseline"].values()) for name, row in rows.items()
                if name in report["conversions"]),
            "goal_passkey_length": int(four_x),
            "goal_passkey_90_percent_at_4x": {name: v for name, v in passkey_4x.items() if (v or 0) >= 0.9}}


def results_table(report: dict) -> str:
    """The README's table, rendered from the results file (never typed by hand)."""
    setup, summary = report["setup"], report["summary"]
    lengths = [str(setup["block_size"] * m) for m in setup["length_multiples"]]
    head = " | ".join(f"passkey {int(n) // setup['block_size']}x" for n in lengths)
    lines = [f"| model | bits/dim (ratio) | lm-eval recovery | {head} | state at {lengths[-1]} tokens (KB) | "
             "equal-memory baseline: beaten on bits/dim, lm-eval, passkey 4x |",
             "|---|---|---|" + "---|" * len(lengths) + "---|---|"]
    source = report["source"]
    lines.append(f"| source: Llama, {setup['source_steps']} steps | {source['bits_per_dim']:.3f} | 1.000 | "
                 + " | ".join(_percent(source["passkey_accuracy"][n]) for n in lengths)
                 + f" | {source['decode_state_bytes'][lengths[-1]] / 1024:.0f} | |")
    for name, row in summary["rows"].items():
        state = report["conversions"].get(name, report["baselines"].get(name))["decode_state_bytes"][lengths[-1]]
        beaten = row.get("beats_equal_memory_baseline")
        verdict = "" if beaten is None else f"{row['equal_memory_baseline']}: " + ", ".join(
            "yes" if beaten[k] else "no" for k in ("bits_per_dim", "lm_eval_recovery", "passkey_at_4x"))
        lines.append(f"| {name} | {row['bits_per_dim']:.3f} ({row['bits_per_dim_ratio']:.2f}) | "
                     f"{_ratio(row['lm_eval_recovery']['average'])} | "
                     + " | ".join(_percent(row["passkey_accuracy"][n]) for n in lengths)
                     + f" | {state / 1024:.0f} | {verdict} |")
    return "\n".join(lines)


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _percent(value) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def update_readme(report: dict, readme: Path = README) -> None:
    """Replace the table between README.md's markers with the one rendered from `report`."""
    write_between_markers(readme, TABLE_START, TABLE_END, results_table(report))


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.readme_only:
        report = read_report(args.results, require_keys(*REPORT_KEYS, benchmark="conversion_recovery"), f"{SCRIPT}.py")
        if publishes_tables(args.results, COMMITTED_RESULTS):
            update_readme(report)
        else:
            print(f"{args.results} is not the committed report: README.md shows {relative(COMMITTED_RESULTS)}.")
        return report
    check_arguments(args)
    out, log, reused, started = args.output_dir, [], [], time.time()
    setup = {k: (relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
             if k not in ("retrain", "readme_only")}
    setup.update(source_model="transformers LlamaForCausalLM (GQA, RMSNorm, SwiGLU, RoPE)",
                 corpus="CPython pydoc topics, byte-level, with passkey sequences mixed in",
                 conversions={n: dict(zip(("family", "settings", "passkey_data"), CONVERSIONS[n], strict=True))
                              for n in args.conversions},
                 finetune_recipe=str(FINETUNE_RECIPE.relative_to(ROOT)),
                 recovery_metrics=[k for k, _ in RECOVERY_METRICS])
    # before anything is trained: the folder of runs and the report file are the benchmark's own (or new)
    runs = OutputFolder(out, SCRIPT)
    target = report_target(args.results, setup, require_keys(*REPORT_KEYS, benchmark="conversion_recovery"),
                           f"{SCRIPT}.py")

    def fresh(folder: Path, marker: str = "all_results.json") -> bool:
        runs.path(folder.name)  # a folder the benchmark did not make is refused
        if (folder / marker).is_file() and not args.retrain:
            reused.append(folder.name)
            return False
        runs.clear(folder.name)  # the benchmark's earlier run, by its record
        return True

    passkey_data = ["--passkey_fraction", args.passkey_fraction]
    source_init, source = out / "source_init", out / "source"
    if execute := fresh(source):
        runs.clear(source_init.name)
        save_llama_source_init(source_init, args, special_tokens=True)
        runs.saved(source_init.name, None)
    train(source_init, source, args.source_steps, args, log, learning_rate=args.source_learning_rate,
          execute=execute, extra=[*passkey_data, "--train_stride", args.source_train_stride])
    report = {"source": {**measure(source, args, log), "run": read_run(source)},
              "baselines": {}, "conversions": {}}

    for window in args.baseline_windows:
        name = f"window_{window}_{SINKS}_sinks"
        folder = out / name
        execute = fresh(folder, "config.json")
        run(["-m", "attnzoo.convert.llama", source, folder, "--family", "window", "--seed", args.seed, "--model",
             f"window_size={window}", f"num_sink_tokens={SINKS}"], log, execute)
        report["baselines"][name] = {"window_size": window, "sinks": SINKS, **measure(folder, args, log)}

    for name in args.conversions:
        family, settings, with_passkey = CONVERSIONS[name]
        data = passkey_data if with_passkey else []
        converted, transferred, finetuned = (out / f"{name}_{stage}" for stage in
                                             ("converted", "transferred", "finetuned"))
        run(["-m", "attnzoo.convert.llama", source, converted, "--family", family, "--seed", args.seed,
             "--model", *settings], log, fresh(converted, "config.json"))
        runs_read = []
        if has_own_parameters(converted):
            run(["scripts/transfer_attention.py", "--teacher", source, "--student", converted,
                 "--output_dir", transferred, "--max_train_steps", args.transfer_steps,
                 "--learning_rate", args.transfer_learning_rate, "--block_size", args.block_size,
                 "--per_device_train_batch_size", args.batch, "--seed", args.seed, *data], log, fresh(transferred))
            runs_read.append(json.loads((transferred / "all_results.json").read_text()))
        start = transferred if runs_read else converted
        execute = fresh(finetuned)
        train(start, finetuned, args.finetune_steps, args, log, recipe=FINETUNE_RECIPE, execute=execute, extra=data)
        runs_read.append(json.loads((finetuned / "all_results.json").read_text()))
        report["conversions"][name] = {
            "family": family, "settings": settings, "passkey_data": with_passkey,
            "train_tokens": sum(r["train_steps"] for r in runs_read) * args.batch * args.block_size,
            "train_seconds": round(sum(r["train_seconds"] for r in runs_read), 1),
            "transferred": len(runs_read) == 2, **measure(finetuned, args, log)}

    report = {"benchmark": "conversion_recovery", "setup": setup, **report}
    report["summary"] = summarize(report)
    report.update(commands=log, reused_runs=reused, wall_seconds=round(time.time() - started, 1))
    write_report(target, report, indent=2)
    plot(report, target.with_suffix(".png"))
    if publishes_tables(target, COMMITTED_RESULTS):  # the committed results: the README shows them
        update_readme(report)
    print(json.dumps(report["summary"], indent=2))
    return report


def plot(report: dict, path: Path) -> None:
    """Left: lm-eval recovery against the decoding state at 8x the training length (the baselines' ladder as a
    line: what memory buys without training). Right: passkey accuracy against prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup, rows = report["setup"], report["summary"]["rows"]
    long = str(8 * setup["block_size"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    baselines = [(report["baselines"][n]["decode_state_bytes"][long] / 1024, rows[n]["lm_eval_recovery"]["average"])
                 for n in report["baselines"]]
    left.plot(*zip(*sorted(baselines), strict=True), "k--o", label="window + sinks (no training)")
    for name, r in report["conversions"].items():
        left.scatter(r["decode_state_bytes"][long] / 1024, rows[name]["lm_eval_recovery"]["average"], label=name)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_xscale("log")
    left.set_xlabel(f"decoding state after {long} tokens (KB, per sequence)")
    left.set_ylabel("lm-eval recovery (ratio to the source)")
    left.legend(fontsize=6)
    left.set_title("quality at a decode memory budget", fontsize=9)
    lengths = [str(setup["block_size"] * m) for m in setup["length_multiples"]]
    multiples = setup["length_multiples"]
    right.plot(multiples, [100 * (report["source"]["passkey_accuracy"][n] or 0) for n in lengths], "k-o",
               label="source")
    for name, row in rows.items():
        style = "--" if name in report["baselines"] else "-"
        right.plot(multiples, [100 * (row["passkey_accuracy"][n] or 0) for n in lengths], style, marker=".",
                   label=name)
    right.set_xscale("log", base=2)
    right.set_xticks(multiples, [f"{m}x" for m in multiples])
    right.set_xlabel(f"prompt length (x the training length, {setup['block_size']} tokens)")
    right.set_ylabel("passkey accuracy (%)")
    right.legend(fontsize=6)
    right.set_title("passkey retrieval beyond the training length", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
