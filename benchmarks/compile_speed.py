"""torch.compile against eager: a causal-LM training step (forward + backward) of every family, in one process.

    python benchmarks/compile_speed.py                       # CPU, 4 layers, hidden 256, 1K and 4K tokens, all families
    python benchmarks/compile_speed.py --device cuda         # the same on a GPU
    python benchmarks/compile_speed.py --quick               # a smoke run (short sequence, 1 repeat)

Each family's default attention (softmax: SDPA; reformer: local + LSH, reversible, axial positions; performer: causal
FAVOR+; ra: unbiased RA; lara: causal LARA) in a 4-layer model, hidden 256, 4 heads, FFN 1024, batch 1. The model is
compiled with `torch.compile(model, fullgraph=True)` (a graph break would fail the run) and timed after one warm-up
step; the JSON records the median step time of both, their ratio, the compile time (the first compiled step) and
the share of the eager step spent in matrix products (torch.profiler, self time of mm/addmm/bmm/SDPA kernels): the
compiler fuses the work around them, so 1 / (1 - that share) is what removing all the rest would give if the
products stayed as they are (a reference, not a hard limit: a fusion can also remove a copy feeding a product).
Results: benchmarks/results/compile_speed_<device>.json and .png (`--output`), replaced only by a report of the same
setup (another setup's goes beside it; a file that is not this benchmark's report is refused:
benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import os

# compile_s is the cold compile time a user pays: no reuse of an earlier run's inductor/FX caches
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
import statistics
import sys
import time
from pathlib import Path

import torch
from harness import report_check, setup_or_legacy, step_seconds, sync
from owned_outputs import exit_on_refusal, report_target, write_report
from transformers import AutoConfig, AutoModelForCausalLM

import attnzoo  # noqa: F401  (registers the families)

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/compile_speed"
EXPERIMENT = "torch.compile(fullgraph=True) vs eager, causal-LM training step"
MODEL = "4 layers, hidden 256, 4 heads, FFN 1024, batch 1"
#: what makes a results file this benchmark's report (the committed ones, from before reports were marked, too)
REPORT_CHECK = report_check("rows", "device", "threads", "repeats", benchmark="compile_speed", experiment=EXPERIMENT)
#: the setup of a report from before reports stored theirs: what it recorded, the lengths and families from its rows
LEGACY_SETUP = setup_or_legacy(lambda r: {
    "device": r["device"], "threads": r["threads"], "lengths": list(dict.fromkeys(row["tokens"] for row in r["rows"])),
    "repeats": r["repeats"], "families": list(dict.fromkeys(row["family"] for row in r["rows"])),
    "inductor_caches": r["inductor_caches"], "model": r["model"]})
FAMILIES = {
    "softmax": {},
    "reformer": {"lsh_chunk_length": 64, "local_chunk_length": 64},
    "performer": {"num_random_features": 64},
    "ra": {},
    "lara": {"lara_num_samples": 16, "lara_chunk_size": 64},
}


def build(family: str, length: int, device: str):
    config = AutoConfig.for_model(f"attnzoo_{family}", vocab_size=256, hidden_size=256, num_hidden_layers=4,
                                  num_attention_heads=4, intermediate_size=1024, max_position_embeddings=length,
                                  is_decoder=True, hidden_dropout_prob=0.0, **FAMILIES[family])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device).train()


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
              "aten::_efficient_attention_forward", "aten::_efficient_attention_backward",
              "aten::_flash_attention_forward", "aten::_flash_attention_backward")


def matmul_share(step, device: str) -> float:
    """Share of one step's self time (CPU ops, or CUDA kernels on a GPU) spent in the matrix-product operators."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    events = prof.key_averages()
    attr = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events)
    return sum(getattr(e, attr) for e in events if e.key in MATMUL_OPS) / max(total, 1e-9)


def measure(family: str, length: int, device: str, repeats: int) -> dict:
    ids = torch.randint(0, 256, (1, length), device=device)
    eager = build(family, length, device)

    def train_step(model):
        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
        return step

    eager_step = train_step(eager)
    eager_step()  # warm-up
    eager_seconds = statistics.median(step_seconds(eager_step, device, repeats))
    eager_matmul_share = matmul_share(eager_step, device)
    torch._dynamo.reset()
    compiled_model = torch.compile(build(family, length, device), fullgraph=True)
    compiled_step = train_step(compiled_model)
    sync(device)
    start = time.perf_counter()
    compiled_step()  # compiles forward and backward
    sync(device)
    compile_seconds = time.perf_counter() - start
    compiled_seconds = statistics.median(step_seconds(compiled_step, device, repeats))
    return {"family": family, "tokens": length, "eager_step_s": eager_seconds, "compiled_step_s": compiled_seconds,
            "speedup": eager_seconds / compiled_seconds, "compile_s": compile_seconds,
            "eager_matmul_share": eager_matmul_share}


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Grouped bars: one group per family, one bar per sequence length, with the matmul-share bound as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r["family"] for r in rows))
    lengths = sorted({r["tokens"] for r in rows})
    width = 0.8 / len(lengths)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for j, length in enumerate(lengths):
        for i, family in enumerate(families):
            row = next((r for r in rows if r["family"] == family and r["tokens"] == length), None)
            if row is None:
                continue
            x = i + (j - (len(lengths) - 1) / 2) * width
            ax.bar(x, row["speedup"], width, color=f"C{j}", label=f"{length} tokens" if i == 0 else None)
            ax.text(x, row["speedup"], f"{row['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
            bound = 1.0 / max(1.0 - row["eager_matmul_share"], 1e-3)
            ax.plot([x - width / 2, x + width / 2], [bound, bound], color="black", lw=1,
                    label="1 / (1 - matmul share)" if i == 0 and j == 0 else None)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks(range(len(families)), families)
    ax.set_ylabel("eager time / compiled time")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 256 tokens, 1 repeat")
    parser.add_argument("--output", default=None, help="JSON path (default: benchmarks/results/compile_speed_DEVICE)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths, repeats = ([256], 1) if args.quick else (args.lengths, args.repeats)
    caches = "disabled" if os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1" else "enabled"
    setup = {"device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
             "threads": torch.get_num_threads(), "lengths": lengths, "repeats": repeats, "families": args.families,
             "inductor_caches": caches, "model": MODEL}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    requested = Path(args.output) if args.output else RESULTS / f"compile_speed_{args.device.split(':')[0]}.json"
    out = report_target(requested, setup, REPORT_CHECK, f"{SCRIPT}.py", flag="--output", setup_of=LEGACY_SETUP)
    rows = []
    for length in lengths:
        for family in args.families:
            rows.append(measure(family, length, args.device, repeats))
            print(json.dumps(rows[-1]), flush=True)
    report = {"benchmark": "compile_speed", "experiment": EXPERIMENT, "setup": setup,
              "command": " ".join(["python", "benchmarks/compile_speed.py", *(sys.argv[1:] if argv is None else argv)]),
              "device": setup["device"], "threads": setup["threads"], "torch": torch.__version__, "repeats": repeats,
              "inductor_caches": setup["inductor_caches"], "model": MODEL, "rows": rows}
    write_report(out, report)
    plot(rows, out.with_suffix(".png"), f"torch.compile speed-up of a training step, {report['device']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
