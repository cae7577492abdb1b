"""torch.compile against eager: a causal-LM training step (forward + backward) of every family, in one process.

    python benchmarks/compile_speed.py                       # CPU, 4 layers, hidden 256, 4K tokens, all families
    python benchmarks/compile_speed.py --device cuda         # the same on a GPU
    python benchmarks/compile_speed.py --quick               # a smoke run (short sequence, 1 repeat)

Each family's default attention (softmax: SDPA; reformer: local + LSH, reversible, axial positions; performer: causal
FAVOR+; ra: unbiased RA; lara: causal LARA) in a 4-layer model, hidden 256, 4 heads, FFN 1024, batch 1. The model is
compiled with `torch.compile(model, fullgraph=True)` (a graph break would fail the run) and timed after one warm-up
step; the JSON records the median step time of both, their ratio, and the compile time (the first compiled step).
Results: benchmarks/results/compile_speed_<device>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from harness import step_seconds, sync
from transformers import AutoConfig, AutoModelForCausalLM

import attnzoo  # noqa: F401  (registers the families)

RESULTS = Path(__file__).parent / "results"
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
            "speedup": eager_seconds / compiled_seconds, "compile_s": compile_seconds}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["family"] for r in rows]
    ax.bar(names, [r["speedup"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="grey", lw=1)
    for i, r in enumerate(rows):
        ax.text(i, r["speedup"], f"{r['speedup']:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("eager time / compiled time")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 256 tokens, 1 repeat")
    parser.add_argument("--output", default=None, help="JSON path (default: benchmarks/results/compile_speed_DEVICE)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    length, repeats = (256, 1) if args.quick else (args.length, args.repeats)
    rows = []
    for family in args.families:
        rows.append(measure(family, length, args.device, repeats))
        print(json.dumps(rows[-1]), flush=True)
    report = {"experiment": "torch.compile(fullgraph=True) vs eager, causal-LM training step",
              "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": repeats,
              "model": "4 layers, hidden 256, 4 heads, FFN 1024, batch 1", "rows": rows}
    out = Path(args.output) if args.output else RESULTS / f"compile_speed_{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(rows, out.with_suffix(".png"), f"torch.compile speed-up, {length} tokens, {report['device']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
