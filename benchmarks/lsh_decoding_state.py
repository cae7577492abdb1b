"""The Reformer's own LSH layers' decoding cache against a KV cache, on a real pretrained model's shapes.

SmolLM2-135M-Instruct's architecture (`near_part_speed.SMOLLM2`: a Llama, hidden 576, 9 query heads of 64) with
seeded random weights and `--layers` of its 30 layers (the cache of every layer is the same size, so the ratios do
not depend on the count), converted by `attnzoo.convert.llama --family reformer` with every layer plain "lsh"
(2 hash rounds, 32-token chunks, one chunk back: the settings issue 46 measured 4.3x a KV cache at 1,024 tokens with):

- `source`: transformers' `LlamaForCausalLM` (SDPA, its `DynamicCache`): the KV cache every ratio divides by;
- `lsh`: shared queries and keys (the Reformer's): the cache keeps a query-key vector per query head;
- `lsh_separate_qk`: `lsh_shared_qk=False`, which keeps the source's key projection and caches keys per key-value
  head, as the source does.

Two shapes: `gqa`, the model's own 9 query and 3 key-value heads, and `mha`, the same with 9 key-value heads (the
Reformer's layout, where shared QK's query-keys are as many as a KV cache's keys). Per shape, model and prompt length,
in a fresh worker process: the bytes the cache holds after the prompt's forward and after `--decode_steps` greedy
steps (every tensor it holds, buffers' spare room included: `harness.cache_state_bytes`), and the decoding steps'
milliseconds a token (2 threads by default).

Goal (issue 46, item 4): the LSH layers' cache <= 1.05x the source's KV cache at 1K, 4K and 16K tokens, for
separate QK on the real shapes and for shared QK where the heads are not grouped.

    python benchmarks/lsh_decoding_state.py      # benchmarks/results/lsh_decoding_state.json and .png

A rerun with the same setup measures only the rows its report lacks (`--remeasure`: all). On 2 cores the whole grid
takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import (  # noqa: E402
    add_report_arguments,
    cache_state_bytes,
    cpu_environment,
    measure_missing_rows,
    rows_report_check,
    run_worker,
    save_figure,
)
from near_part_speed import SMOLLM2  # noqa: E402
from owned_outputs import exit_on_refusal, read_report, report_target, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "results" / "lsh_decoding_state.json"
LABEL = "benchmarks/lsh_decoding_state.py"

#: the LSH settings of every converted model (what issue 46 measured the old cache with)
LSH = dict(attn_layers=["lsh"], lsh_num_hashes=2, lsh_chunk_length=32)
DESIGNS = {"lsh": dict(LSH), "lsh_separate_qk": dict(LSH, lsh_shared_qk=False)}
MODELS = ("source", *DESIGNS)
SHAPES = {"gqa": {}, "mha": {"num_key_value_heads": SMOLLM2["num_attention_heads"]}}
GOAL = 1.05
#: (shape, model) pairs the goal applies to: shared QK under grouped heads caches 9 query-keys where the source
#: caches 3 keys, (9 + 3) / (3 + 3) = 2x by construction
GOAL_APPLIES = {("gqa", "lsh_separate_qk"), ("mha", "lsh"), ("mha", "lsh_separate_qk")}


def build(model: str, shape: str, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.convert.llama import convert

    settings = dict(SMOLLM2, num_hidden_layers=layers, **SHAPES[shape])
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**settings, attn_implementation="sdpa")).eval()
    return source if model == "source" else convert(source, "reformer", DESIGNS[model]).eval()


def measure(job: dict) -> dict:
    """One worker's row: cache bytes after the prompt and after the decoding steps, and ms a decoded token."""
    import torch

    from attnzoo.transformers_compat import CACHE_KW, output_cache

    torch.set_num_threads(job["threads"])
    model = build(job["model"], job["shape"], job["layers"])
    ids = torch.randint(3, SMOLLM2["vocab_size"], (1, job["length"]), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
        row = {"cache_bytes": cache_state_bytes(cache)}
        start = time.perf_counter()
        for _ in range(job["decode_steps"]):
            out = model(token, **{CACHE_KW: cache}, use_cache=True)
            cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
        if job["decode_steps"]:
            row["decode_ms_per_token"] = 1000 * (time.perf_counter() - start) / job["decode_steps"]
        row["cache_bytes_after_decode"] = cache_state_bytes(cache)
    return row


def summary(rows: list[dict]) -> dict:
    """Each design's cache over the source's, after the prompt and after decoding, against the goal."""
    by = {(r["shape"], r["model"], r["length"]): r for r in rows}
    out = {}
    for (shape, model, length), row in sorted(by.items()):
        source = by.get((shape, "source", length))
        if model == "source" or source is None:
            continue
        entry = {"state_over_kv_cache": row["cache_bytes"] / source["cache_bytes"],
                 "state_over_kv_cache_after_decode": row["cache_bytes_after_decode"]
                 / source["cache_bytes_after_decode"]}
        if "decode_ms_per_token" in row and "decode_ms_per_token" in source:
            entry["decode_time_over_source"] = row["decode_ms_per_token"] / source["decode_ms_per_token"]
        if (shape, model) in GOAL_APPLIES:
            entry["goal"] = GOAL
            entry["meets_goal"] = max(entry["state_over_kv_cache"], entry["state_over_kv_cache_after_decode"]) <= GOAL
        out[f"{shape}/{model}/{length}"] = entry
    return out


validate = rows_report_check(LABEL, "shape", "model", "length", "cache_bytes", "cache_bytes_after_decode")
REPORT_CHECK = validate


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(11, 4), sharey=True)
    for axis, shape in zip(axes, SHAPES, strict=True):
        for model in DESIGNS:
            points = sorted((int(key.split("/")[2]), entry["state_over_kv_cache_after_decode"])
                            for key, entry in report["summary"].items() if key.startswith(f"{shape}/{model}/"))
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=model)
        axis.axhline(GOAL, color="grey", linestyle="--", label=f"goal {GOAL}x")
        axis.set(xscale="log", xlabel="prompt tokens", ylabel="decoding cache / source's KV cache",
                 title=f"{shape}: {SMOLLM2['num_attention_heads']} query, "
                       f"{SHAPES[shape].get('num_key_value_heads', SMOLLM2['num_key_value_heads'])} key-value heads")
        axis.legend()
    fig.suptitle("Plain LSH layers' decoding cache against transformers' KV cache (SmolLM2-135M shapes)")
    save_figure(fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_report_arguments(parser, COMMITTED)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--layers", type=int, default=4, help="layers of the model's 30 (the ratios do not depend "
                                                              "on it)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each worker")
    parser.add_argument("--decode_steps", type=int, default=8, help="greedy decoding steps after each prompt")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    for name, low in (("layers", 1), ("threads", 1), ("decode_steps", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name}={getattr(args, name)} is invalid: set an integer of at least {low}.")
    if any(length < 64 for length in args.lengths):
        parser.error(f"--lengths {args.lengths} is invalid: give prompt lengths of at least 64 tokens.")
    setup = {"layers": args.layers, "threads": args.threads, "decode_steps": args.decode_steps, "config": SMOLLM2,
             "shapes": SHAPES, "designs": DESIGNS}
    target = report_target(args.results, setup, validate, LABEL)  # this benchmark's own report, or a new file
    report = read_report(target, validate, LABEL) if target.exists() else {"benchmark": LABEL, "setup": setup,
                                                                             "rows": []}
    report["environment"] = cpu_environment()
    key = ("shape", "model", "length")
    jobs = [{"shape": shape, "model": model, "length": length, "layers": args.layers, "threads": args.threads,
             "decode_steps": args.decode_steps}
            for shape in args.shapes for length in sorted(args.lengths) for model in args.models]

    def keep(report):
        report["summary"] = summary(report["rows"])
        write_report(target, report)

    measure_missing_rows(report, jobs, key, lambda job: run_worker(__file__, [json.dumps(job)]), keep,
                         args.remeasure)
    report["summary"] = summary(report["rows"])
    write_report(target, report)
    plot(report, target.with_suffix(".png"))
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    exit_on_refusal(main, LABEL)
