"""Short sequences, where most fine-tuning happens: a small classifier's training step (forward + backward) with each
attention against exact softmax attention (PyTorch SDPA) in the same run, where each efficient attention overtakes
SDPA as the sequence grows (its crossover length), and what RA spends its time on.

    python benchmarks/short_sequence_speed.py                 # CPU, all cores, a few minutes
    python benchmarks/short_sequence_speed.py --device cuda

1. The classifier: 2 layers, hidden 64, 4 heads (head size 16), FFN 128, 257 tokens (a class token and 256 others),
   batch 32, sequence classification (`AutoModelForSequenceClassification`), one forward + backward per step.
   FAVOR+ runs with its default features (round(d·ln d) = 44 at d = 16) and with the 256 that used to be the
   default; the others with their family defaults.
2. Crossovers: the same model at 256 to 4,096 tokens with the batch shrinking to keep 8,192 tokens per step; the
   crossover of an attention is the shortest length at which its step takes less time than SDPA's.
3. RA's profile at the classifier's size: the operators with the most self time (torch.profiler).
Times are medians of `--repeats` steps after a warm-up; ratios are against SDPA in the same run.
Results: benchmarks/results/short_sequence_speed_<device>.json and .png (`--results`), replaced only by a report of
the same setup (another setup's, a `--tiny` run's say, goes beside it; a file that is not this benchmark's report is
refused: benchmarks/owned_outputs.py). A full run (not `--tiny`) whose report replaces the committed one also rewrites
README.md's crossover table from every device's committed results file; `--readme_only` does just that.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))

from harness import setup_or_legacy, step_seconds, sync, write_between_markers  # noqa: E402
from owned_outputs import (  # noqa: E402
    exit_on_refusal,
    publishes_tables,
    read_report,
    report_target,
    require_keys,
    write_report,
)

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/short_sequence_speed"
#: what makes a results file this benchmark's report (the committed one, from before reports were marked, too)
REPORT_CHECK = require_keys("setup", "classifier_step_seconds", "crossover_length", benchmark="short_sequence_speed")
#: the setup of a report from before reports were marked: its setup less the paths and library versions it also held
LEGACY_SETUP = setup_or_legacy(lambda r: {k: v for k, v in r["setup"].items()
                                          if k not in ("results", "readme_only", "torch", "transformers")})
README = Path(__file__).resolve().parent.parent / "README.md"
TABLE_START, TABLE_END = "<!-- crossover table: start -->", "<!-- crossover table: end -->"
DEVICE_NAMES = {"cpu": "CPU", "cuda": "GPU"}
#: name: (family, settings); "sdpa" is the baseline
ATTENTIONS = {
    "sdpa": ("softmax", {}),
    "favor": ("performer", {}),
    "favor_256_features": ("performer", {"num_random_features": 256}),
    "elu": ("performer", {"attn_layers": ["elu"]}),
    "ra": ("ra", {}),
    "lara": ("lara", {}),
    "lsh": ("reformer", {"attn_layers": ["lsh"], "reversible": False, "position_embedding_type": "learned",
                         "lsh_chunk_length": 64}),
    "local": ("reformer", {"attn_layers": ["local"], "reversible": False, "position_embedding_type": "learned",
                           "local_chunk_length": 64}),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--attentions", nargs="+", default=list(ATTENTIONS), choices=list(ATTENTIONS))
    p.add_argument("--length", type=int, default=257, help="the classifier's tokens")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--crossover_lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--tokens_per_step", type=int, default=8192, help="crossover sweep: batch = this / length")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: every core)")
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (the test suite's)")
    p.add_argument("--readme_only", action="store_true",
                   help="only rewrite README.md's crossover table from the committed results files")
    return p


def check_arguments(args) -> None:
    for name in ("length", "batch", "hidden", "heads", "layers", "tokens_per_step", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: set a positive number.")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden={args.hidden} is not divisible by --heads={args.heads}: pick sizes that divide.")
    if any(n < 2 for n in args.crossover_lengths):
        raise ValueError(f"--crossover_lengths={args.crossover_lengths}: lengths must be at least 2.")
    if args.threads < 0:
        raise ValueError(f"--threads={args.threads} is invalid: 0 (every core) or a positive count.")
    if args.readme_only and (args.tiny or args.results is not None or args.device != "cpu"):
        raise ValueError("--readme_only rewrites README.md from the committed results files and runs nothing; drop "
                         "--tiny, --results and --device, or drop --readme_only.")


def build_model(name: str, args, length: int):
    from transformers import AutoModelForSequenceClassification

    from attnzoo.registration import FAMILY_CONFIGS

    family, settings = ATTENTIONS[name]
    torch.manual_seed(0)
    config = FAMILY_CONFIGS[family](**{
        "vocab_size": 256, "hidden_size": args.hidden, "num_attention_heads": args.heads,
        "num_hidden_layers": args.layers, "intermediate_size": 2 * args.hidden, "max_position_embeddings": length,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_labels": 2, **settings})
    return AutoModelForSequenceClassification.from_config(config).to(args.device).train()


def step_time(name: str, args, length: int, batch: int) -> float:
    """Median seconds of one forward + backward of the classifier on random tokens."""
    model = build_model(name, args, length)
    ids = torch.randint(0, 256, (batch, length), device=args.device)
    labels = torch.randint(0, 2, (batch,), device=args.device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()

    step()  # warm-up
    sync(args.device)
    times = step_seconds(step, args.device, args.repeats)
    return sorted(times)[len(times) // 2]


def ra_profile(args, top: int = 8) -> list[dict]:
    """RA's operators with the most self time in one classifier step."""
    from torch.profiler import ProfilerActivity, profile

    model = build_model("ra", args, args.length)
    ids = torch.randint(0, 256, (args.batch, args.length), device=args.device)
    labels = torch.randint(0, 2, (args.batch,), device=args.device)
    model(input_ids=ids, labels=labels).loss.backward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        sync(args.device)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [{"operator": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1000, 2),
             "share": round(e.self_cpu_time_total / total, 3), "calls": e.count} for e in events[:top]]


