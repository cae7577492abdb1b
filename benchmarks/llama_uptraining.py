"""Linearizing a Llama-architecture model at CPU scale: convert it into each family, align the new attention to the
source's (attention transfer), fine-tune, and compare with the source and with training from scratch.

    nice -n 5 python benchmarks/llama_uptraining.py        # about 30 minutes on 2 CPU cores

One command does all of it, on the English text CPython ships (byte-level; held-out = its last 5%, as
scripts/train_lm.py splits it):
1. the source: transformers' own `LlamaForCausalLM` with grouped-query attention (4 query heads, 2 key/value heads),
   RMSNorm, SwiGLU and rotary positions, freshly initialised with attnzoo's byte-level tokenizer and trained with
   scripts/train_lm.py until its held-out bits/dim flattens (the report gives the last evaluations' slope);
2. each conversion (`python -m attnzoo.convert.llama`): FAVOR+ with a learnable projection, causal LARA with its
   landmark transforms, Reformer (local + LSH layers), RA, and a hybrid with one exact softmax layer in four (FAVOR+
   in the others), measured as converted;
3. attention transfer (scripts/transfer_attention.py): everything frozen but each attention's own parameters, which
   learn to reproduce the source's per-layer attention outputs; families with nothing of their own (RA, Reformer)
   skip it, as the docs say;
4. fine-tuning of the whole converted model (scripts/train_lm.py with recipes/uptrain_lm.yaml's schedule);
5. for reference, the training-free window-with-sinks baseline of "Sliding-window beats linear attention" (arXiv
   2608.28444) and FAVOR+ with such a window inside every layer, through the same stages;
6. the same architecture from scratch (the converted config, new weights) for the uptrained model's whole token
   budget: the source's steps + transfer + fine-tuning.
For every stage it reports held-out bits/dim and swap fidelity, KL(source || model) in bits per token on held-out
blocks. Writes benchmarks/results/llama_uptraining.json (every figure, the curves, the setup and the commands) and
llama_uptraining.png, and rewrites README.md's table from them (`--readme_only` does just that). Runs already
finished in --output_dir are read instead of redone (`--retrain` redoes them). --output_dir is a folder of this
benchmark's own runs, --results is replaced only by a report of the same setup (another setup's goes beside it), and
README.md's table is rewritten only from the committed report (benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the GPT-2 uptraining benchmark's run helpers

from harness import write_between_markers  # noqa: E402
from owned_outputs import (  # noqa: E402
    OutputFolder,
    exit_on_refusal,
    publishes_tables,
    read_report,
    report_target,
    require_keys,
    write_report,
)
from uptraining import FINETUNE_RECIPE, ROOT, read_run, relative, run, save_scratch_init, train  # noqa: E402

from attnzoo.training.run_dir import record_outputs  # noqa: E402

RESULTS = Path(__file__).parent / "results"
#: the committed report: the only one README.md's table is rendered from
COMMITTED_RESULTS = RESULTS / "llama_uptraining.json"
SCRIPT = "benchmarks/llama_uptraining"
#: what makes a results file this benchmark's report (with the same setup, it is replaced)
REPORT_CHECK = require_keys("setup", "summary", "source_run", "conversions", benchmark="llama_uptraining")
#: `--model` of each conversion; the from-scratch runs use the converted config as it is
CONVERSIONS = {
    "performer": ("performer", ["feature_redraw=learned", "num_random_features=64"]),
    "lara": ("lara", ["lara_landmark_transform=true", "lara_chunk_size=32"]),
    "reformer": ("reformer", ["attn_layers=[local,lsh]", "local_chunk_length=32", "lsh_chunk_length=32"]),
    "ra": ("ra", []),
    "hybrid_1in4_softmax": ("hybrid", ["attn_layers=[favor,favor,favor,full]", "feature_redraw=learned",
                                       "num_random_features=64"]),
    # the training-free baseline of "Sliding-window beats linear attention" (arXiv 2608.28444): the source cut to a
    # 32-token window plus 4 sinks (a quarter of the 128-token blocks, as 64 of their 256+ tokens), and FAVOR+ beyond
    # such a window inside every layer
    "window_32_4_sinks": ("window", ["window_size=32", "num_sink_tokens=4"]),
    "favor_window": ("performer", ["attn_layers=[favor_window]", "window_size=32", "num_sink_tokens=4",
                                   "feature_redraw=learned", "num_random_features=64"]),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversions", nargs="+", default=list(CONVERSIONS), choices=list(CONVERSIONS))
    p.add_argument("--source_steps", type=int, default=1500, help="training steps of the Llama source")
    p.add_argument("--transfer_steps", type=int, default=150, help="attention-transfer steps")
    p.add_argument("--transfer_learning_rate", type=float, default=1e-2, help="LoLCATs' stage-1 rate")
    p.add_argument("--finetune_steps", type=int, default=200, help="fine-tuning steps after the transfer")
    p.add_argument("--source_learning_rate", type=float, default=2e-3, help="source and from-scratch runs")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--eval_every", type=int, default=100, help="held-out evaluation every N steps of each run")
    p.add_argument("--kl_blocks", type=int, default=64, help="held-out blocks the KL is averaged over")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", type=Path, default=Path("runs/llama_uptraining"))
    p.add_argument("--results", type=Path, default=COMMITTED_RESULTS)
    p.add_argument("--retrain", action="store_true", help="redo runs that already finished")
    p.add_argument("--readme_only", action="store_true",
                   help="only rewrite README.md's table from the results file (no runs)")
    return p


README = ROOT / "README.md"
TABLE_START, TABLE_END = "<!-- llama_uptraining table: start -->", "<!-- llama_uptraining table: end -->"
STAGE_LABELS = {"converted": "as converted", "transferred": "after transfer", "finetuned": "after fine-tuning"}


def results_table(report: dict) -> str:
    """The README's table, rendered from the results file (never typed by hand)."""
    setup, summary = report["setup"], report["summary"]
    lines = [f"| conversion | {' | '.join(STAGE_LABELS.values())} | from scratch, {setup['scratch_steps']} steps "
             "| KL(source ‖ model), as converted → fine-tuned |",
             "|---|---|---|---|---|---|"]
    for name, r in report["conversions"].items():
        bits = [f"{r['bits_per_dim'][stage]:.3f}" if stage in r["bits_per_dim"] else "(nothing to learn)"
                for stage in STAGE_LABELS]
        kl = r["kl_from_source_bits_per_token"]
        lines.append(f"| {name} (`--family {r['family']}`) | {' | '.join(bits)} | {r['scratch_bits_per_dim']:.3f} "
                     f"| {kl['converted']:.3f} → {kl['finetuned']:.3f} |")
    lines.append(f"| source: Llama, {setup['source_steps']} steps | {summary['source_bits_per_dim']:.3f} | | | | |")
    return "\n".join(lines)


