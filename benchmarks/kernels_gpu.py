"""The fused attention ops on a GPU, side by side with their PyTorch paths, fla and SDPA, in one run.

    python benchmarks/kernels_gpu.py            # 4K-64K tokens
    python benchmarks/kernels_gpu.py --quick    # 4K and 16K, fewer repeats

CUDA only. Batch 1, 8 heads of dimension 64, bfloat16 inputs, at each length:
1. Decayed causal linear attention (attnzoo.ops.decayed_linear_attention, r = 256 features): the Triton kernels,
   the chunked PyTorch path, fla's `chunk_simple_gla` with the same decay (log decay M_{t-1} - M_t; the numerator
   only, fla has no normaliser there) and fla's `chunk_linear_attn` (normalised, no decay) when fla
   (`pip install flash-linear-attention`) is importable, and SDPA causal softmax attention (the baseline).
2. Windowed chunk attention (attnzoo.ops.chunked_attention, chunks of 64) on the exact masks of a causal
   LocalAttention layer (one chunk back) and a causal 2-round LSHAttention layer (bucket window, duplicate
   correction, self penalty), captured from their forward: Triton, FlexAttention and the PyTorch path, against SDPA.
Times: median of --repeats runs of the forward (under no_grad) and of forward + backward (a loss weighting every
output, the log-sum-exp included); peak memory: `torch.cuda.max_memory_allocated` during one run minus the memory in
use before it (inputs), via benchmarks/harness.py. Ratios are against SDPA and against the PyTorch path of the same
run. A configuration that fails (out of memory, an fla API this script does not know) is recorded with its error.
Results: benchmarks/results/kernels_gpu_<device>.json and .png (`--output`), replaced only by a report of the same
setup (another setup's goes beside it; a file that is not this benchmark's report is refused:
benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from harness import setup_or_legacy, timed_step_with_peak  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

RESULTS = Path(__file__).parent / "results"
HEADS, HEAD_DIM, FEATURES, CHUNK = 8, 64, 256, 64
LENGTHS = [4096, 8192, 16384, 32768, 65536]
QUICK_LENGTHS = [4096, 16384]
GPU_COMMAND = "python benchmarks/kernels_gpu.py [--quick]"
DEVICE = "cuda"
SCRIPT = "benchmarks/kernels_gpu"
#: the suites each --ops value runs
SUITES = {"linear": ["decayed linear attention"],
          "windowed": ["windowed attention, local masks", "windowed attention, LSH masks"]}
#: what makes a results file this benchmark's report (the committed ones, from before reports were marked, too)
REPORT_CHECK = require_keys("device", "benchmarks", "complete", benchmark="kernels_gpu")
#: the setup's settings a report records at its top level
RECORDED = ("device", "fla", "heads", "head_dim", "features", "chunk", "dtype", "repeats")


def legacy_setup(report: dict) -> dict:
    """The setup of a report from before reports stored theirs: its recorded settings, the ops of its suites and the
    lengths they measured."""
    ops = [op for op, suites in SUITES.items() if any(name in report["benchmarks"] for name in suites)]
    lengths = [int(n) for n in dict.fromkeys(n for rows in report["benchmarks"].values() for n in rows)]
    return {**{k: report[k] for k in RECORDED}, "ops": ops, "lengths": lengths}


LEGACY_SETUP = setup_or_legacy(legacy_setup)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=None, help=f"tokens per sequence (default {LENGTHS})")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per configuration (default 10; quick 3)")
    p.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS} and 3 repeats")
    p.add_argument("--ops", nargs="+", default=["linear", "windowed"], choices=["linear", "windowed"])
    p.add_argument("--output", type=Path, default=None, help="JSON path (default results/kernels_gpu_<device>.json)")
    p.add_argument("--no_fla", action="store_true",
                   help="leave out fla's rows even when it is importable (on a cold Triton cache its autotuning "
                        "took over four minutes for one length in the second GPU session)")
    args = p.parse_args(argv)
    args.lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    args.repeats = args.repeats or (3 if args.quick else 10)
    return args


def device_tag(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def without_grad(step):
    def run():
        with torch.no_grad():
            step()
    return run


def measure(make_step, repeats: int) -> dict:
    """{forward_ms, forward_peak_mib, train_ms, train_peak_mib} of make_step(train) -> step, or the error."""
    row = {}
    for mode in ("forward", "train"):
        try:
            step = make_step(True) if mode == "train" else without_grad(make_step(False))
            seconds, peak = timed_step_with_peak(step, DEVICE, repeats)
            row[f"{mode}_ms"], row[f"{mode}_peak_mib"] = 1000 * seconds, peak
        except torch.cuda.OutOfMemoryError:
            row[f"{mode}_error"] = "out of memory"
        except Exception as error:  # noqa: BLE001  (an optional library's API, a compile failure: record, go on)
            row[f"{mode}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        torch.cuda.empty_cache()
    return row


def backward_of(outputs, weights, inputs):
    """Gradients of a loss weighting every output (returned, not accumulated: each run allocates its own)."""
    loss = sum((o.float() * w).sum() for o, w in zip(outputs, weights, strict=True))
    return torch.autograd.grad(loss, inputs)


def leaves(tensors, train: bool):
    return [t.detach().clone().requires_grad_(train) for t in tensors]


# -- 1. decayed causal linear attention -------------------------------------------------------------------------
def linear_inputs(length: int, generator: torch.Generator):
    """φq, φk [1, H, N, r] (bf16, entries <= 1), v [1, H, N, 64] (bf16), running max M [1, H, N] (float32)."""
    shape = (1, HEADS, length, FEATURES)
    log_q = torch.randn(shape, device=DEVICE, generator=generator)
    log_k = torch.randn(shape, device=DEVICE, generator=generator)
    running_max = torch.cummax(log_k.amax(-1), dim=-1).values
    phi_q = (log_q - log_q.amax(-1, keepdim=True)).exp().bfloat16()
    phi_k = (log_k - running_max[..., None]).exp().bfloat16()
    v = torch.randn(1, HEADS, length, HEAD_DIM, device=DEVICE, generator=generator).bfloat16()
    return phi_q, phi_k, v, running_max


def fla_functions() -> dict:
    try:
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return {}
    return {"fla chunk_simple_gla": chunk_simple_gla, "fla chunk_linear_attn": chunk_linear_attn}


def fla_call(fn, q, k, v, **kwargs):
    """fla in its [B, T, H, K] layout (the default of current versions; older ones take head_first=False)."""
    if "head_first" in inspect.signature(fn).parameters:
        kwargs["head_first"] = False
    out = fn(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), scale=1.0, **kwargs)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def linear_steps(length: int, fla_kernels: dict) -> dict:
    from attnzoo.ops import decayed_linear_attention

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    phi_q, phi_k, v, running_max = linear_inputs(length, generator)
    weights = [torch.randn(1, HEADS, length, HEAD_DIM, device=DEVICE, generator=generator)]
    log_decay = torch.cat([torch.zeros_like(running_max[..., :1]), running_max[..., :-1] - running_max[..., 1:]], -1)
    q_sdpa = torch.randn(1, HEADS, length, HEAD_DIM, device=DEVICE, generator=generator).bfloat16()

    def ours(backend):
        def make(train):
            q, k, vv = leaves((phi_q, phi_k, v), train)

            def step():
                out = decayed_linear_attention(q, k, vv, running_max, chunk_size=CHUNK, backend=backend)
                if train:
                    backward_of([out], weights, (q, k, vv))
            return step
        return make

    def fla(fn, **kwargs):
        def make(train):
            q, k, vv = leaves((phi_q, phi_k, v), train)
            extra = {name: value.transpose(1, 2).contiguous() for name, value in kwargs.items()}

            def step():
                out = fla_call(fn, q, k, vv, **extra)
                if train:
                    backward_of([out], weights, (q, k, vv))
            return step
        return make

    steps = {"triton": ours("triton"), "torch": ours("torch")}
    for name, fn in fla_kernels.items():
        steps[name] = fla(fn, g=log_decay) if "simple_gla" in name else fla(fn)
    steps["sdpa"] = sdpa_step(q_sdpa, v, weights)
    return steps


def sdpa_step(q, v, weights):
    def make(train):
        qq, kk, vv = leaves((q, q, v), train)

        def step():
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            if train:
                backward_of([out], weights, (qq, kk, vv))
        return step
    return make


# -- 2. windowed chunk attention --------------------------------------------------------------------------------
class _Captured(Exception):
    """Raised by the capturing stand-in to stop a layer's forward once its chunked_attention call is known."""


