"""Decayed causal linear attention on the CPU: how its chunk-state prefix sum is computed, and what exactness costs.

    python benchmarks/decayed_linear_cpu.py [--quick]

1. The decayed prefix sum over chunk states, Y_j = Σ_{i<=j} exp(E_i - E_j) X_i (X: [1, 8, C, r·(e+1)], r = 256,
   e = 64, E nondecreasing with +200 jumps), forward + backward: `decayed_cumsum` (blocks of [32, 32] decay-matrix
   products, what attnzoo.ops uses) against a sign-split `torch.logcumsumexp` (log X⁺ and log X⁻ scanned
   separately, a custom backward running the same scan reversed). Error: max |Y - Y_ref| / max |Y_ref| against a
   float64 recurrence, both methods in float32.
2. The whole op (chunked PyTorch path, chunks of 64) forward + backward against the existing causal linear attention
   of attnzoo.modeling.attention.random_features (one key constant for the whole sequence, no running max), batch 1,
   8 heads, r = 256, e = 64, float32.
Times: median of --repeats runs (benchmarks/harness.py). Results: benchmarks/results/decayed_linear_cpu.json, .png
(`--output`), replaced only by a report of the same setup (a --quick run's goes beside the committed one; a file that
is not this benchmark's report is refused: benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import setup_or_legacy, step_seconds  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/decayed_linear_cpu"
#: what makes a results file this benchmark's report (the committed one, from before reports were marked, too)
REPORT_CHECK = require_keys("scan", "op", "repeats", "threads", benchmark="decayed_linear_cpu")
#: the setup of a report from before reports stored theirs: its threads and repeats, the lengths of its scan rows
LEGACY_SETUP = setup_or_legacy(lambda r: {"lengths": list(dict.fromkeys(row["tokens"] for row in r["scan"])),
                                          "repeats": r["repeats"], "threads": r["threads"]})
HEADS, FEATURES, VALUE_DIM, CHUNK = 8, 256, 64, 64


def log_scan(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Σ_{i<=j} exp(E_i - E_j) X_i along dim -2 through logcumsumexp of E_i + log X_i, split by sign."""
    e = levels.unsqueeze(-1)
    positive = torch.logcumsumexp(x.clamp(min=0).log() + e, dim=-2)
    negative = torch.logcumsumexp((-x).clamp(min=0).log() + e, dim=-2)
    return (positive - e).exp() - (negative - e).exp()


class LogScan(torch.autograd.Function):
    """The log-space scan with its backward: the decayed suffix sum, i.e. the same scan on the reversed sequence
    with levels -E (nondecreasing again)."""

    @staticmethod
    def forward(ctx, x, levels):
        ctx.save_for_backward(levels)
        return log_scan(x, levels)

    @staticmethod
    def backward(ctx, grad):
        (levels,) = ctx.saved_tensors
        return log_scan(grad.flip(-2), -levels.flip(-1)).flip(-2), None


