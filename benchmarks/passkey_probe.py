"""What the benchmarks that probe a converted model's far parts on pass-key prompts share (far_selection_recall.py,
lsh_candidate_recall.py): their command line, its checks, and a report of one row per prompt (length, depth, trial),
measured where missing and kept as each is measured."""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

from harness import cpu_environment, measure_missing_rows
from owned_outputs import BadArgument, read_report, report_target, write_report

KEY = ("length", "depth", "trial")


def add_probe_arguments(parser: argparse.ArgumentParser, committed: Path, model_help: str,
                        lengths: list[int]) -> None:
    """--model, --results (default `committed`), --lengths (default `lengths`), --depths, --trials, --seed, --digits,
    --filler, --threads and --remeasure."""
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--results", type=Path, default=committed)
    parser.add_argument("--lengths", type=int, nargs="+", default=lengths)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--trials", type=int, default=1, help="prompts per length and depth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=5)
    parser.add_argument("--filler", default="repeat",
                        help="the haystack (attnzoo.evaluation.passkey's fillers: repeat, repeat_shifted, corpus)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--remeasure", action="store_true", help="measure every prompt, not only missing ones")


def checked_model(args, default: str | None, wanted: str) -> str:
    """The model folder to probe (--model, or `default`), after the checks every probe shares; BadArgument naming the
    argument and the fix. `wanted` says what --model must be."""
    model = args.model or default
    if model is None or not (Path(model) / "config.json").is_file():
        raise BadArgument(f"--model {model}: give {wanted}.")
    for name in ("trials", "threads", "digits"):
        if getattr(args, name) < 1:
            raise BadArgument(f"--{name}={getattr(args, name)}: give a positive integer.")
    if any(not 0 <= d <= 1 for d in args.depths):
        raise BadArgument(f"--depths {args.depths}: give fractions in [0, 1].")
    from attnzoo.evaluation.passkey import FILLERS

    if args.filler not in FILLERS:
        raise BadArgument(f"--filler {args.filler!r}: pick one of {list(FILLERS)}.")
    if any(n < 64 for n in args.lengths):
        raise BadArgument(f"--lengths {args.lengths}: give prompt lengths of at least 64 tokens.")
    return model


@contextmanager
def patched_far_parts(parts: dict, wrap):
    """Within the block, each far part of `parts` ({layer index: far part}) runs `wrap(index, far, x, original)` as
    its parallel form (original: its own); restored after, also when the block fails."""
    patched = []
    try:
        for index, far in parts.items():
            def parallel(x, original=far.parallel, far=far, index=index):
                return wrap(index, far, x, original)

            far.parallel = parallel
            patched.append(far)
        yield
    finally:
        for far in patched:
            del far.parallel


def block_far_parts(model, wanted: str) -> dict:
    """{layer index: its far part} of every far layer, each one block retrieval's; BadArgument naming --model, and
    saying it wants `wanted`, when one is not."""
    from attnzoo.evaluation.retrieval_layers import far_layers

    parts = {index: layer.far for index, layer in far_layers(model).items()}
    for index, far in parts.items():
        if not hasattr(far, "query_size"):
            raise BadArgument(f"--model: layer {index}'s far part ({type(far).__name__}) is not block retrieval; "
                              f"give {wanted}.")
    return parts


def probed_prompt(job: dict, recording):
    """Read job's pass-key prompt (job["filler"]; trial t's key drawn from random.Random(f"{seed}:{t}")) with
    the converted model at job["model"] in one forward, within `recording(model, prompt)` (a context manager that
    records what the probe wants); returns (the model, the prompt, the first answer token it predicts)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnzoo.evaluation.passkey import passkey_prompt

    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    prompt = passkey_prompt(tokenizer, job["length"], job["depth"], random.Random(f"{job['seed']}:{job['trial']}"),
                            digits=job["digits"], filler=job["filler"])
    with torch.inference_mode(), recording(model, prompt):
        logits = model(torch.tensor([prompt.input_ids]), logits_to_keep=1).logits
    return model, prompt, tokenizer.decode(logits[0, -1].argmax())


def run_probe(args, model: str, setup: dict, validate, label: str, measure, summary, plot,
              **job_fields) -> dict:
    """Measure the prompts the report at --results lacks (all with --remeasure), one worker each, keeping the report
    (its "summary" from `summary(rows)`) after every row; then plot it beside and print the summary."""
    setup = {"model": Path(model).name, "seed": args.seed, "digits": args.digits, "filler": args.filler, **setup}
    # reports from before --filler read the repeated filler
    target = report_target(args.results, setup, validate, label,
                           setup_of=lambda earlier: {"filler": "repeat", **earlier.get("setup", {})})
    report = read_report(target, validate, label) if target.exists() else {"benchmark": label, "setup": setup,
                                                                             "rows": []}
    report["setup"] = setup  # (an earlier report's, with the fields added since)
    report["environment"] = cpu_environment()
    jobs = [{"length": n, "depth": d, "trial": t, "model": model, "seed": args.seed, "digits": args.digits,
             "filler": args.filler, "threads": args.threads, **job_fields}
            for n in sorted(args.lengths) for d in args.depths for t in range(args.trials)]

    def keep(report):
        report["summary"] = summary(report["rows"])
        write_report(target, report)

    measure_missing_rows(report, jobs, KEY, measure, keep, args.remeasure)
    keep(report)
    plot(report, target.with_suffix(".png"))
    print(json.dumps(report["summary"], indent=1))
    return report
