"""Training activation memory of the reversible stack against the standard residual stack, by depth.

    python benchmarks/reversible_memory.py            # CPU: activation bytes held for backward
    python benchmarks/reversible_memory.py --cuda     # also the CUDA peak during forward+backward

Two measures, both activations only:
- saved_MiB: bytes of every tensor autograd keeps for the backward pass at the end of the forward pass (counted with
  `torch.autograd.graph.saved_tensors_hooks`). Tensors that share storage with a parameter (e.g. a Linear's weight)
  are excluded, and no optimizer exists, so parameters and optimizer state are not in the figure.
- cuda_peak_MiB (with --cuda): `torch.cuda.max_memory_allocated` during one forward+backward, minus the memory in
  use just before it. A warm-up step runs first, so parameters and their gradients are already allocated and are
  part of the subtracted baseline; there is no optimizer. This figure includes the reversible backward's
  recomputation of one layer at a time, which the saved-bytes figure cannot see.

Results go to benchmarks/results/reversible_memory.json and .png (`--output`): one section per run, "cpu" or "cuda"
(with --cuda), the other section kept. A section is replaced only by a run of the same setup; a run of another setup
goes into a report beside it, and a file that is not this benchmark's report is refused (benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from owned_outputs import (  # noqa: E402
    Refused,
    as_recorded,
    beside,
    exit_on_refusal,
    read_report,
    require_keys,
    write_report,
)

import attnzoo  # noqa: F401, E402
from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/reversible_memory"
SECTIONS = ("cpu", "cuda")
#: what a section of the report holds
SECTION_CHECK = require_keys("setup", "rows", "summary")


def check_report(report: dict) -> None:
    """What makes a results file this benchmark's report (the committed one, from before reports were marked, too):
    a "cpu" and/or a "cuda" section, each with its setup, rows and summary."""
    require_keys(benchmark="reversible_memory")(report)
    sections = [key for key in report if key != "benchmark"]
    if not sections or any(key not in SECTIONS for key in sections):
        raise ValueError(f"it holds {', '.join(map(repr, sections)) or 'nothing'} (a report has a 'cpu' and/or a "
                         "'cuda' section)")
    for key in sections:
        if not isinstance(report[key], dict):
            raise ValueError(f"its {key!r} section is not an object")
        SECTION_CHECK(report[key])


def section_setup(section: dict) -> dict:
    """A section's setup; one from before setups named the depths takes them from its rows."""
    return {"depths": list(dict.fromkeys(row["depth"] for row in section["rows"])), **section["setup"]}


def results_target(requested: Path, key: str, setup: dict) -> Path:
    """Where this run's section goes, decided before anything is measured: `requested` when it is missing, or holds
    this benchmark's report with no such section or one of the same setup (the other section is kept); beside it
    when it holds one of another setup. A file that is not this benchmark's report is refused, and so is a plot with
    no report beside it."""
    for target in (requested, beside(requested, {key: setup})):
        if not target.exists():
            if target.with_suffix(".png").exists():
                raise Refused(f"{target.with_suffix('.png')} exists with no report of {SCRIPT}.py at {target} beside "
                              "it; the benchmark would draw over it. It is left as it is and nothing was written: "
                              "name another --output (or move that file away).")
            return target
        earlier = read_report(target, check_report, f"{SCRIPT}.py", "--output",
                              fix="It is left as it is and nothing was written: name another --output (or move that "
                                  "file away)")
        if key not in earlier or section_setup(earlier[key]) == as_recorded(setup):
            return target
    raise Refused(f"{requested} and {beside(requested, {key: setup})} both hold {key} sections of {SCRIPT}.py with "
                  "other setups; nothing was written: name another --output.")


