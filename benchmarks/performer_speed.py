"""Performer speed and memory, side by side in one run.

    python benchmarks/performer_speed.py --device cpu  --train_lengths 1024 2048 4096 8192 16384
    python benchmarks/performer_speed.py --device cuda --train_lengths 1024 2048 4096 8192 16384

1. Causal LM training step (forward + backward, batch 1): attnzoo's Performer against lucidrains/performer-pytorch
   (`PerformerLM`, pip `performer-pytorch`) with the same sizes (hidden 256, 4 layers, 4 heads of 64, FFN 1024,
   256 random features, redraw every 1000 steps, no biases in attention, learned absolute positions). Without the
   optional `fast_transformers` CUDA extension (which needs compiling), performer-pytorch uses its chunked PyTorch
   causal path, which is what a pip install gives.
2. Decoding: per-token latency of cached greedy decoding after a context of 1K-64K tokens, attnzoo's Performer (a
   recurrent state) against the same backbone with exact softmax attention and a KV cache (PyTorch SDPA).

Every configuration runs in a fresh worker process. Peak memory (benchmarks/harness.py): on CUDA,
`torch.cuda.max_memory_allocated` during a step minus the memory in use before it (parameters); on CPU, the growth
of the process's peak RSS during the first step. Gradients are freed before each step, so both figures include
activations and gradients, equally for both implementations. Times are the median of `--repeats` steps.
Results: benchmarks/results/performer_speed_<device>.json, .png (`--output`), replaced only by a report of the same
setup (another setup's goes beside it; a file that is not this benchmark's report is refused:
benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from attnzoo.transformers_compat import output_cache

sys.path.insert(0, str(Path(__file__).parent))
from harness import cuda_device_name, run_worker, sync, timed_step_with_peak  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/performer_speed"
#: what makes a results file this benchmark's report (the committed ones, from before reports were marked, too)
REPORT_CHECK = require_keys("setup", "train", "decode", "summary", benchmark="performer_speed")
HIDDEN, LAYERS, HEADS, FEATURES, VOCAB = 256, 4, 4, 256, 256


def zoo_model(kind: str, max_len: int, positions: str = "learned"):
    from transformers import AutoConfig, AutoModelForCausalLM

    import attnzoo  # noqa: F401

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=4 * HIDDEN, max_position_embeddings=max_len, hidden_dropout_prob=0.0,
                  attention_bias=False, is_decoder=True, position_embedding_type=positions)
    if kind == "performer":
        config = AutoConfig.for_model("attnzoo_performer", num_random_features=FEATURES, feature_redraw="interval",
                                      feature_redraw_interval=1000, **common)
    else:
        config = AutoConfig.for_model("attnzoo_softmax", **common)
    return AutoModelForCausalLM.from_config(config)


def peer_model(max_len: int):
    from performer_pytorch import PerformerLM

    return PerformerLM(num_tokens=VOCAB, max_seq_len=max_len, dim=HIDDEN, depth=LAYERS, heads=HEADS, dim_head=64,
                       causal=True, nb_features=FEATURES, feature_redraw_interval=1000, rotary_position_emb=False)


def worker_train(impl: str, length: int, device: str, repeats: int) -> dict:
    torch.manual_seed(0)
    model = (peer_model(length) if impl == "performer-pytorch" else zoo_model("performer", length)).to(device)
    model.train()
    ids = torch.randint(0, VOCAB, (1, length), device=device)

    def step():
        if impl == "performer-pytorch":
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        else:
            loss = model(ids, labels=ids).loss
        loss.backward()

    def step_with_fresh_grads():
        model.zero_grad(set_to_none=True)
        step()

    seconds, peak = timed_step_with_peak(step_with_fresh_grads, device, repeats)
    return {"impl": impl, "length": length, "step_s": seconds, "peak_MiB": peak}


@torch.no_grad()
def worker_decode(impl: str, context: int, device: str, repeats: int) -> dict:
    torch.manual_seed(0)
    model = zoo_model(impl, context + repeats + 8, positions="sinusoidal").to(device).eval()
    ids = torch.randint(0, VOCAB, (1, context), device=device)
    out = model(ids, use_cache=True)  # prefill
    cache, next_id = output_cache(out), out.logits[:, -1:].argmax(-1)
    times = []
    for i in range(repeats + 3):
        sync(device)
        start = time.perf_counter()
        out = model(next_id, cache=cache, use_cache=True)
        next_id = out.logits[:, -1:].argmax(-1)
        sync(device)
        if i >= 3:  # warm-up steps
            times.append(time.perf_counter() - start)
    return {"impl": impl, "context": context, "ms_per_token": 1000 * statistics.median(times)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--train_lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--decode_contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--peer_max_length", type=int, default=1 << 30,
                   help="skip performer-pytorch above this length (its fallback needs ~2.8 GB per layer at 4K)")
    p.add_argument("--softmax_max_context", type=int, default=65536, help="skip softmax decoding above this")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode_repeats", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads in the workers (0: torch's default)")
    p.add_argument("--output", type=Path, default=None,
                   help="default: benchmarks/results/performer_speed_<device>.json")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        kind, impl, size, device, repeats = args.worker
        fn = worker_train if kind == "train" else worker_decode
        print(json.dumps(fn(impl, int(size), device, int(repeats))))
        return

    device_name = cuda_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    setup = {"device": device_name, "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "features": FEATURES,
             **{k: getattr(args, k) for k in ("train_lengths", "decode_contexts", "peer_max_length",
                                              "softmax_max_context", "repeats", "decode_repeats", "threads")}}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    out = report_target(args.output or RESULTS / f"performer_speed_{args.device}.json", setup, REPORT_CHECK,
                        f"{SCRIPT}.py", flag="--output")
    threads = ["--threads", str(args.threads)] if args.threads else []
    train, decode = [], []
    for length in args.train_lengths:
        for impl in ("attnzoo", "performer-pytorch"):
            if impl == "performer-pytorch" and length > args.peer_max_length:
                continue
            row = run_worker(__file__, ["train", impl, str(length), args.device, str(args.repeats), *threads])
            if row:
                train.append(row)
                print(json.dumps(row))
    for context in args.decode_contexts:
        for impl in ("performer", "softmax"):
            if impl == "softmax" and context > args.softmax_max_context:
                continue
            row = run_worker(__file__, ["decode", impl, str(context), args.device, str(args.decode_repeats), *threads])
            if row:
                decode.append(row)
                print(json.dumps(row))

    summary = {}
    for length in args.train_lengths:
        ours = next((r for r in train if r["impl"] == "attnzoo" and r["length"] == length), None)
        peer = next((r for r in train if r["impl"] == "performer-pytorch" and r["length"] == length), None)
        if ours and peer:
            summary[f"train_speedup_vs_performer_pytorch_{length}"] = peer["step_s"] / ours["step_s"]
            summary[f"train_memory_ratio_vs_performer_pytorch_{length}"] = ours["peak_MiB"] / max(peer["peak_MiB"],
                                                                                                  1e-9)
    perf = {r["context"]: r["ms_per_token"] for r in decode if r["impl"] == "performer"}
    soft = {r["context"]: r["ms_per_token"] for r in decode if r["impl"] == "softmax"}
    if perf:
        summary["decode_flatness_longest_vs_shortest"] = perf[max(perf)] / perf[min(perf)]
    for context in sorted(set(perf) & set(soft)):
        summary[f"decode_speedup_vs_softmax_kv_{context}"] = soft[context] / perf[context]
    for key, value in summary.items():
        print(f"{key}: {value:.2f}")
    result = {"benchmark": "performer_speed", "setup": setup, "torch": torch.__version__, "train": train,
              "decode": decode, "summary": summary}
    write_report(out, result, indent=2)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for impl, style in (("attnzoo", "o-"), ("performer-pytorch", "s--")):
        rows = [r for r in result["train"] if r["impl"] == impl]
        axes[0].plot([r["length"] for r in rows], [r["step_s"] for r in rows], style, label=impl)
        axes[1].plot([r["length"] for r in rows], [r["peak_MiB"] for r in rows], style, label=impl)
    for impl, style in (("performer", "o-"), ("softmax", "s--")):
        rows = [r for r in result["decode"] if r["impl"] == impl]
        label = "attnzoo Performer (recurrent state)" if impl == "performer" else "softmax + KV cache (SDPA)"
        axes[2].plot([r["context"] for r in rows], [r["ms_per_token"] for r in rows], style, label=label)
    titles = ["causal LM train step (s)", "train step peak memory (MiB)", "decode latency (ms / token)"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens" if ax is not axes[2] else "context tokens")
        ax.set_title(f"{title}\n{result['setup']['device']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