def captured_window_call(kind: str, length: int):
    """(q, k, v, mask, scale) of the chunked_attention call of a causal local or LSH layer on random inputs."""
    import attnzoo.modeling.attention.local as local_module
    import attnzoo.modeling.attention.lsh as lsh_module
    from attnzoo import ZooReformerConfig

    config = ZooReformerConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, local_chunk_length=CHUNK,
                               local_num_chunks_before=1, lsh_chunk_length=CHUNK, lsh_num_chunks_before=1,
                               lsh_num_hashes=2, lsh_full_attention_threshold=0, lsh_hash_seed=0,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    module = local_module if kind == "local" else lsh_module
    layer_cls = module.LocalAttention if kind == "local" else module.LSHAttention
    layer = layer_cls(config, 0, causal=True).to(DEVICE, torch.bfloat16).eval()
    seen = []

    def capture(q, k, v, mask, scale=1.0, dropout_p=0.0, save_probs=False, backend="auto"):  # chunked_attention's
        seen.append((q.detach(), k.detach(), v.detach(), mask, scale))
        raise _Captured

    original = module.chunked_attention
    module.chunked_attention = capture
    try:
        with torch.no_grad():
            layer(torch.randn(1, length, HEADS * HEAD_DIM, device=DEVICE, dtype=torch.bfloat16))
    except _Captured:
        pass
    finally:
        module.chunked_attention = original
    return seen[0]