def make_model(depth: int, reversible: bool, args) -> ZooSoftmaxForCausalLM:
    torch.manual_seed(0)
    config = ZooSoftmaxConfig(vocab_size=256, hidden_size=args.hidden, num_attention_heads=args.heads,
                              intermediate_size=4 * args.hidden, num_hidden_layers=depth,
                              max_position_embeddings=args.length, hidden_dropout_prob=0.1, reversible=reversible,
                              is_decoder=True)
    return ZooSoftmaxForCausalLM(config).train()


def saved_activation_bytes(model, ids) -> int:
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=False)
    return total


def cuda_peak_bytes(model, ids) -> int:
    model(ids, labels=ids).loss.backward()  # warm-up: allocates gradients
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    model(ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 6, 12, 24])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cuda", action="store_true", help="also measure the CUDA peak (needs a GPU)")
    parser.add_argument("--cuda_length", type=int, default=4096)
    parser.add_argument("--cuda_batch", type=int, default=8)
    parser.add_argument("--output", type=Path, default=RESULTS / "reversible_memory.json")
    args = parser.parse_args(argv)
    setup = {k: getattr(args, k) for k in ("depths", "hidden", "heads", "length", "batch", "cuda_length", "cuda_batch")}
    setup["device"] = torch.cuda.get_device_name() if args.cuda else "cpu"
    section = "cuda" if args.cuda else "cpu"
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    output = results_target(args.output, section, setup)

    rows = []
    for depth in args.depths:
        for reversible in (False, True):
            model = make_model(depth, reversible, args)
            ids = torch.randint(0, 256, (args.batch, args.length))
            row = {"depth": depth, "stack": "reversible" if reversible else "standard",
                   "saved_MiB": saved_activation_bytes(model, ids) / 2**20}
            if args.cuda:
                args_cuda = argparse.Namespace(**{**vars(args), "length": args.cuda_length})
                model = make_model(depth, reversible, args_cuda).cuda()
                ids = torch.randint(0, 256, (args.cuda_batch, args.cuda_length), device="cuda")
                row["cuda_peak_MiB"] = cuda_peak_bytes(model, ids) / 2**20
                del model
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row))

    summary = {}
    for measure in ("saved_MiB", "cuda_peak_MiB"):
        for stack in ("standard", "reversible"):
            values = {r["depth"]: r[measure] for r in rows if r["stack"] == stack and measure in r}
            if values:
                lo, hi = min(values), max(values)
                summary[f"{stack}_{measure}_ratio_{hi}_vs_{lo}_layers"] = values[hi] / values[lo]
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    # the other section, as the file holds it now (results_target checked it is this benchmark's report)
    existing = json.loads(output.read_text()) if output.exists() else {}
    existing.update({"benchmark": "reversible_memory", section: {"setup": setup, "rows": rows, "summary": summary}})
    write_report(output, existing, indent=2)
    plot(existing, output.with_suffix(".png"))
    print(f"wrote the {section} section of {output} and {output.with_suffix('.png')}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The saved-bytes count always runs on the CPU, so the CUDA run contributes only its peak.
    panels = [(run, measure) for run, measure in (("cpu", "saved_MiB"), ("cuda", "cuda_peak_MiB"))
              if run in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (run, measure) in zip(axes[0], panels, strict=True):
        setup = results[run]["setup"]
        for stack, style in (("standard", "o-"), ("reversible", "s-")):
            rows = [r for r in results[run]["rows"] if r["stack"] == stack]
            ax.plot([r["depth"] for r in rows], [r[measure] for r in rows], style, label=stack)
        length = setup["cuda_length"] if measure == "cuda_peak_MiB" else setup["length"]
        batch = setup["cuda_batch"] if measure == "cuda_peak_MiB" else setup["batch"]
        title = "activations saved for backward" if measure == "saved_MiB" else "CUDA peak over params+grads"
        ax.set_title(f"{title}\n{setup['device']}, batch {batch} x {length} tokens, hidden {setup['hidden']}",
                     fontsize=9)
        ax.set_xlabel("layers")
        ax.set_ylabel("MiB")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