def update_readme(report: dict, readme: Path = README) -> None:
    """Replace the table between README.md's markers with the one rendered from `report`."""
    write_between_markers(readme, TABLE_START, TABLE_END, results_table(report))


def save_llama_source_init(folder: Path, args, special_tokens: bool = False) -> None:
    """A freshly initialised transformers LlamaForCausalLM (GQA, no dropout) with attnzoo's byte-level tokenizer:
    256 byte ids, or with `special_tokens` the tokenizer's whole vocabulary with its pad/bos/eos ids, which batched
    generation (lm-eval's, left-padded) needs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.tokenization import byte_level_tokenizer

    torch.manual_seed(args.seed)
    tokenizer = byte_level_tokenizer(model_max_length=args.block_size)
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id) if special_tokens else dict(
        vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3),
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.block_size,
                         tie_word_embeddings=True, **ids)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def heldout_blocks(args):
    """[kl_blocks, block_size] byte ids evenly spread over the held-out split train_lm.py uses."""
    import torch

    from attnzoo.training.text_data import read_bytes, split_bytes

    _, heldout = split_bytes(read_bytes(None), 0.05)
    count = min(args.kl_blocks, heldout.numel() // args.block_size)
    starts = torch.linspace(0, heldout.numel() - args.block_size, count).long()
    return torch.stack([heldout[s:s + args.block_size] for s in starts.tolist()]).long()


def kl_from_source(source: Path, folders: dict[str, Path], args) -> dict[str, float]:
    """KL(source || model) in bits per token, averaged over held-out blocks and positions, for each saved model."""
    import torch
    from transformers import AutoModelForCausalLM

    import attnzoo  # noqa: F401

    blocks = heldout_blocks(args)

    def log_probs(folder):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            return torch.cat([model(blocks[i:i + 8]).logits.float().log_softmax(-1)
                              for i in range(0, len(blocks), 8)])

    reference = log_probs(source)
    result = {}
    for name, folder in folders.items():
        kl = (reference.exp() * (reference - log_probs(folder))).sum(-1).mean().item()
        result[name] = kl / math.log(2)
    return result


def evaluate(folder: Path, args, log: list[str], execute: bool) -> float:
    """Held-out bits/dim of a saved model (scripts/evaluate.py, the same held-out split as train_lm.py)."""
    result_file = folder / "evaluation.json"
    run(["scripts/evaluate.py", "--model_name_or_path", folder, "--block_size", args.block_size,
         "--output_file", result_file], log, execute and not result_file.is_file())
    record_outputs(folder, [result_file.name])  # the model folder's record lists it: a redo deletes it with the rest
    return json.loads(result_file.read_text())["bits_per_dim"]


def has_own_parameters(folder: Path) -> bool:
    """Whether any attention of the saved model has parameters of its own (what attention transfer trains)."""
    from transformers import AutoModelForCausalLM

    import attnzoo  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(folder)
    return any(block.attn.own_parameters() for block in model.model.transformer.blocks)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.readme_only:
        report = read_report(args.results, REPORT_CHECK, f"{SCRIPT}.py")
        if publishes_tables(args.results, COMMITTED_RESULTS):
            update_readme(report)
        else:
            print(f"{args.results} is not the committed report: README.md shows {relative(COMMITTED_RESULTS)}.")
        return report
    out, log, reused, started = args.output_dir, [], [], time.time()
    source_init, source = out / "source_init", out / "source"
    budget = args.source_steps + args.transfer_steps + args.finetune_steps
    setup = {k: (relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "retrain"}
    setup.update(scratch_steps=budget, finetune_recipe=str(FINETUNE_RECIPE.relative_to(ROOT)),
                 source_model="transformers LlamaForCausalLM (GQA, RMSNorm, SwiGLU, RoPE)",
                 corpus="CPython pydoc topics, byte-level", conversions={n: CONVERSIONS[n] for n in args.conversions})
    # before anything is trained: the folder of runs and the report file are the benchmark's own (or new)
    runs = OutputFolder(out, SCRIPT)
    target = report_target(args.results, setup, REPORT_CHECK, f"{SCRIPT}.py")

    def fresh(folder: Path, marker: str = "all_results.json") -> bool:
        runs.path(folder.name)  # a folder the benchmark did not make is refused
        if (folder / marker).is_file() and not args.retrain:
            reused.append(folder.name)
            return False
        runs.clear(folder.name)  # the benchmark's earlier run, by its record
        return True

    def save_init(folder: Path, save, *save_args) -> None:
        """A fresh initialisation saved into the benchmark's own folder (its earlier one cleared by its record)."""
        runs.clear(folder.name)
        save(*save_args)
        runs.saved(folder.name, None)

    if execute := fresh(source):
        save_init(source_init, save_llama_source_init, source_init, args)
    train(source_init, source, args.source_steps, args, log, learning_rate=args.source_learning_rate,
          execute=execute)
    source_run = read_run(source)
    curve = [p["eval_bits_per_dim"] for p in source_run["curve"]]
    # bits/dim change per 1000 steps over the last three evaluations: how flat the source is
    source_run["final_slope_per_1000_steps"] = (curve[-1] - curve[-3]) / (2 * args.eval_every) * 1000 \
        if len(curve) >= 3 else None

    results = {}
    for name in args.conversions:
        family, settings = CONVERSIONS[name]
        converted, transferred = out / f"{name}_converted", out / f"{name}_transferred"
        finetuned, scratch_init, scratch = out / f"{name}_finetuned", out / f"{name}_scratch_init", \
            out / f"{name}_scratch"
        execute = fresh(converted, "config.json")
        run(["-m", "attnzoo.convert.llama", source, converted, "--family", family, "--seed", args.seed,
             *(["--model", *settings] if settings else [])], log, execute)
        stages = {"converted": converted}
        transfer_run = None
        if has_own_parameters(converted):
            run(["scripts/transfer_attention.py", "--teacher", source, "--student", converted,
                 "--output_dir", transferred, "--max_train_steps", args.transfer_steps,
                 "--learning_rate", args.transfer_learning_rate, "--block_size", args.block_size,
                 "--per_device_train_batch_size", args.batch, "--seed", args.seed], log,
                fresh(transferred))
            stages["transferred"] = transferred
            transfer_run = json.loads((transferred / "all_results.json").read_text())
        start = stages.get("transferred", converted)
        train(start, finetuned, args.finetune_steps, args, log, recipe=FINETUNE_RECIPE, execute=fresh(finetuned))
        stages["finetuned"] = finetuned
        if execute := fresh(scratch):
            save_init(scratch_init, save_scratch_init, converted, scratch_init, args.seed)
        train(scratch_init, scratch, budget, args, log, learning_rate=args.source_learning_rate, execute=execute)
        bits = {stage: evaluate(folder, args, log, True) for stage, folder in stages.items()}
        kl = kl_from_source(source, stages, args)
        results[name] = {"family": family, "settings": settings, "bits_per_dim": bits,
                         "kl_from_source_bits_per_token": kl, "transfer": transfer_run,
                         "finetune_run": read_run(finetuned), "scratch_run": read_run(scratch),
                         "scratch_bits_per_dim": read_run(scratch)["eval_bits_per_dim"]}

    source_bpd = source_run["eval_bits_per_dim"]
    summary = {"source_bits_per_dim": source_bpd}
    for name, r in results.items():
        final = r["bits_per_dim"]["finetuned"]
        summary[name] = {**{f"{stage}_bits_per_dim": v for stage, v in r["bits_per_dim"].items()},
                         **{f"{stage}_kl_from_source": v for stage, v in r["kl_from_source_bits_per_token"].items()},
                         "scratch_same_budget_bits_per_dim": r["scratch_bits_per_dim"],
                         "finetuned_minus_source": final - source_bpd,
                         "finetuned_minus_scratch": final - r["scratch_bits_per_dim"]}
    report = {"benchmark": "llama_uptraining", "setup": setup, "summary": summary, "source_run": source_run,
              "conversions": results, "commands": log, "reused_runs": reused,
              "wall_seconds": round(time.time() - started, 1)}
    write_report(target, report, indent=2)
    plot(report, target.with_suffix(".png"))
    if publishes_tables(target, COMMITTED_RESULTS):  # the committed results: the README shows them
        update_readme(report)
    print(json.dumps(summary, indent=2))
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["conversions"])
    stages = ["converted", "transferred", "finetuned"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    width = 0.2
    for i, stage in enumerate([*stages, "scratch"]):
        values = [report["conversions"][n]["scratch_bits_per_dim"] if stage == "scratch"
                  else report["conversions"][n]["bits_per_dim"].get(stage, float("nan")) for n in names]
        left.bar([x + (i - 1.5) * width for x in range(len(names))], values, width, label=stage)
    left.axhline(report["summary"]["source_bits_per_dim"], color="black", lw=1, label="source (Llama)")
    left.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
    left.set_ylabel("held-out bits/dim")
    left.set_yscale("log")
    left.legend(fontsize=7)
    left.set_title("bits/dim per stage; scratch = same token budget", fontsize=9)
    for i, stage in enumerate(stages):
        values = [report["conversions"][n]["kl_from_source_bits_per_token"].get(stage, float("nan")) for n in names]
        right.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=stage)
    right.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
    right.set_ylabel("KL(source || model), bits/token")
    right.set_yscale("log")
    right.legend(fontsize=7)
    right.set_title("swap fidelity on held-out text", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