def windowed_steps(kind: str, length: int) -> dict:
    from attnzoo.ops import chunked_attention

    q, k, v, mask, scale = captured_window_call(kind, length)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    weights = [torch.randn(q.shape, device=DEVICE, generator=generator),
               torch.randn(q.shape[:-1], device=DEVICE, generator=generator)]

    def ours(backend):
        def make(train):
            qq, kk, vv = leaves((q, k, v), train)

            def step():
                out, lse = chunked_attention(qq, kk, vv, mask, scale, backend=backend)
                if train:
                    backward_of([out, lse], weights, (qq, kk, vv))
            return step
        return make

    flat = torch.randn(1, HEADS, length, HEAD_DIM, device=DEVICE, generator=generator).bfloat16()
    return {"triton": ours("triton"), "flex": ours("flex"), "torch": ours("torch"),
            "sdpa": sdpa_step(flat, flat, [torch.randn(flat.shape, device=DEVICE, generator=generator)])}


# -- results ----------------------------------------------------------------------------------------------------
def add_ratios(rows: dict) -> None:
    """Per implementation: time and memory as multiples of SDPA's and of the PyTorch path's in the same run."""
    for baseline in ("sdpa", "torch"):
        base = rows.get(baseline, {})
        for row in rows.values():
            for key in ("forward_ms", "train_ms", "train_peak_mib"):
                if key in row and base.get(key):
                    row[f"{key}_vs_{baseline}"] = row[key] / base[key]


