"""Table 2 of "Reformer: The Efficient Transformer" (arXiv 2001.04451, §2.1) at CPU scale: the duplication task,
trained with full and LSH attention, evaluated with both.

    python benchmarks/reformer_duplication.py --recipe benchmarks/recipes/reformer_duplication.yaml

Each example is 0 w 0 w with w drawn uniformly from the symbols 1..N (N = 127, as in the paper); a causal LM
predicts every next symbol, and loss and accuracy count only the second copy of w (the positions that can be
predicted). The model is the paper's: one layer, d_model = d_ff = 256, 4 heads, shared-QK attention. One model is
trained per setting (full attention, LSH with 1, 2, 4 rounds); every trained model is then evaluated with full
attention and with 8, 4, 2 and 1 hash rounds (`lsh_num_hashes_eval`). "Full attention" is the LSH layer's exact
path (`lsh_full_attention_threshold` >= the length): shared-QK softmax over every earlier position, as LSH
attention needs shared QK to be swapped in at evaluation.

Scale (recipe): |w| = 127 (length 256 instead of 1024) with chunks of 16, so a sequence holds 16 chunks and 32
buckets, as the paper's 1024 tokens with chunks of 64 do; a few thousand steps instead of 150K. Settings train in
parallel worker processes (`--jobs`), one thread each. Results: benchmarks/results/reformer_duplication.{json,png}
(`--output`), replaced only by a report of the same setup (another setup's goes beside it; a file that is not this
benchmark's report is refused: benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import report_check, run_worker, setup_or_legacy  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, write_report  # noqa: E402

from attnzoo.training.recipes import parse_with_recipe  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/reformer_duplication"
EXPERIMENT = "Reformer (arXiv 2001.04451) Table 2 (duplication task)"
#: what makes a results file this benchmark's report (the committed one, from before reports were marked, too)
REPORT_CHECK = report_check("config", "results", "eval_settings", benchmark="reformer_duplication",
                            experiment=EXPERIMENT)
#: the setup of a report from before reports stored theirs: its config (every argument but the paths and --jobs)
LEGACY_SETUP = setup_or_legacy(lambda r: r["config"])
PAPER_TABLE_2 = {  # Reformer (arXiv 2001.04451), Table 2: train setting -> {eval setting: accuracy %}
    "full": {"full": 100.0, "lsh8": 94.8, "lsh4": 92.5, "lsh2": 76.9, "lsh1": 52.5},
    "lsh4": {"full": 0.8, "lsh8": 100.0, "lsh4": 99.9, "lsh2": 99.4, "lsh1": 91.9},
    "lsh2": {"full": 0.8, "lsh8": 100.0, "lsh4": 99.9, "lsh2": 98.1, "lsh1": 86.8},
    "lsh1": {"full": 0.8, "lsh8": 99.9, "lsh4": 99.6, "lsh2": 94.8, "lsh1": 77.9},
}


def duplication_batch(batch: int, word_length: int, num_symbols: int, generator: torch.Generator):
    """input_ids [batch, 2 * word_length + 2] = 0 w 0 w, labels = input_ids with all but the second w masked."""
    word = torch.randint(1, num_symbols + 1, (batch, word_length), generator=generator)
    zero = torch.zeros(batch, 1, dtype=torch.long)
    input_ids = torch.cat([zero, word, zero, word], dim=1)
    labels = input_ids.clone()
    labels[:, : word_length + 2] = -100  # the model is scored on the second copy of w only
    return input_ids, labels


def rounds_of(setting: str) -> int | None:
    """'full' -> None, 'lsh4' -> 4."""
    if setting == "full":
        return None
    if not setting.startswith("lsh") or not setting[3:].isdigit():
        raise ValueError(f"setting {setting!r} must be 'full' or 'lshN' (N hash rounds), e.g. lsh4")
    return int(setting[3:])


def model_config(args, setting: str):
    from attnzoo import ZooReformerConfig

    length = 2 * args.word_length + 2
    rounds = rounds_of(setting)
    return ZooReformerConfig(
        vocab_size=args.num_symbols + 1, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_heads, num_hidden_layers=1, attn_layers=["lsh"], reversible=False,
        chunk_size_feed_forward=0, position_embedding_type="learned", max_position_embeddings=length,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, lsh_chunk_length=args.chunk_length,
        lsh_num_chunks_after=0, lsh_num_hashes=rounds or 1,
        lsh_full_attention_threshold=length if rounds is None else None,
    )


@torch.no_grad()
def evaluate(model, args, setting: str) -> dict:
    """Loss (nats) and accuracy on the second copy of w, over a fixed evaluation set, with `setting` attention."""
    from transformers import AutoModelForCausalLM

    # Same weights, other attention: the evaluation rounds (or the exact path) come from the config.
    evaluator = AutoModelForCausalLM.from_config(model_config(args, setting)).eval()
    evaluator.load_state_dict(model.state_dict())
    data = torch.Generator().manual_seed(args.seed + 1_000_003)  # the same examples for every model
    torch.manual_seed(args.seed + 7)  # the evaluation hashes
    loss_sum, correct, count = 0.0, 0, 0
    for _ in range(args.eval_batches):
        input_ids, labels = duplication_batch(args.batch_size, args.word_length, args.num_symbols, data)
        logits = evaluator(input_ids).logits[:, :-1]
        target = labels[:, 1:]
        scored = target != -100
        loss_sum += torch.nn.functional.cross_entropy(logits[scored], target[scored], reduction="sum").item()
        correct += (logits.argmax(-1)[scored] == target[scored]).sum().item()
        count += scored.sum().item()
    return {"loss": loss_sum / count, "accuracy": 100.0 * correct / count}


def train_worker(args, setting: str) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config(args, setting))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    warmup = max(1, args.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    data = torch.Generator().manual_seed(args.seed)
    curve, start = [], time.perf_counter()
    for step in range(1, args.train_steps + 1):
        input_ids, labels = duplication_batch(args.batch_size, args.word_length, args.num_symbols, data)
        loss = model(input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_steps == 0 or step == args.train_steps:
            model.eval()
            point = {"step": step, "train_loss": loss.item(), "seconds": time.perf_counter() - start,
                     **{f"eval_{setting}_{k}": v for k, v in evaluate(model, args, setting).items()}}
            model.train()
            curve.append(point)
            print(json.dumps(point), file=sys.stderr, flush=True)
    model.eval()
    evaluations = {name: evaluate(model, args, name) for name in args.eval_settings}
    return {"train": setting, "train_seconds": time.perf_counter() - start, "curve": curve, "eval": evaluations}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trains, evals = report["train_settings"], report["eval_settings"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (title, table) in zip(axes[:2], [("this run (accuracy %)", {t: report["results"][t]["eval"] for t in
                                                                          trains}),
                                               ("Reformer paper, Table 2 (accuracy %)", PAPER_TABLE_2)], strict=True):
        cells = [[table.get(t, {}).get(e, {"accuracy": math.nan}) for e in evals] for t in trains]
        values = [[c["accuracy"] if isinstance(c, dict) else c for c in row] for row in cells]
        ax.imshow(values, vmin=0, vmax=100, cmap="viridis")
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", color="white" if v < 60 else "black")
        ax.set_xticks(range(len(evals)), [f"eval {e}" for e in evals])
        ax.set_yticks(range(len(trains)), [f"train {t}" for t in trains])
        ax.set_title(title)
    for setting in trains:
        curve = report["results"][setting]["curve"]
        axes[2].plot([p["step"] for p in curve], [p[f"eval_{setting}_accuracy"] for p in curve], label=setting)
    axes[2].set_xlabel("training step")
    axes[2].set_ylabel("accuracy on the second w (%), own setting")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.suptitle(f"Duplication task, |w| = {report['config']['word_length']}, N = {report['config']['num_symbols']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--word_length", type=int, default=127, help="|w|; the sequence is 2|w| + 2 tokens")
    p.add_argument("--num_symbols", type=int, default=127, help="N: w is drawn from 1..N")
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--intermediate_size", type=int, default=256)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--chunk_length", type=int, default=16)
    p.add_argument("--train_settings", nargs="+", default=["full", "lsh4", "lsh2", "lsh1"])
    p.add_argument("--eval_settings", nargs="+", default=["full", "lsh8", "lsh4", "lsh2", "lsh1"])
    p.add_argument("--train_steps", type=int, default=3000)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=200)
    p.add_argument("--eval_batches", type=int, default=16)
    p.add_argument("--log_steps", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="settings trained at once (one process, one thread each)")
    p.add_argument("--output", type=Path, default=RESULTS / "reformer_duplication.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parse_with_recipe(p, argv)
    for setting in [*args.train_settings, *args.eval_settings]:
        rounds_of(setting)
    if args.worker is not None:
        print(json.dumps(train_worker(args, args.worker)))
        return
    config = {k: v for k, v in vars(args).items() if k not in {"worker", "output", "recipe", "jobs"}}
    # decided before training: a file that is not this benchmark's report is refused with nothing run
    output = report_target(args.output, config, REPORT_CHECK, f"{SCRIPT}.py", flag="--output", setup_of=LEGACY_SETUP)
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(lambda s: run_worker(__file__, [s, *forwarded]), args.train_settings))
    failed = [s for s, r in zip(args.train_settings, done, strict=True) if r is None]
    if failed:
        raise SystemExit(f"training failed for {failed} (see the worker errors above)")
    report = {"benchmark": "reformer_duplication", "experiment": EXPERIMENT, "setup": config, "config": config,
              "train_settings": args.train_settings, "eval_settings": args.eval_settings,
              "results": {r["train"]: r for r in done}, "paper_table_2": PAPER_TABLE_2}
    write_report(output, report)
    plot(report, output.with_suffix(".png"))
    header = "train \\ eval".ljust(14) + "".join(e.rjust(16) for e in args.eval_settings)
    print(header)
    for t in args.train_settings:
        row = report["results"][t]["eval"]
        paper = PAPER_TABLE_2.get(t, {})
        print(t.ljust(14) + "".join(f"{row[e]['accuracy']:7.1f} ({paper.get(e, math.nan):5.1f})".rjust(16)
                                    for e in args.eval_settings))
    print("(this run's accuracy %, the Reformer paper's in brackets)")
    print(f"wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
