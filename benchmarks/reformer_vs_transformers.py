"""attnzoo's Reformer against transformers' `ReformerModelWithLMHead` of the same configuration, side by side.

    python benchmarks/reformer_vs_transformers.py                       # CPU, 1K-64K (slow on CPU)
    python benchmarks/reformer_vs_transformers.py --lengths 1024 4096   # a quick CPU check
    python benchmarks/reformer_vs_transformers.py --device cuda         # the full run on a GPU

Models (same sizes for all): 6 layers, hidden 256, 4 heads of 64, feed-forward 1024 (ReLU), alternating local/LSH
layers, 2 hash rounds, chunks of 64 for both attentions, one chunk of look-back, axial positions (dims 64 + 192,
shape (L / a, a) so transformers can train at length L), vocabulary 256, batch 1, every dropout 0, feed-forward in
chunks of 2048 positions (transformers needs the length to be a multiple, hence min(2048, L)); the bucket count is
each library's default (2 * L / chunk, factorised when large). Ours runs its defaults otherwise
(`lsh_attend_to="bucket"`, duplicate correction), so it does a little more masking work than transformers' Reformer.
Where the two differ by design: our reversible backward recomputes the chunked feed-forward one chunk at a time
(transformers recomputes all chunks before backpropagating), our windowed attention keeps only what its backward
needs, and its decoding cache is bounded per token. A GPT-2-size softmax model with SDPA (`ZooSoftmaxForCausalLM`,
same sizes, learned positions) is the third peer: for generation, and for training up to `--softmax_max_length`.

Measures
- train: one forward + backward of the LM loss (labels = inputs). Time: the median of `--repeats` steps after a
  warm-up step. Peak memory:
  * CUDA: `torch.cuda.max_memory_allocated()` during a step after the warm-up, minus the memory allocated just
    before it (weights, gradient buffers and inputs), i.e. what the step itself needs;
  * CPU: a fresh subprocess per configuration with `MALLOC_MMAP_THRESHOLD_` fixed at 128 KiB, so every large
    tensor is its own mmap and goes back to the OS when freed; the figure is
    `resource.getrusage(RUSAGE_SELF).ru_maxrss` after the first (cold) step minus the resident set size just before
    it (after the model and inputs exist). It therefore also counts the gradient buffers the first backward
    allocates (about 20 MB here), for every model alike. Times come from another subprocess without that setting.
- generate: greedy decoding with the cache, a `--prompt`-token prompt and `--new_tokens` new tokens (no early
  stop): new tokens per second of `generate()` wall time (prefill included), plus the prefill time alone and the
  decoding rate without it (new tokens / (generate time - prefill time)).
Ratios are ours / theirs: below 1 is better for time and memory, above 1 is better for tokens/s.

Results: benchmarks/results/reformer_vs_transformers.json and .png (`--output`), replaced only by a report of the same
setup (another setup's goes beside it; a file that is not this benchmark's report is refused:
benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import cuda_device_name, step_seconds, sync  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/reformer_vs_transformers"
#: what makes a results file this benchmark's report (the committed ones, from before reports were marked, too)
REPORT_CHECK = require_keys("train", "generation", "summary", benchmark="reformer_vs_transformers")
ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = ("attnzoo", "transformers", "softmax")
VOCAB, HIDDEN, HEADS, LAYERS, FFN, CHUNK, HASHES = 256, 256, 4, 6, 1024, 64, 2
FFN_CHUNK = 2048  # feed-forward chunk length (Reformer, arXiv 2001.04451, §3), the same for both Reformers


def axial_shape(length: int) -> tuple[int, int]:
    """A factor pair of `length` (a power of two) near its square root: transformers trains only at
    prod(axial_pos_shape) == length."""
    rows = 1 << (max(length, 1).bit_length() // 2)
    while length % rows:
        rows //= 2
    return rows, length // rows


def build(impl: str, length: int, device, num_buckets=None, ffn_chunk=FFN_CHUNK):
    import torch

    torch.manual_seed(0)
    if impl == "transformers":
        from transformers import ReformerConfig, ReformerModelWithLMHead

        config = ReformerConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, attention_head_size=HIDDEN // HEADS,
            attn_layers=["local", "lsh"] * (LAYERS // 2), feed_forward_size=FFN, hidden_act="relu",
            axial_pos_shape=axial_shape(length), axial_pos_embds_dim=(64, HIDDEN - 64),
            max_position_embeddings=length, is_decoder=True, lsh_attn_chunk_length=CHUNK,
            local_attn_chunk_length=CHUNK, num_hashes=HASHES, num_buckets=num_buckets, hidden_dropout_prob=0.0,
            chunk_size_feed_forward=min(ffn_chunk, length),
            local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0, pad_token_id=0,
            eos_token_id=None)
        model = ReformerModelWithLMHead(config)
    elif impl == "attnzoo":
        from attnzoo import ZooReformerConfig, ZooReformerForCausalLM

        config = ZooReformerConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            intermediate_size=FFN, hidden_act="relu", attn_layers=["local", "lsh"], position_embedding_type="axial",
            axial_pos_shape=list(axial_shape(length)), axial_pos_embds_dim=[64, HIDDEN - 64],
            max_position_embeddings=length, is_decoder=True, reversible=True,
            chunk_size_feed_forward=min(ffn_chunk, length),
            lsh_chunk_length=CHUNK, local_chunk_length=CHUNK, lsh_num_hashes=HASHES, lsh_num_buckets=num_buckets,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=None)
        model = ZooReformerForCausalLM(config)
    else:
        from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM

        config = ZooSoftmaxConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            intermediate_size=FFN, hidden_act="gelu", max_position_embeddings=length, is_decoder=True,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=None)
        model = ZooSoftmaxForCausalLM(config)
    return model.to(device)


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def train_worker(impl: str, length: int, device_name: str, repeats: int, measure: str) -> dict:
    import torch

    device = torch.device(device_name)
    model = build(impl, length, device).train()
    ids = torch.randint(1, VOCAB, (1, length), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=False)

    result = {"impl": impl, "length": length, "parameters": sum(p.numel() for p in model.parameters())}
    if device.type == "cpu":
        before = current_rss_bytes()
        step()
        result["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        if measure == "memory":
            return result
        step()  # warm-up of the timing
    else:
        step()  # warm-up: kernels chosen, gradient buffers allocated
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        sync(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    times = step_seconds(step, device, repeats)
    result["seconds"] = statistics.median(times)
    result["all_seconds"] = times
    return result


def generate_worker(impl: str, prompt: int, new_tokens: int, device_name: str) -> dict:
    import torch

    device = torch.device(device_name)
    # A fixed bucket count (2 per chunk of the longest sequence): transformers' cached decoding fails with its
    # length-derived default when the prompt fits one chunk, and ours keeps the prefill's bucket count anyway.
    length = max(4096, 1 << (prompt + new_tokens - 1).bit_length())
    # No feed-forward chunking: transformers needs every step's length to be a multiple of the chunk.
    model = build(impl, length, device, num_buckets=2 * length // CHUNK, ffn_chunk=0).eval()
    ids = torch.randint(1, VOCAB, (1, prompt), device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                  pad_token_id=0)
    # transformers' Reformer prints a warning line for every generation step; keep the report readable.
    quiet = contextlib.redirect_stdout(io.StringIO()) if impl == "transformers" else contextlib.nullcontext()
    with torch.no_grad(), quiet:
        model.generate(ids[:, :64], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        sync(device)
        start = time.perf_counter()
        model(ids, use_cache=True)
        sync(device)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        sync(device)
        seconds = time.perf_counter() - start
    produced = out.shape[1] - prompt
    return {"impl": impl, "prompt": prompt, "new_tokens": produced, "seconds": seconds,
            "tokens_per_second": produced / seconds, "prefill_seconds": prefill,
            "decode_tokens_per_second": produced / max(seconds - prefill, 1e-9)}


def run_worker(args, mmap_every_tensor: bool = False) -> dict:
    """Run one measurement in a fresh interpreter, so memory figures and allocator state are its own."""
    command = [sys.executable, __file__, "--worker", *args]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    if mmap_every_tensor:  # honest RSS, but every allocation then faults in fresh pages: not for timing
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed",
                "args": args}
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio(a, b):
    return None if a is None or b is None or not b else a / b


def summarise(train: list[dict], generation: list[dict]) -> dict:
    by = {(r.get("impl"), r.get("length")): r for r in train if "error" not in r}
    lengths = sorted({r["length"] for r in train if "error" not in r})
    per_length = []
    for length in lengths:
        ours, theirs = by.get(("attnzoo", length)), by.get(("transformers", length))
        soft = by.get(("softmax", length))
        per_length.append({
            "length": length,
            "time_ours_over_transformers": ratio(ours and ours["seconds"], theirs and theirs["seconds"]),
            "memory_ours_over_transformers": ratio(ours and ours["peak_bytes"], theirs and theirs["peak_bytes"]),
            "time_ours_over_softmax": ratio(ours and ours["seconds"], soft and soft["seconds"]),
            "memory_ours_over_softmax": ratio(ours and ours["peak_bytes"], soft and soft["peak_bytes"]),
        })
    gen = {r["impl"]: r for r in generation if "error" not in r}
    tps = {impl: gen[impl]["tokens_per_second"] for impl in gen}
    decode = {impl: gen[impl]["decode_tokens_per_second"] for impl in gen}
    return {"train": per_length, "generation": {
        "tokens_per_second": tps,
        "ours_over_transformers": ratio(tps.get("attnzoo"), tps.get("transformers")),
        "ours_over_softmax": ratio(tps.get("attnzoo"), tps.get("softmax")),
        "decode_tokens_per_second": decode,
        "decode_ours_over_transformers": ratio(decode.get("attnzoo"), decode.get("transformers")),
        "decode_ours_over_softmax": ratio(decode.get("attnzoo"), decode.get("softmax")),
    }}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for impl, style in zip(IMPLEMENTATIONS, ("o-", "s--", "^:"), strict=True):
        rows = sorted((r for r in report["train"] if r.get("impl") == impl and "error" not in r),
                      key=lambda r: r["length"])
        if not rows:
            continue
        lengths = [r["length"] for r in rows]
        axes[0].plot(lengths, [r["seconds"] for r in rows], style, label=impl)
        axes[1].plot(lengths, [r["peak_bytes"] / 2**20 for r in rows], style, label=impl)
    for ax, title in zip(axes[:2], ("forward + backward time (s)", "peak step memory (MiB)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    gen = report["summary"]["generation"]["tokens_per_second"]
    if gen:
        names = [impl for impl in IMPLEMENTATIONS if impl in gen]
        axes[2].bar(names, [gen[n] for n in names], color=["C0", "C1", "C2"][:len(names)])
        axes[2].set_title(f"greedy generation, {report['settings']['prompt']} + {report['settings']['new_tokens']}"
                          " tokens (tokens/s)")
    fig.suptitle(f"Reformer: attnzoo vs transformers ({report['environment']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=3, help="timed training steps per configuration")
    parser.add_argument("--softmax_max_length", "--softmax-max-length", type=int, default=16384,
                        help="train the softmax peer only up to this length (its time grows quadratically)")
    parser.add_argument("--prompt", type=int, default=3072)
    parser.add_argument("--new_tokens", "--new-tokens", type=int, default=256)
    parser.add_argument("--skip_generation", "--skip-generation", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--output", type=Path, default=RESULTS / "reformer_vs_transformers.json")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        import torch

        kind, impl, device = args.worker[0], args.worker[1], args.worker[2]
        if args.threads:
            torch.set_num_threads(args.threads)
        if kind in ("train", "memory"):
            result = train_worker(impl, int(args.worker[3]), device, int(args.worker[4]), kind)
        else:
            result = generate_worker(impl, int(args.worker[3]), int(args.worker[4]), device)
        print(json.dumps(result))
        return

    import torch
    import transformers

    threads = args.threads or torch.get_num_threads()
    device_name = (cuda_device_name(args.device) if args.device.startswith("cuda")
                   else f"{platform.machine()}, {threads} of {os.cpu_count()} threads")
    settings = {"lengths": args.lengths, "repeats": args.repeats, "prompt": args.prompt, "new_tokens": args.new_tokens,
                "layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "ffn": FFN, "chunk": CHUNK, "hashes": HASHES,
                "vocab": VOCAB, "batch": 1}
    setup = {**settings, "softmax_max_length": args.softmax_max_length, "skip_generation": args.skip_generation,
             "device": f"{args.device} ({device_name})"}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    output = report_target(args.output, setup, REPORT_CHECK, f"{SCRIPT}.py", flag="--output")
    common = ["--threads", str(args.threads)] if args.threads else []
    train, generation = [], []
    for length in args.lengths:
        for impl in IMPLEMENTATIONS:
            if impl == "softmax" and length > args.softmax_max_length:
                continue
            result = run_worker(["train", impl, args.device, str(length), str(args.repeats)] + common)
            if args.device == "cpu" and "error" not in result:
                # CPU memory from its own process (see the module docstring); time from the run above
                memory = run_worker(["memory", impl, args.device, str(length), "0"] + common, mmap_every_tensor=True)
                result["peak_bytes"] = memory.get("peak_bytes")
            print(json.dumps(result), flush=True)
            train.append(result)
    if not args.skip_generation:
        for impl in IMPLEMENTATIONS:
            result = run_worker(["generate", impl, args.device, str(args.prompt), str(args.new_tokens)] + common)
            print(json.dumps(result), flush=True)
            generation.append(result)
    report = {
        "benchmark": "reformer_vs_transformers",
        "setup": setup,
        "settings": settings,
        "environment": {"device": f"{args.device} ({device_name})", "torch": torch.__version__,
                        "transformers": transformers.__version__, "threads": threads,
                        "python": platform.python_version()},
        "train": train,
        "generation": generation,
    }
    report["summary"] = summarise(train, generation)
    write_report(output, report, indent=2)
    plot(report, output.with_suffix(".png"))
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