def summary_lines(results: dict) -> list[str]:
    lines = []
    for bench, by_length in results["benchmarks"].items():
        lines.append(f"== {bench}")
        lines.append(f"{'length':>7} {'impl':<24} {'fwd ms':>9} {'fwd+bwd ms':>11} {'peak MiB':>9} "
                     f"{'x sdpa':>7} {'x torch':>8}")
        for length, rows in by_length.items():
            for impl, row in rows.items():
                if "train_ms" not in row:
                    errors = "; ".join(v for k, v in row.items() if k.endswith("_error"))
                    lines.append(f"{length:>7} {impl:<24} {errors}")
                    continue
                ratio_sdpa = row.get("train_ms_vs_sdpa", float("nan"))
                ratio_torch = row.get("train_ms_vs_torch", float("nan"))
                lines.append(f"{length:>7} {impl:<24} {row.get('forward_ms', float('nan')):9.2f} "
                             f"{row['train_ms']:11.2f} {row['train_peak_mib']:9.0f} {ratio_sdpa:7.2f} "
                             f"{ratio_torch:8.2f}")
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(results["benchmarks"])
    panels = [("forward_ms", "forward (ms)"), ("train_ms", "forward + backward (ms)"),
              ("train_peak_mib", "peak memory, fwd + bwd (MiB)")]
    fig, axes = plt.subplots(len(benches), len(panels), figsize=(5 * len(panels), 3.6 * len(benches)),
                             squeeze=False)
    for row_axes, bench in zip(axes, benches, strict=True):
        by_length = results["benchmarks"][bench]
        impls = sorted({impl for rows in by_length.values() for impl in rows})
        for ax, (key, label) in zip(row_axes, panels, strict=True):
            for impl in impls:
                points = [(int(length), rows[impl][key]) for length, rows in by_length.items()
                          if key in rows.get(impl, {})]
                if points:
                    xs, ys = zip(*sorted(points), strict=True)
                    ax.plot(xs, ys, marker="o", label=impl, linestyle="--" if impl == "sdpa" else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens")
            ax.set_title(f"{bench}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=7)
    fig.suptitle(f"attnzoo fused ops on {results['device']} (batch 1, {HEADS} heads x {HEAD_DIM})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels_gpu.py measures CUDA kernels and there is no CUDA device here. On a "
                         f"machine with an NVIDIA GPU, from the repository root, run: {GPU_COMMAND}")
    import triton

    device = torch.cuda.get_device_name()
    fla = {} if args.no_fla else fla_functions()
    results = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
               "fla": sorted(fla) if fla else None, "heads": HEADS, "head_dim": HEAD_DIM, "features": FEATURES,
               "chunk": CHUNK, "dtype": "bfloat16", "repeats": args.repeats, "benchmarks": {}}
    suites = []
    if "linear" in args.ops:
        suites.append(("decayed linear attention", lambda n: linear_steps(n, fla)))
    if "windowed" in args.ops:
        suites += [("windowed attention, local masks", lambda n: windowed_steps("local", n)),
                   ("windowed attention, LSH masks", lambda n: windowed_steps("lsh", n))]
    setup = {**{k: results[k] for k in RECORDED}, "ops": [op for op in SUITES if op in args.ops],
             "lengths": args.lengths}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    output = report_target(args.output or RESULTS / f"kernels_gpu_{device_tag(device)}.json", setup, REPORT_CHECK,
                           f"{SCRIPT}.py", flag="--output", setup_of=LEGACY_SETUP)
    results = {"benchmark": "kernels_gpu", "setup": setup, **results}
    for name, build in suites:
        by_length = results["benchmarks"].setdefault(name, {})
        for length in args.lengths:
            steps = build(length)
            rows = {}
            for impl, make_step in steps.items():
                rows[impl] = measure(make_step, args.repeats)
                print(json.dumps({"bench": name, "length": length, "impl": impl, **rows[impl]}), flush=True)
            del steps
            torch.cuda.empty_cache()
            add_ratios(rows)
            by_length[str(length)] = rows
            # Rewritten after every length: a run stopped at its time limit keeps what it measured (the first GPU
            # session's quick run lost everything to its limit).
            write_report(output, {**results, "complete": False})
    write_report(output, {**results, "complete": True})
    plot(results, output.with_suffix(".png"))
    print("\n".join(summary_lines(results)))
    print(f"wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
