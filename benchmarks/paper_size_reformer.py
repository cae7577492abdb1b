"""A training step of the Reformer paper's large model ("Reformer: The Efficient Transformer", arXiv 2001.04451:
12 layers, d_model 1024, d_ff 4096, 8 heads, 64K-token sequences, batch 1): time per step, tokens per second and
peak memory of forward + backward + optimizer step, for attnzoo's Reformer, transformers' Reformer of the same sizes
and an exact-softmax model of the same sizes with activation checkpointing, each where it fits.

    python benchmarks/paper_size_reformer.py --tiny                          # seconds-long smoke run (CPU)
    python benchmarks/paper_size_reformer.py --device cpu --lengths 4096     # a small CPU check (paper sizes)
    python benchmarks/paper_size_reformer.py --device cuda                   # 64K tokens, float32
    python benchmarks/paper_size_reformer.py --device cuda --dtype bfloat16 --output \\
        benchmarks/results/paper_size_reformer_cuda_bf16.json

Models (vocabulary 256, every dropout 0, ReLU feed-forward, batch `--batch_size` 1):
- `attnzoo`: `ZooReformerForCausalLM` with the family's defaults: reversible layers, alternating local / LSH
  attention (`--num_hashes` 2 rounds, chunks of 64, one chunk of look-back, `lsh_attend_to="bucket"`, duplicate
  correction), axial positions (shape: the factor pair of the length nearest its square root, dims d/4 + 3d/4,
  i.e. 256 + 768), feed-forward in chunks of 2048 positions, LSH bucket count 2 x length / chunk (factorised);
- `transformers`: `ReformerModelWithLMHead` with the same settings (`attn_layers` local, lsh, ...; chunk lengths 64;
  the same axial shape and dims, which its training needs to multiply to the length; `chunk_size_feed_forward`
  2048; `num_buckets` its length-derived default), as benchmarks/reformer_vs_transformers.py builds it;
- `softmax`: attnzoo's softmax family (PyTorch SDPA, causal) at the same sizes, learned positions, no attention
  biases, with activation checkpointing on every block (`enable_activation_checkpointing`, transformers'
  `GradientCheckpointingLayer`), so activations are kept at block boundaries only.
The step: `loss = model(input_ids, labels=input_ids).loss` (next-token cross-entropy), `loss.backward()`,
`torch.optim.AdamW(lr=1e-4).step()`, gradients set to None. `--dtype bfloat16` runs forward and backward under
`torch.autocast` (weights, gradients and optimizer state stay float32). attnzoo's reversible backward and
checkpointing re-enter autocast when they recompute a layer; transformers' reversible backward does not, so under
bfloat16 its recomputation runs in float32 (slower, and not quite the forward it inverts).

Measures, each model in a fresh worker process (`benchmarks/harness.py`): `harness.timed_step_with_peak`: the
median of `--repeats` steps (on CUDA after a warm-up step, so the optimizer state exists) and the peak memory of
one step above what was held before it (CUDA: `max_memory_allocated`; CPU: growth of the process's peak resident
set during the first step); `total_peak_MiB`: the whole process's peak (CUDA: weights, optimizer state and the
step); `tokens_per_s`: batch x length / step time; every step's loss (`losses_finite`). Out of memory is recorded
as `"status": "oom"` with `"fits": false`; a model still running after `--worker_timeout` seconds as "timeout".
Ratios (`summary`, per length): attnzoo's speed-up over each peer (their step time / ours) and its memory over
theirs (below 1 is less).
Results: benchmarks/results/paper_size_reformer_<device>.json (rewritten after every model, so a stopped run keeps
its rows) and .png (`--output` elsewhere), replaced only by a report of the same setup (another setup's goes beside
it; a file that is not this benchmark's report is refused: benchmarks/owned_outputs.py).

Time on one H100/H200 at 64K (estimated, not yet measured): each model needs `--repeats` + 2 steps plus about
10 s of start-up; the Reformers a few seconds a step, the checkpointed softmax model the most (about 10-30 s a step
in float32, a few in bfloat16), so the default run takes about 2-5 minutes, and `--worker_timeout` 170 keeps one
length within 10 minutes whatever happens.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import cuda_device_name, rss_peak_mib, run_worker, timed_step_with_peak  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, require_keys  # noqa: E402
from owned_outputs import write_report as write_whole  # noqa: E402
from reformer_vs_transformers import axial_shape  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/paper_size_reformer"
MODELS = ("attnzoo", "transformers", "softmax")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VOCAB, CHUNK, FFN_CHUNK, LEARNING_RATE = 256, 64, 2048, 1e-4
#: the paper's large model (§5, enwik8-64K)
PAPER = dict(num_layers=12, hidden_size=1024, intermediate_size=4096, num_heads=8, lengths=[65536])
#: --tiny: 2 layers of width 64 on 1K tokens (still 16 chunks, so LSH hashes and local attention looks back)
TINY = dict(num_layers=2, hidden_size=64, intermediate_size=256, num_heads=4, lengths=[1024])


def axial_dims(hidden: int) -> list[int]:
    """The axial embedding's two widths: a quarter and three quarters of the model width (256 + 768 at 1024)."""
    return [hidden // 4, hidden - hidden // 4]


def build(impl: str, s: dict, length: int):
    torch.manual_seed(0)
    ffn_chunk = min(FFN_CHUNK, length)
    if impl == "transformers":
        from transformers import ReformerConfig, ReformerModelWithLMHead

        layers = (["local", "lsh"] * s["num_layers"])[:s["num_layers"]]
        config = ReformerConfig(
            vocab_size=VOCAB, hidden_size=s["hidden_size"], num_attention_heads=s["num_heads"],
            attention_head_size=s["hidden_size"] // s["num_heads"], attn_layers=layers,
            feed_forward_size=s["intermediate_size"], hidden_act="relu", axial_pos_shape=axial_shape(length),
            axial_pos_embds_dim=axial_dims(s["hidden_size"]), max_position_embeddings=length, is_decoder=True,
            lsh_attn_chunk_length=CHUNK, local_attn_chunk_length=CHUNK, num_hashes=s["num_hashes"],
            num_buckets=None, hidden_dropout_prob=0.0, chunk_size_feed_forward=ffn_chunk,
            local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0, pad_token_id=0,
            eos_token_id=None)
        return ReformerModelWithLMHead(config)
    if impl == "attnzoo":
        from attnzoo import ZooReformerConfig, ZooReformerForCausalLM

        config = ZooReformerConfig(
            vocab_size=VOCAB, hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
            num_attention_heads=s["num_heads"], intermediate_size=s["intermediate_size"], hidden_act="relu",
            attn_layers=["local", "lsh"], position_embedding_type="axial", axial_pos_shape=list(axial_shape(length)),
            axial_pos_embds_dim=axial_dims(s["hidden_size"]), max_position_embeddings=length, is_decoder=True,
            reversible=True, chunk_size_feed_forward=ffn_chunk, lsh_chunk_length=CHUNK, local_chunk_length=CHUNK,
            lsh_num_hashes=s["num_hashes"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=0, eos_token_id=None)
        return ZooReformerForCausalLM(config)
    from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM
    from attnzoo.transformers_compat import enable_activation_checkpointing

    config = ZooSoftmaxConfig(
        vocab_size=VOCAB, hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"], intermediate_size=s["intermediate_size"], hidden_act="relu",
        max_position_embeddings=length, is_decoder=True, attention_bias=False, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=None)
    model = ZooSoftmaxForCausalLM(config)
    enable_activation_checkpointing(model)
    return model


# -- the worker -----------------------------------------------------------------------------------------------------
class WorkerTimeout(Exception):
    """The model ran past --worker_timeout."""


def _on_alarm(signum, frame):
    raise WorkerTimeout


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def held_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(job: dict) -> dict:
    impl, length, device, s = job["impl"], job["length"], job["device"], job["settings"]
    model = build(impl, s, length).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    ids = torch.randint(1, VOCAB, (s["batch_size"], length), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    losses = []

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=s["dtype"] == "bfloat16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    row = {"impl": impl, "length": length, "parameters": sum(p.numel() for p in model.parameters()),
           "activation_checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in model.modules())}
    seconds, peak = timed_step_with_peak(step, device, job["repeats"])
    row.update(step_s=seconds, tokens_per_s=s["batch_size"] * length / seconds, step_peak_MiB=peak,
               total_peak_MiB=torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else rss_peak_mib(),
               held_MiB=held_mib(device), losses=[loss.item() for loss in losses])
    row["losses_finite"] = all(math.isfinite(loss) for loss in row["losses"])
    row.update(status="ok", fits=True, device=device_name(device, job["threads"]))
    return row


def run_job(job: dict) -> dict:
    """One model's measurement; out of memory, past the time limit or failing recorded as such."""
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(job["timeout"])
    head = {"impl": job["impl"], "length": job["length"]}
    try:
        return measure(job)
    except WorkerTimeout:
        return {**head, "status": "timeout", "fits": None, "error": f"over --worker_timeout {job['timeout']} s"}
    except Exception as error:  # noqa: BLE001  (recorded, and the sweep goes on)
        oom = is_out_of_memory(error)
        return {**head, "status": "oom" if oom else "error", "fits": False if oom else None,
                "error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        signal.alarm(0)
        gc.collect()


# -- the sweep ------------------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (pick the card with CUDA_VISIBLE_DEVICES)")
    p.add_argument("--lengths", type=int, nargs="+", help="tokens per sequence (default 65536)")
    p.add_argument("--models", nargs="+", default=list(MODELS), help=f"any of {', '.join(MODELS)}")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per model")
    p.add_argument("--dtype", default="float32", help="float32, or bfloat16 (autocast, float32 weights)")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--num_hashes", type=int, default=2, help="LSH hash rounds (the family's default)")
    p.add_argument("--num_layers", type=int, help="default 12")
    p.add_argument("--hidden_size", type=int, help="d_model (default 1024)")
    p.add_argument("--intermediate_size", type=int, help="d_ff (default 4096)")
    p.add_argument("--num_heads", type=int, help="default 8")
    p.add_argument("--worker_timeout", type=int, default=170, help="seconds per model before 'timeout'")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the workers (0: torch's default)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run: 2 layers, d_model 64, 1K tokens, "
                                                      "1 timed step")
    p.add_argument("--output", type=Path, help="default: benchmarks/results/paper_size_reformer_<device>.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    for name, value in (TINY if args.tiny else PAPER).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny and "--repeats" not in argv:
        args.repeats = 1
    validate(args)
    args.output = args.output or RESULTS / f"paper_size_reformer_{args.device}.json"
    return args


def validate(args) -> None:
    """ValueError naming the flag and the fix."""
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: use cpu or cuda (choose the card with CUDA_VISIBLE_DEVICES).")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here; use --device cpu.")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise ValueError(f"--models {' '.join(unknown)}: choose from {', '.join(MODELS)}.")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype}: use one of {', '.join(DTYPES)}.")
    for flag in ("repeats", "batch_size", "num_hashes", "num_layers", "hidden_size", "intermediate_size",
                 "num_heads", "worker_timeout"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} {getattr(args, flag)}: must be a positive integer.")
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads}: must be 0 (torch's default) or more.")
    if args.hidden_size % args.num_heads or args.hidden_size % 4:
        raise ValueError(f"--hidden_size {args.hidden_size}: must be a multiple of 4 (the axial embedding's "
                         f"quarter) and of --num_heads {args.num_heads}.")
    for length in args.lengths:
        if length < 2 * CHUNK or length % CHUNK or (length > FFN_CHUNK and length % FFN_CHUNK):
            raise ValueError(f"--lengths {length}: each must be a multiple of {CHUNK} (the attention chunk) of at "
                             f"least {2 * CHUNK}, and above {FFN_CHUNK} a multiple of {FFN_CHUNK} (transformers' "
                             "Reformer needs the feed-forward chunk to divide the length), e.g. 65536.")


def summarise(rows: list[dict]) -> list[dict]:
    ok = {(r["impl"], r["length"]): r for r in rows if r.get("status") == "ok"}
    summary = []
    for length in sorted({r["length"] for r in rows}):
        ours = ok.get(("attnzoo", length))
        entry = {"length": length, "fits": {r["impl"]: r.get("fits") for r in rows if r["length"] == length}}
        for peer in ("transformers", "softmax"):
            theirs = ok.get((peer, length))
            both = ours is not None and theirs is not None
            entry[f"attnzoo_speedup_vs_{peer}"] = theirs["step_s"] / ours["step_s"] if both else None
            entry[f"attnzoo_step_memory_vs_{peer}"] = (ours["step_peak_MiB"] / theirs["step_peak_MiB"]
                                                       if both and theirs["step_peak_MiB"] > 0 else None)
            entry[f"attnzoo_total_memory_vs_{peer}"] = (ours["total_peak_MiB"] / theirs["total_peak_MiB"]
                                                        if both and theirs["total_peak_MiB"] > 0 else None)
        summary.append(entry)
    return summary


def check_report(report: dict) -> None:
    """What makes a results file this benchmark's report (decoding_speed.py's have the same top-level keys)."""
    require_keys("environment", "settings", "models", "rows", benchmark="paper_size_reformer")(report)
    if not isinstance(report["settings"], dict) or "num_hashes" not in report["settings"]:
        raise ValueError("its 'settings' have no 'num_hashes' (a paper-size Reformer run's have)")


def device_name(device: str, threads: int) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine()}, {threads or torch.get_num_threads()} of {os.cpu_count()} threads)"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_job(json.loads(args.worker))))
        return None

    import transformers

    settings = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                "intermediate_size": args.intermediate_size, "num_heads": args.num_heads,
                "head_size": args.hidden_size // args.num_heads, "num_hashes": args.num_hashes,
                "chunk_length": CHUNK, "feed_forward_chunk": FFN_CHUNK, "vocab_size": VOCAB,
                "batch_size": args.batch_size, "dtype": args.dtype, "repeats": args.repeats,
                "optimizer": f"torch.optim.AdamW(lr={LEARNING_RATE})",
                "axial_pos_embds_dim": axial_dims(args.hidden_size),
                "axial_pos_shape": {length: list(axial_shape(length)) for length in args.lengths}}
    device = cuda_device_name() if args.device == "cuda" else device_name(args.device, args.threads)
    setup = {"device": device, "settings": settings, "lengths": args.lengths, "models": args.models}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    output = report_target(args.output, setup, check_report, f"{SCRIPT}.py", flag="--output")
    report = {
        "benchmark": "paper_size_reformer",
        "setup": setup,
        "environment": {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(),
                        "command": shlex.join(["python", "benchmarks/paper_size_reformer.py", *argv]),
                        "workers": "one per model and length"},
        "settings": settings,
        "models": {"attnzoo": "ZooReformerForCausalLM: reversible, local/LSH layers, axial positions, chunked "
                              "feed-forward",
                   "transformers": "transformers ReformerModelWithLMHead with the same settings",
                   "softmax": "ZooSoftmaxForCausalLM (SDPA, causal) with activation checkpointing on every block"},
        "rows": [],
    }
    for length in args.lengths:
        for impl in args.models:
            job = {"impl": impl, "length": length, "device": args.device, "settings": settings,
                   "repeats": args.repeats, "timeout": args.worker_timeout, "threads": args.threads}
            row = run_worker(__file__, [json.dumps(job)])
            if row is None:  # harness.run_worker printed the worker's stderr
                row = {"impl": impl, "length": length, "status": "failed", "fits": None,
                       "error": "the worker exited without a result (crashed, or killed, e.g. by the out-of-memory "
                                "killer)"}
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
            write_report(report, output, with_plot=False)  # after every model: a stopped run keeps its rows
    write_report(report, output, with_plot=True)
    for entry in report["summary"]:
        print(json.dumps(entry))
    print(f"wrote {output} and {output.with_suffix('.png')}")
    return report


def write_report(report: dict, output: Path, with_plot: bool) -> None:
    report["summary"] = summarise(report["rows"])
    write_whole(output, report, indent=2)
    if with_plot:
        plot(report, output.with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    lengths = sorted({r["length"] for r in rows})
    models = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.5))
    width = 0.8 / max(len(models), 1)
    for index, impl in enumerate(models):
        for length_index, length in enumerate(lengths):
            row = next((r for r in rows if r["impl"] == impl and r["length"] == length), None)
            x = length_index + (index - (len(models) - 1) / 2) * width
            label = impl if length_index == 0 else None
            if row is None or row.get("status") != "ok":
                for ax in axes:
                    ax.bar(x, 0, width, color=f"C{index}", label=label)
                    ax.annotate(row["status"] if row else "not run", (x, 0), ha="center", va="bottom",
                                rotation=90, fontsize=8)
                continue
            axes[0].bar(x, row["step_s"], width, color=f"C{index}", label=label)
            axes[1].bar(x, row["tokens_per_s"], width, color=f"C{index}", label=label)
            axes[2].bar(x, row["step_peak_MiB"], width, color=f"C{index}", label=label)
            axes[3].bar(x, row["total_peak_MiB"], width, color=f"C{index}", label=label)
    titles = ("time per training step (s)", "tokens per second", "peak memory of a step above what is held (MiB)",
              "peak memory of the whole process (MiB)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(range(len(lengths)), [f"{length:,} tokens" for length in lengths])
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    s = report["settings"]
    fig.suptitle(f"Reformer paper-size step ({s['num_layers']} layers, d_model {s['hidden_size']}, d_ff "
                 f"{s['intermediate_size']}, {s['num_heads']} heads, batch {s['batch_size']}, {s['dtype']}) on "
                 f"{report['environment']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
