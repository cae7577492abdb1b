"""A training step's memory and time on a real pretrained model's shapes: converted SmolLM2 against the source.

SmolLM2-135M-Instruct's architecture with seeded random weights (`near_part_speed.SMOLLM2`), on the CPU with 2
threads:

- `source`: transformers' `LlamaForCausalLM` with SDPA, the baseline of every ratio;
- `window`: converted to the "window" attention, W = 1024 + 4 sinks;
- `block_wide_quantised`: the design of benchmarks/pretrained_long_context.py that finds the pass key at 32K: the
  window and sinks, and beyond them block retrieval (the 64 best of the 32-key blocks, selected every 4 queries)
  with its far keys stored in 8 bits and its values in 4.

For each model and length, in a fresh worker process: a warm-up step on 64 tokens (so that the parameters'
gradients exist before the measurement), then one training step over the prompt (forward with labels, the loss's
backward pass): its seconds and the process's peak memory growth during it (activations, what the backward pass
holds, the logits over the 49K vocabulary). A fine-tune of a converted model inside its native 8K (issue 47's
fallback for the far heads) runs such steps.

The block far part runs its groups of query blocks outside autograd's graph and gathers each again in the backward
pass (`block_window._GroupedFarTriple`); with activation checkpointing per group instead, a forward pass with
gradients of two such layers at 2,048 tokens held gigabytes more than one without gradients (the graph nodes kept
per group let glibc's allocator strand the freed gathered keys).

    python benchmarks/training_memory.py                     # benchmarks/results/training_memory.json and .png
    python benchmarks/training_memory.py --lengths 8192 --models source window

Each finished row is kept as soon as it is measured; a rerun with the same setup measures only the rows the report
lacks (`--remeasure` measures all). Only ratios within one run are compared (the machine's speed varies between
runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import near_part_speed  # noqa: E402
from harness import (  # noqa: E402
    add_report_arguments,
    cpu_environment,
    measure_missing_rows,
    rows_report_check,
    rss_peak_mib,
    run_worker,
    save_figure,
)
from near_part_speed import SMOLLM2  # noqa: E402
from owned_outputs import exit_on_refusal, read_report, report_target, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "results" / "training_memory.json"
LABEL = "benchmarks/training_memory.py"
WINDOW = dict(window_size=1024, num_sink_tokens=4)
#: the converted designs: attnzoo family and its attention settings
DESIGNS = {
    "window": ("window", WINDOW),
    "block_wide_quantised": ("hybrid", dict(WINDOW, sink_positions="adjacent", attn_layers=["block_window"],
                                            far_positions=["fixed"], block_size=32, block_topk=64,
                                            block_query_size=4, block_key_bits=8, block_value_bits=4)),
}
MODELS = ("source", *DESIGNS)


def build(model: str, layers: int | None = None):
    """The model `model` in float32 from seeded random weights, in training mode (`layers`: fewer, for the tests)."""
    return near_part_speed.build(model, "float32", layers, designs=DESIGNS).train()


def measure(job: dict) -> dict:
    """One worker's row: a training step's seconds and peak memory growth, and its loss (a check that it ran)."""
    import torch

    torch.set_num_threads(job["threads"])
    model = build(job["model"], job.get("layers"))
    ids = torch.randint(3, SMOLLM2["vocab_size"], (1, job["length"]), generator=torch.Generator().manual_seed(1))

    def step(tokens):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return float(loss.detach())

    step(ids[:, :64])  # parameters' gradients allocated, first-call set-up, outside the measurement
    before = rss_peak_mib()
    start = time.perf_counter()
    loss = step(ids)
    seconds = time.perf_counter() - start
    return {"step_s": seconds, "peak_growth_mib": rss_peak_mib() - before, "loss": loss}


def summary(rows: list[dict]) -> dict:
    """Each design's step time and peak memory growth over the source's at the same length, in the same run."""
    by = {(r["model"], r["length"]): r for r in rows}
    out = {}
    for (model, length), row in sorted(by.items()):
        source = by.get(("source", length))
        if model != "source" and source is not None:
            out[f"{model}/{length}"] = {"step_time_over_source": row["step_s"] / source["step_s"],
                                        "peak_memory_over_source": row["peak_growth_mib"] / source["peak_growth_mib"]}
    return out


validate = rows_report_check(LABEL, "model", "length", "step_s", "peak_growth_mib", "loss")
REPORT_CHECK = validate


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (field, label) in zip(axes, [("peak_growth_mib", "peak memory growth of a step (MiB)"),
                                           ("step_s", "training step (s)")], strict=True):
        for model in MODELS:
            points = sorted((r["length"], r[field]) for r in report["rows"] if r["model"] == model)
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=model)
        axis.set(xscale="log", yscale="log", xlabel="tokens", ylabel=label)
        if axis.lines:
            axis.legend()
    fig.suptitle(f"SmolLM2-135M shapes, one training step, {report['setup']['threads']} threads "
                 f"({report['environment']['cpu']})")
    save_figure(fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_report_arguments(parser, COMMITTED)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096],
                        help="tokens a step (the window is 1024: shorter steps have no far keys)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each worker")
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)  # fewer layers: the tests
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    if args.threads < 1:
        parser.error(f"--threads={args.threads} is invalid: set a positive number.")
    if any(length < 128 for length in args.lengths):
        parser.error(f"--lengths {args.lengths} is invalid: give lengths of at least 128 tokens.")
    setup = {"threads": args.threads, "layers": args.layers, "config": SMOLLM2, "designs": DESIGNS}
    target = report_target(args.results, setup, validate, LABEL)  # this benchmark's own report, or a new file
    report = read_report(target, validate, LABEL) if target.exists() else {"benchmark": LABEL, "setup": setup,
                                                                             "rows": []}
    report["environment"] = cpu_environment()
    jobs = [{"model": model, "length": length, "threads": args.threads, "layers": args.layers}
            for length in sorted(args.lengths) for model in args.models]

    def keep(report):
        report["summary"] = summary(report["rows"])
        write_report(target, report)

    measure_missing_rows(report, jobs, ("model", "length"), lambda job: run_worker(__file__, [json.dumps(job)]),
                         keep, args.remeasure)
    keep(report)
    plot(report, target.with_suffix(".png"))
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    exit_on_refusal(main, LABEL)