def committed_path(device: str) -> Path:
    return RESULTS / f"short_sequence_speed_{device}.json"


def committed_reports() -> dict[str, dict]:
    """{device: report} of the results files in benchmarks/results (cpu first), each checked to be this benchmark's
    report (a file that is not is named, and nothing is written)."""
    return {device: read_report(path, REPORT_CHECK, f"{SCRIPT}.py", flag="committed results file",
                                fix="Nothing was written; restore it (git checkout) or rerun the benchmark")
            for device in DEVICE_NAMES if (path := committed_path(device)).exists()}


def crossover_table(reports: dict[str, dict]) -> str:
    """README's table: per attention and device, its training step at the classifier's length as a multiple of
    SDPA's, and the shortest length of the sweep from which it is faster than SDPA."""
    if not reports:
        raise ValueError(f"no short_sequence_speed_<device>.json in {RESULTS}; run the benchmark first.")
    devices = list(reports)
    header = ["attention"]
    for device in devices:
        setup = reports[device]["setup"]
        label = f"{DEVICE_NAMES[device]} ({setup['device_name']}" + (
            f", {setup['threads']} threads)" if device == "cpu" else ")")
        header += [f"{label}: step at {setup['length']} tokens, x SDPA", f"{label}: faster than SDPA from"]
    names = [n for n in ATTENTIONS if n != "sdpa" and any(n in r["crossover_length"] for r in reports.values())]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        cells = [f"`{name}`"]
        for device in devices:
            report = reports[device]
            ratio = report["classifier_ratio_to_sdpa"].get(name)
            crossover = report["crossover_length"].get(name, "missing")
            longest = max(report["setup"]["crossover_lengths"])
            cells.append("" if ratio is None else f"{ratio:.2f}")
            cells.append("" if crossover == "missing" else f"{crossover:,} tokens" if crossover is not None
                         else f"not up to {longest:,}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def update_readme(reports: dict[str, dict], readme: Path = README) -> None:
    """Replace what lies between README's crossover-table markers by `crossover_table(reports)`."""
    write_between_markers(readme, TABLE_START, TABLE_END, crossover_table(reports))


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    check_arguments(args)
    if args.readme_only:
        update_readme(committed_reports())
        return {}
    if args.tiny:
        args.length, args.batch, args.crossover_lengths, args.tokens_per_step, args.repeats = 33, 2, [32, 64], 128, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("results", "readme_only")},
             "attention_settings": {n: {"family": ATTENTIONS[n][0], "settings": ATTENTIONS[n][1]}
                                    for n in args.attentions},
             "device_name": (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                             else platform.processor() or platform.machine()),
             "threads": torch.get_num_threads()}
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    results = report_target(args.results or committed_path(device), setup, REPORT_CHECK, f"{SCRIPT}.py",
                            setup_of=LEGACY_SETUP)
    started = time.time()
    classifier = {name: step_time(name, args, args.length, args.batch) for name in args.attentions}
    sweep = {}
    for length in args.crossover_lengths:
        batch = max(1, args.tokens_per_step // length)
        sweep[str(length)] = {name: step_time(name, args, length, batch) for name in args.attentions}
    baseline = "sdpa"
    ratios = {name: seconds / classifier[baseline] for name, seconds in classifier.items()} \
        if baseline in classifier else {}
    crossover = {}
    for name in args.attentions:
        if name == baseline or baseline not in args.attentions:
            continue
        faster = [int(n) for n, times in sweep.items() if times[name] < times[baseline]]
        crossover[name] = min(faster) if faster else None
    report = {
        "benchmark": "short_sequence_speed",
        "setup": setup,
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__},
        "classifier_step_seconds": classifier, "classifier_ratio_to_sdpa": ratios,
        "sweep_step_seconds": sweep,
        "sweep_ratio_to_sdpa": {n: {a: t / times[baseline] for a, t in times.items()} for n, times in sweep.items()}
        if baseline in args.attentions else {},
        "crossover_length": crossover,
        "ra_profile": ra_profile(args) if "ra" in args.attentions else None,
        "command": "python benchmarks/short_sequence_speed.py " + " ".join(
            str(a) for a in (argv if argv is not None else sys.argv[1:])),
    }
    report["wall_seconds"] = round(time.time() - started, 1)
    write_report(results, report, indent=2)
    plot(report, results.with_suffix(".png"))
    print(json.dumps({k: report[k] for k in ("classifier_ratio_to_sdpa", "crossover_length")}, indent=2))
    print(f"wrote {results} and {results.with_suffix('.png')}")
    # README shows the committed reports: rewritten only when this run's report is one of them
    if not args.tiny and publishes_tables(results, committed_path(device)) and set(args.attentions) == set(ATTENTIONS):
        update_readme(committed_reports())
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup = report["setup"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(report["classifier_ratio_to_sdpa"])
    left.bar(names, [report["classifier_ratio_to_sdpa"][n] for n in names])
    left.axhline(1.0, color="black", lw=0.8)
    left.set_ylabel("step time / SDPA's")
    left.set_title(f"classifier: {setup['layers']} layers x {setup['hidden']}, {setup['length']} tokens, "
                   f"batch {setup['batch']}", fontsize=9)
    left.tick_params(axis="x", rotation=30, labelsize=7)
    lengths = [int(n) for n in report["sweep_ratio_to_sdpa"]]
    for name in names:
        if name == "sdpa":
            continue
        right.plot(lengths, [report["sweep_ratio_to_sdpa"][str(n)][name] for n in lengths], marker="o", label=name)
    right.axhline(1.0, color="black", lw=0.8)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel(f"tokens per sequence ({setup['tokens_per_step']} tokens per step)")
    right.set_ylabel("step time / SDPA's")
    right.legend(fontsize=7)
    right.set_title(f"crossover against SDPA ({setup['device_name']}, {setup['threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