def reference_scan(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    out, total = [], torch.zeros_like(x[..., 0, :])
    for j in range(x.shape[-2]):
        decay = (levels[..., j - 1] - levels[..., j]).exp().unsqueeze(-1) if j else 1.0
        total = decay * total + x[..., j, :]
        out.append(total)
    return torch.stack(out, dim=-2)


def median_seconds(step, repeats: int) -> float:
    step()  # warm-up
    return statistics.median(step_seconds(step, "cpu", repeats))


def scan_rows(chunks: int, repeats: int) -> list[dict]:
    from attnzoo.ops.decayed_linear_attention import decayed_cumsum

    generator = torch.Generator().manual_seed(0)
    x64 = torch.randn(1, HEADS, chunks, FEATURES * (VALUE_DIM + 1), generator=generator, dtype=torch.float64)
    levels64 = (3 * torch.rand(1, HEADS, chunks, generator=generator, dtype=torch.float64)).cumsum(-1)
    levels64[..., chunks // 3:] += 200.0
    x, levels = x64.float(), levels64.float()
    reference = reference_scan(x.double(), levels.double())
    rows = []
    for method, fn in (("decay-matrix blocks", decayed_cumsum), ("sign-split logcumsumexp", LogScan.apply)):
        leaf = x.clone().requires_grad_()
        weights = torch.randn(x.shape, generator=generator)

        def step(fn=fn, leaf=leaf, weights=weights):
            torch.autograd.grad((fn(leaf, levels) * weights).sum(), leaf)

        with torch.no_grad():
            error = ((fn(x, levels).double() - reference).abs().max() / reference.abs().max()).item()
        rows.append({"chunks": chunks, "tokens": chunks * CHUNK, "method": method,
                     "fwd_bwd_s": median_seconds(step, repeats), "max_relative_error": error})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def global_max_causal_form(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                            state: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The causal linear attention the zoo used before the decayed form, kept here as this benchmark's baseline: keys
    stabilised by one maximum over the whole sequence, so outputs could depend on later tokens through rounding.
    Causal linear attention in chunks of `chunk_size` (any N): each query sees the state of all earlier chunks
    (an exclusive cumulative sum of per-chunk Φ_Kᵀ V) plus the keys at or before it in its own chunk.

    Memory is O(N·chunk + (N/chunk)·r·d_v); no [N, r, d_v] tensor is built. `state` = (S, z) of keys that come
    before these queries (a decoding prefix), already expressed with the same key constant.
    """
    batch, heads, n, r = phi_q.shape
    pad = (-n) % chunk_size
    if pad:
        phi_q, phi_k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v))
    chunks = (n + pad) // chunk_size
    fq = phi_q.view(batch, heads, chunks, chunk_size, r)
    fk = phi_k.view(batch, heads, chunks, chunk_size, r)
    vv = v.view(batch, heads, chunks, chunk_size, -1)
    kv = torch.einsum("bhclr,bhcle->bhcre", fk, vv)
    k_sum = fk.sum(3)
    kv_before = kv.cumsum(2) - kv  # exclusive: the chunks strictly before
    k_before = k_sum.cumsum(2) - k_sum
    if state is not None:
        kv_before = kv_before + state[0].unsqueeze(2)
        k_before = k_before + state[1].unsqueeze(2)
    scores = torch.einsum("bhclr,bhcmr->bhclm", fq, fk).tril()
    num = torch.einsum("bhclr,bhcre->bhcle", fq, kv_before) + torch.einsum("bhclm,bhcme->bhcle", scores, vv)
    den = torch.einsum("bhclr,bhcr->bhcl", fq, k_before) + scores.sum(-1)
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)
    out = out.reshape(batch, heads, chunks * chunk_size, -1)
    return out[:, :, :n]


def op_rows(length: int, repeats: int) -> list[dict]:
    from attnzoo.ops.decayed_linear_attention import decayed_linear_attention

    generator = torch.Generator().manual_seed(0)
    shape = (1, HEADS, length, FEATURES)
    log_q, log_k = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    running_max = torch.cummax(log_k.amax(-1), dim=-1).values
    phi_q = (log_q - log_q.amax(-1, keepdim=True)).exp()
    phi_k_running = (log_k - running_max[..., None]).exp()
    phi_k_global = (log_k - log_k.amax(dim=(-2, -1), keepdim=True)).exp()
    v = torch.randn(1, HEADS, length, VALUE_DIM, generator=generator)
    weights = torch.randn(v.shape, generator=generator)
    variants = {
        "decayed (running max), chunked torch": (
            phi_k_running, lambda q, k, v: decayed_linear_attention(q, k, v, running_max, CHUNK, backend="torch")),
        "previous causal form (global max)": (phi_k_global, lambda q, k, v: global_max_causal_form(q, k, v, CHUNK)),
    }
    rows = []
    for name, (phi_k, fn) in variants.items():
        leaves = [t.clone().requires_grad_() for t in (phi_q, phi_k, v)]

        def step(fn=fn, leaves=leaves):
            torch.autograd.grad((fn(*leaves) * weights).sum(), leaves)

        rows.append({"tokens": length, "variant": name, "fwd_bwd_s": median_seconds(step, repeats)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (key, label_key, title) in zip(axes, (("scan", "method", "chunk-state prefix sum, fwd+bwd"),
                                                  ("op", "variant", "causal linear attention, fwd+bwd")),
                                           strict=True):
        rows = results[key]
        for label in dict.fromkeys(row[label_key] for row in rows):
            points = sorted((row["tokens"], row["fwd_bwd_s"]) for row in rows if row[label_key] == label)
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (batch 1, 8 heads, r 256, e 64)")
        ax.set_ylabel("seconds")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4K tokens only, 1 repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--output", type=Path, default=None, help="default: benchmarks/results/decayed_linear_cpu.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [4096] if args.quick else [4096, 16384]
    repeats = 1 if args.quick else args.repeats
    setup = {"lengths": lengths, "repeats": repeats, "threads": torch.get_num_threads()}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    out = report_target(args.output or RESULTS / "decayed_linear_cpu.json", setup, REPORT_CHECK, f"{SCRIPT}.py",
                        flag="--output", setup_of=LEGACY_SETUP)
    results = {"benchmark": "decayed_linear_cpu", "setup": setup, "threads": setup["threads"],
               "torch": torch.__version__, "repeats": repeats,
               "scan": [row for n in lengths for row in scan_rows(n // CHUNK, repeats)],
               "op": [row for n in [1024, *lengths] for row in op_rows(n, repeats)]}
    write_report(out, results)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
