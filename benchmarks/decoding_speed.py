"""Per-token latency and memory of cached greedy decoding after a context of N tokens, for every decoder family of
the zoo, against exact softmax attention decoding from a preallocated cache.

    python benchmarks/decoding_speed.py --tiny                      # seconds-long smoke run (CPU; what the test runs)
    python benchmarks/decoding_speed.py --device cpu --contexts 1024 4096 --batch_sizes 1
    python benchmarks/decoding_speed.py --device cuda               # the whole sweep (see below for its time)
    python benchmarks/decoding_speed.py --device cuda --batch_sizes 1           # the same sweep in two commands,
    python benchmarks/decoding_speed.py --device cuda --batch_sizes 8 --merge   # merged into one JSON and plot

Models: the shared backbone at the same sizes for every family (`--hidden_size` 256, `--num_layers` 4,
`--num_heads` 4 of 64, feed-forward 4 x hidden, vocabulary 256, dropout 0, `--dtype` float32), each family with
its config's own defaults otherwise: softmax (SDPA), reformer (local + LSH layers, 2 hash rounds, chunks of 64,
reversible, axial positions), performer (FAVOR+, 256 features), ra, lara (causal LARA), window (64 + 4 sinks),
and, in a hybrid config, every layer one windowed kind: `favor_window`, `lara_window`, `ra_window` or `lsh_window`
(`--families`; `hybrid`, the hybrid family's own FAVOR+/softmax stack, can be added). Each model's
`max_position_embeddings` is the context plus the decoded tokens (so the Reformer's LSH bucket count is the paper's
2 x length / chunk at each context).

Baselines, measured in the same run at every (batch, context):
- `softmax_static`: attnzoo's softmax model decoding from transformers' `StaticCache`, preallocated to context +
  decoded tokens, when that model decodes correctly from one. The script checks this first, on a tiny model
  (`static_cache_probe`): attnzoo's softmax attention reads every slot the static cache returns, the unwritten
  ones included, so its logits are wrong, and the baseline falls back to the softmax family with attnzoo's own
  cache (a `DynamicLayer` per layer); the JSON's `baseline` says which, and why.
- `gpt2_static`: the same backbone in transformers (`GPT2LMHeadModel`: pre-LayerNorm blocks, learned positions,
  tied head, SDPA; `attnzoo.convert.gpt2` maps it onto attnzoo's softmax model with equal logits) decoding from a
  `StaticCache` preallocated to context + decoded tokens, passed to `forward` as transformers' docs show
  (`--skip_transformers_static` leaves it out). Every decoding step attends over the whole preallocated cache
  under a mask, so its cost follows context + decoded tokens.

Measures, per (implementation, batch, context), in a fresh worker process (`benchmarks/harness.py` `run_worker`;
`--one_worker` runs all of them in one, which `--tiny` sets because its figures measure nothing):
- `prefill_s`: one forward of the context with the cache on, logits of the last position only
  (`logits_to_keep=1`), after a 64-token forward without a cache that warms the libraries up;
- `ms_per_token`: median over `--new_tokens` greedy steps (one token per row, the cache passed to `forward`, the
  argmax of the step's logits fed back) after `--warmup_tokens` untimed steps, each step between device syncs;
- `state_bytes`: the bytes of every tensor the cache holds after the prefill (exact, on any device): the decoding
  state itself, beside the allocator's figures;
- memory above the weights and inputs: CUDA: `prefill_peak_MiB` (`max_memory_allocated` during the prefill),
  `cache_MiB` (allocated after it, i.e. the cache), `decode_peak_MiB` (`max_memory_allocated` during the decoding
  steps: the cache plus one step's working memory). CPU: resident-set growth (`harness.rss_peak_mib` for the
  prefill's peak, /proc/self/statm for what is held), which the allocator's retained memory blurs;
- `matches_full_forward`: for contexts up to `--verify_max_context`, the first `--check_steps` + 1 decoded tokens
  (prefill's and the cached steps') against the greedy argmax of one full forward over context + decoded tokens
  without a cache, with the largest logit difference, so the timed path is the real cached one (in bfloat16 a
  near tie may differ without anything being wrong).
Out of memory is recorded as `"status": "oom"`, a configuration over `--worker_timeout` seconds as "timeout", and
the sweep goes on.

Ratios (`summary`): each family's per-token time as a speed-up over the baseline's at the same (batch, context)
(baseline ms / family ms: above 1 is faster) and over `gpt2_static`'s, its decoding memory over the baseline's
(only where both are at least 1 MiB: below that the figures are allocator noise), and "flat in context": its
per-token time at the longest context it ran over its time at the shortest (64K over 1K by default).
`--compiled_static`: graph-captured decoding. Every implementation decodes from a static cache (attnzoo's
families from `model.new_decoding_cache(max_cache_len=context + steps)`, fixed shapes and addresses; the
window-with-sinks attentions have none and are recorded as `no_static_cache`) with its decode step compiled by
`torch.compile(fullgraph=True, dynamic=False)`, `mode="reduce-overhead"` (CUDA graphs) on a GPU; the warm-up steps
compile (`warmup_s`), the timed ones replay. Results go to decoding_speed_<device>_compiled.json.
Results: benchmarks/results/decoding_speed_<device>.json and .png (`--output` elsewhere), replaced only by a report
of the same setup (another setup's goes beside it; a file that is not this benchmark's report is refused:
benchmarks/owned_outputs.py). The JSON is rewritten after every worker, so a run stopped part-way keeps its rows;
`--merge` adds a run's rows to those of an earlier report of this benchmark in `--output` (re-run configurations
replaced), refusing one with other settings or on another device. `--docs_only` writes docs/benchmarks.md's table
from the committed report (decoding_speed_<device>.json) only.

Time on one H100/H200 (estimated, not yet measured): a worker takes about 5-10 s (start-up, a prefill of up to
8 x 64K tokens, 36 steps), so the default sweep (9 implementations x 2 batch sizes x 4 contexts = 72 workers)
needs about 6-10 minutes; split it by batch size with `--merge` to stay within 10 minutes a command. RA
materialises quadratic scores and runs out of memory from 16K-64K tokens, which costs seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402
    cache_state_bytes,
    cuda_device_name,
    device_problem,
    rss_peak_mib,
    run_worker,
    setup_or_legacy,
    step_seconds,
    sync,
)
from owned_outputs import exit_on_refusal, publishes_tables, read_report, report_target, require_keys  # noqa: E402
from owned_outputs import write_report as write_whole  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/decoding_speed"
#: what makes a results file this benchmark's report (the committed ones, from before reports were marked, too)
REPORT_CHECK = require_keys("environment", "settings", "baseline", "models", "rows", benchmark="decoding_speed")

#: decoder family -> (model_type, settings beyond the shared sizes): the zoo's decoder families with their own
#: defaults, and the windowed attentions in a hybrid config
FAMILIES = {
    "softmax": ("attnzoo_softmax", {}),
    "reformer": ("attnzoo_reformer", {}),
    "performer": ("attnzoo_performer", {}),
    "ra": ("attnzoo_ra", {}),
    "lara": ("attnzoo_lara", {}),
    "window": ("attnzoo_window", {}),
    "favor_window": ("attnzoo_hybrid", {"attn_layers": ["favor_window"]}),
    "lara_window": ("attnzoo_hybrid", {"attn_layers": ["lara_window"]}),
    "ra_window": ("attnzoo_hybrid", {"attn_layers": ["ra_window"]}),
    "lsh_window": ("attnzoo_hybrid", {"attn_layers": ["lsh_window"]}),
    "hybrid": ("attnzoo_hybrid", {}),
}
DEFAULT_FAMILIES = [name for name in FAMILIES if name != "hybrid"]
ZOO_STATIC, GPT2_STATIC = "softmax_static", "gpt2_static"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: memory figures below this are allocator noise (CPU resident-set pages, tiny runs): no ratio is taken of them
MEMORY_FLOOR_MIB = 1.0

FULL = dict(contexts=[1024, 4096, 16384, 65536], batch_sizes=[1, 8], new_tokens=32, warmup_tokens=4,
            hidden_size=256, num_layers=4, num_heads=4, intermediate_size=0, vocab_size=256)
#: --tiny: a model and contexts small enough for seconds on a CPU; the attention settings are shrunk with them so
#: that contexts of 64-128 tokens still take the efficient paths (several chunks, hashing, the far part of windows)
TINY = dict(contexts=[64, 128], batch_sizes=[1, 2], new_tokens=3, warmup_tokens=1, hidden_size=32, num_layers=2,
            num_heads=2, intermediate_size=0, vocab_size=256)
TINY_ATTENTION = dict(lsh_chunk_length=16, local_chunk_length=16, num_random_features=16,
                      linear_attention_chunk_size=16, lara_num_samples=4, lara_chunk_size=16, window_size=16)


# -- models ---------------------------------------------------------------------------------------------------------
def zoo_config(family: str, settings: dict, max_positions: int):
    """The family's config at the shared sizes; `settings["attention"]` entries apply where the config has them."""
    from transformers import AutoConfig

    import attnzoo  # noqa: F401  (registers the families)
    from attnzoo.registration import FAMILY_CONFIGS

    model_type, own = FAMILIES[family]
    fields = FAMILY_CONFIGS[model_type.removeprefix("attnzoo_")].__dataclass_fields__
    attention = {k: v for k, v in settings["attention"].items() if k in fields}
    return AutoConfig.for_model(
        model_type, vocab_size=settings["vocab_size"], hidden_size=settings["hidden_size"],
        num_hidden_layers=settings["num_layers"], num_attention_heads=settings["num_heads"],
        intermediate_size=settings["intermediate_size"], max_position_embeddings=max_positions,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_decoder=True, pad_token_id=None,
        eos_token_id=None, **attention, **own)


def gpt2_model(settings: dict, max_positions: int):
    """transformers' GPT-2 with the zoo's softmax backbone: same sizes, GELU, biases, learned positions, tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=settings["vocab_size"], n_embd=settings["hidden_size"],
                        n_layer=settings["num_layers"], n_head=settings["num_heads"],
                        n_inner=settings["intermediate_size"], n_positions=max_positions,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def build(impl: str, settings: dict, max_positions: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if impl == GPT2_STATIC:
        return gpt2_model(settings, max_positions)
    family = "softmax" if impl == ZOO_STATIC else impl
    return AutoModelForCausalLM.from_config(zoo_config(family, settings, max_positions))


def uses_static_cache(impl: str) -> bool:
    return impl in (ZOO_STATIC, GPT2_STATIC)


def static_cache_probe(settings: dict) -> tuple[bool, str]:
    """Whether attnzoo's softmax model decodes from transformers' StaticCache exactly as its full forward computes
    (a tiny model: prefill 12 tokens into a cache of 16, then 2 steps), and a sentence saying what was found."""
    from transformers import StaticCache

    from attnzoo.transformers_compat import CACHE_KW, output_cache

    tiny = dict(settings, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = build(ZOO_STATIC, tiny, 16).eval()
    ids = torch.randint(0, settings["vocab_size"], (1, 14), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            full = model(ids, use_cache=False).logits[:, 11:]
            cache = StaticCache(config=model.config, max_cache_len=16)
            out = model(ids[:, :12], use_cache=True, **{CACHE_KW: cache})
            steps = [out.logits[:, -1]]
            for position in (12, 13):
                out = model(ids[:, position:position + 1], use_cache=True, **{CACHE_KW: output_cache(out)})
                steps.append(out.logits[:, -1])
        difference = (torch.stack(steps, 1) - full).abs().max().item()
    except Exception as error:  # noqa: BLE001  (any failure means: not usable, and the note says why)
        return False, (f"attnzoo's softmax model cannot decode from transformers' StaticCache "
                       f"({type(error).__name__}: {error}); the baseline uses its own cache (a DynamicLayer per "
                       "layer, grown as tokens arrive)")
    if difference <= 1e-4:
        return True, f"attnzoo's softmax model decodes from StaticCache (max |logit difference| {difference:.2g})"
    return False, ("attnzoo's softmax model accepts transformers' StaticCache but decodes wrongly with it (max |logit "
                   f"difference| {difference:.3g} against its full forward): its attention reads every preallocated "
                   "slot the cache returns, the unwritten ones included. The baseline therefore uses attnzoo's own "
                   "cache (a DynamicLayer per layer, grown as tokens arrive); gpt2_static is the same backbone "
                   "decoding from a StaticCache")


# -- the worker -----------------------------------------------------------------------------------------------------
class WorkerTimeout(Exception):
    """A configuration ran past --worker_timeout."""


def _on_alarm(signum, frame):
    raise WorkerTimeout


def held_mib(device: str) -> float:
    """Memory held now: CUDA's allocated bytes, or the CPU process's resident set."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(device) / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def measure(job: dict) -> dict:
    """Prefill, decode and (optionally) verify one (implementation, batch, context) configuration."""
    from transformers import StaticCache

    from attnzoo.transformers_compat import CACHE_KW, output_cache

    impl, batch, context, device = job["impl"], job["batch"], job["context"], job["device"]
    settings, steps = job["settings"], job["warmup_tokens"] + job["new_tokens"]
    capacity = context + steps
    model = build(impl, settings, capacity).to(device=device, dtype=DTYPES[settings["dtype"]]).eval()
    ids = torch.randint(0, settings["vocab_size"], (batch, context), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    cuda = device.startswith("cuda")
    row = {"impl": impl, "batch": batch, "context": context,
           "parameters": sum(p.numel() for p in model.parameters())}
    with torch.no_grad():  # a short forward first: library handles and kernel choices are not the prefill's time
        model(ids[:, :64], use_cache=False, logits_to_keep=1)
    gc.collect()
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = held_mib(device)
    kept = job["check_steps"] + 1  # tokens compared with the full forward: the prefill's and check_steps steps'
    tokens, logits = [], []
    compiled = settings.get("compiled")
    with torch.no_grad():
        if uses_static_cache(impl):
            cache = StaticCache(config=model.config, max_cache_len=capacity)
        elif compiled:
            try:
                cache = model.new_decoding_cache(max_cache_len=capacity)
            except ValueError as error:  # an attention without a static slot (the window-with-sinks ones)
                return {**row, "status": "no_static_cache", "error": str(error)}
        else:
            cache = None
        passed = {CACHE_KW: cache} if cache is not None else {}
        sync(device)
        start = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1, **passed)
        sync(device)
        row["prefill_s"] = time.perf_counter() - start
        cache = output_cache(out)
        tokens.append(out.logits[:, -1].argmax(-1))
        logits.append(out.logits[:, -1].float())
        del out
        gc.collect()
        sync(device)
        if cuda:
            row["prefill_peak_MiB"] = torch.cuda.max_memory_allocated(device) / 2**20 - base
            torch.cuda.reset_peak_memory_stats(device)
        else:
            # the process's peak so far over what it held before (ru_maxrss and statm count pages differently)
            row["prefill_peak_MiB"] = max(0.0, rss_peak_mib() - base)
        row["cache_MiB"] = held_mib(device) - base
        row["state_bytes"] = cache_state_bytes(cache)  # exact: every tensor the cache holds, whatever the device
        row["cache_class"] = f"{type(cache).__name__}[{type(cache.layers[0]).__name__}]"

        def forward_step(token, cache):
            return model(token, use_cache=True, **{CACHE_KW: cache}).logits[:, -1]

        if compiled:  # one graph for every step: the cache has fixed shapes and no mask is passed
            forward_step = torch.compile(forward_step, fullgraph=True, dynamic=False, backend=compiled,
                                         mode="reduce-overhead" if cuda and compiled == "inductor" else None)

        def step():
            # a copy: a CUDA graph's outputs are overwritten by its next replay
            last = forward_step(tokens[-1][:, None], cache).float().clone()
            tokens.append(last.argmax(-1))
            if len(logits) < kept:
                logits.append(last)

        sync(device)
        start = time.perf_counter()
        for _ in range(job["warmup_tokens"]):
            step()
        sync(device)
        row["warmup_s"] = time.perf_counter() - start  # with --compiled_static: the compilation's time
        times = step_seconds(step, device, job["new_tokens"])
        row["ms_per_token"] = 1000 * statistics.median(times)
        row["ms_per_token_all"] = [1000 * t for t in times]
        row["decode_peak_MiB"] = (torch.cuda.max_memory_allocated(device) / 2**20 - base if cuda
                                  else held_mib(device) - base)
        decoded = torch.stack(tokens, 1)
        row["decoded_tokens"] = decoded[:, :kept].tolist()
        if job["verify"]:
            del cache
            gc.collect()
            full = model(torch.cat([ids, decoded[:, :kept - 1]], 1), use_cache=False, logits_to_keep=kept).logits
            row["full_forward_tokens"] = full.argmax(-1).tolist()
            row["matches_full_forward"] = row["full_forward_tokens"] == row["decoded_tokens"]
            row["max_abs_logit_difference"] = (full.float() - torch.stack(logits, 1)).abs().max().item()
    row["status"] = "ok"
    row["device"] = device_name(device, job["threads"])
    return row


def run_jobs(jobs: list[dict]) -> list[dict]:
    """Each job in turn, out of memory, past its time limit or failing recorded as such, the others still run."""
    signal.signal(signal.SIGALRM, _on_alarm)
    rows = []
    for job in jobs:
        if job["threads"]:
            torch.set_num_threads(job["threads"])
        head = {"impl": job["impl"], "batch": job["batch"], "context": job["context"]}
        signal.alarm(job["timeout"])
        try:
            rows.append(measure(job))
        except WorkerTimeout:
            rows.append({**head, "status": "timeout", "error": f"over --worker_timeout {job['timeout']} s"})
        except Exception as error:  # noqa: BLE001  (recorded, and the sweep goes on)
            status = "oom" if is_out_of_memory(error) else "error"
            rows.append({**head, "status": status, "error": f"{type(error).__name__}: {str(error)[:300]}"})
        finally:
            signal.alarm(0)
        gc.collect()
        if job["device"].startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


# -- the sweep ------------------------------------------------------------------------------------------------------
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
TABLE_START, TABLE_END = "<!-- decoding table: start -->", "<!-- decoding table: end -->"


def _tokens(count: int) -> str:
    return f"{count // 1024}K" if count % 1024 == 0 else str(count)


def decoding_table(report: dict) -> str:
    """docs/benchmarks.md's decoding table, from a results file: per implementation, the time per token at each
    (batch, context) and the decoding state's bytes at batch 1, each run's status where it did not finish."""
    rows = {(r["impl"], r["batch"], r["context"]): r for r in report["rows"]}
    impls = list(dict.fromkeys(r["impl"] for r in report["rows"]))
    batches = sorted({r["batch"] for r in report["rows"]})
    contexts = sorted({r["context"] for r in report["rows"]})

    def cell(key, value):
        row = rows.get(key)
        if row is None:
            return "not run"
        return value(row) if row.get("status") == "ok" else row.get("status", "failed")

    head = ["implementation"] + [f"ms/token, batch {b}, {_tokens(c)}" for b in batches for c in contexts] + \
        [f"state MiB, batch {batches[0]}, {_tokens(c)}" for c in contexts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for impl in impls:
        cells = [f"`{impl}`"]
        cells += [cell((impl, b, c), lambda r: f"{r['ms_per_token']:.2f}") for b in batches for c in contexts]
        cells += [cell((impl, batches[0], c), lambda r: f"{r['state_bytes'] / 2**20:.1f}") for c in contexts]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--families", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_FAMILIES)}; "
                                                              f"choices: {' '.join(FAMILIES)}")
    p.add_argument("--contexts", type=int, nargs="+", help=f"context tokens (default {FULL['contexts']})")
    p.add_argument("--batch_sizes", type=int, nargs="+", help=f"default {FULL['batch_sizes']}")
    p.add_argument("--new_tokens", type=int, help=f"timed decoding steps (default {FULL['new_tokens']})")
    p.add_argument("--warmup_tokens", type=int, help=f"untimed steps first (default {FULL['warmup_tokens']})")
    p.add_argument("--hidden_size", type=int, help=f"default {FULL['hidden_size']}")
    p.add_argument("--num_layers", type=int, help=f"default {FULL['num_layers']}")
    p.add_argument("--num_heads", type=int, help=f"default {FULL['num_heads']}")
    p.add_argument("--intermediate_size", type=int, help="feed-forward width (default 0: 4 x hidden)")
    p.add_argument("--vocab_size", type=int, help=f"default {FULL['vocab_size']}")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (weights and activations)")
    p.add_argument("--verify_max_context", type=int, default=4096,
                   help="compare decoded tokens with a full forward up to this context (0: never)")
    p.add_argument("--check_steps", type=int, default=2, help="cached steps compared with the full forward")
    p.add_argument("--worker_timeout", type=int, default=180, help="seconds per configuration before 'timeout'")
    p.add_argument("--skip_transformers_static", action="store_true", help="leave out gpt2_static")
    p.add_argument("--compiled_static", action="store_true",
                   help="every implementation decodes from a static cache (attnzoo's families from "
                        "model.new_decoding_cache(max_cache_len=...)) with its decode step compiled "
                        "(fullgraph, static shapes; mode='reduce-overhead', i.e. CUDA graphs, on a GPU)")
    p.add_argument("--compile_backend", default="inductor",
                   help="with --compiled_static: torch.compile's backend (the smoke test uses 'eager')")
    p.add_argument("--one_worker", action="store_true",
                   help="run every configuration in one worker process (quicker start, memory not isolated)")
    p.add_argument("--merge", action="store_true",
                   help="add to the rows already in --output (same settings and device), replacing re-run ones")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the workers (0: torch's default)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run: tiny model, contexts 64 and 128, "
                                                      "batch 1 and 2, 3 new tokens, one worker")
    p.add_argument("--output", type=Path, help="default: benchmarks/results/decoding_speed_<device>.json")
    p.add_argument("--docs_only", action="store_true",
                   help="write docs/benchmarks.md's decoding table from the results file (--output) and run nothing")
    p.add_argument("--docs", type=Path, default=DOCS, help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.docs_only:
        others = [flag for flag in ("tiny", "merge", "compiled_static", "families", "contexts", "batch_sizes")
                  if getattr(args, flag)]
        if others:
            raise ValueError(f"--docs_only writes docs/benchmarks.md's table from a results file and runs nothing; "
                             f"drop {', '.join('--' + f for f in others)}, or drop --docs_only.")
        args.output = args.output or RESULTS / f"decoding_speed_{args.device.split(':')[0]}.json"
        return args
    defaults = TINY if args.tiny else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny:
        args.one_worker = True
    args.families = args.families or list(DEFAULT_FAMILIES)
    validate(args)
    if not args.intermediate_size:
        args.intermediate_size = 4 * args.hidden_size
    suffix = "_compiled" if args.compiled_static else ""
    args.output = args.output or RESULTS / f"decoding_speed_{args.device.split(':')[0]}{suffix}.json"
    if args.merge and not args.output.exists():
        raise ValueError(f"--merge: {args.output} does not exist yet; run once without --merge first.")
    return args


def validate(args) -> None:
    """ValueError naming the flag and the fix."""
    problem = device_problem(args.device)
    if problem:
        raise ValueError(f"--device {args.device}: {problem}.")
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"--families {' '.join(unknown)}: not a decoder family here; choose from "
                         f"{', '.join(FAMILIES)}.")
    for flag in ("contexts", "batch_sizes"):
        if any(v < 1 for v in getattr(args, flag)):
            raise ValueError(f"--{flag} {getattr(args, flag)}: every value must be a positive integer.")
    for flag in ("new_tokens", "hidden_size", "num_layers", "num_heads", "vocab_size", "worker_timeout"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} {getattr(args, flag)}: must be a positive integer.")
    for flag in ("warmup_tokens", "intermediate_size", "verify_max_context", "check_steps", "threads"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag} {getattr(args, flag)}: must be 0 or more.")
    if args.check_steps + 1 > args.warmup_tokens + args.new_tokens + 1:
        raise ValueError(f"--check_steps {args.check_steps}: at most --warmup_tokens + --new_tokens "
                         f"({args.warmup_tokens + args.new_tokens}) steps are decoded; lower it.")
    if args.hidden_size % args.num_heads:
        raise ValueError(f"--num_heads {args.num_heads}: must divide --hidden_size {args.hidden_size}.")
    if args.compile_backend != "inductor" and not args.compiled_static:
        raise ValueError(f"--compile_backend {args.compile_backend}: it applies to --compiled_static only; add that "
                         "flag or drop this one.")
    if args.compiled_static and args.warmup_tokens < 2:
        raise ValueError(f"--warmup_tokens {args.warmup_tokens}: --compiled_static compiles (and records a CUDA "
                         "graph) in the first steps, which must not be timed; use 2 or more.")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype}: use one of {', '.join(DTYPES)}.")


def settings_of(args) -> dict:
    return {"compiled": args.compile_backend if args.compiled_static else None,
            "hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_heads": args.num_heads,
            "head_dim": args.hidden_size // args.num_heads, "intermediate_size": args.intermediate_size,
            "vocab_size": args.vocab_size, "dtype": args.dtype, "new_tokens": args.new_tokens,
            "warmup_tokens": args.warmup_tokens, "check_steps": args.check_steps,
            "decode_step": f"compiled ({args.compile_backend}), static cache" if args.compiled_static else "eager",
            "attention": dict(TINY_ATTENTION) if args.tiny else {}}


def model_descriptions(impls: list[str], settings: dict) -> dict:
    """What each implementation is: its config's settings that differ from the defaults (at a 1K context)."""
    described = {}
    for impl in impls:
        if impl == GPT2_STATIC:
            config = gpt2_model(settings, 1024).config
            described[impl] = {"class": "transformers GPT2LMHeadModel", "cache": "transformers StaticCache",
                               "attn_implementation": config._attn_implementation}
        else:
            family = "softmax" if impl == ZOO_STATIC else impl
            config = zoo_config(family, settings, 1024).to_diff_dict()
            keep = {k: v for k, v in config.items() if k not in ("auto_map", "transformers_version",
                                                                 "max_position_embeddings")}
            described[impl] = {"config": keep, "cache": "transformers StaticCache" if impl == ZOO_STATIC
                               else "attnzoo ZooCache (each layer's own static slot)" if settings.get("compiled")
                               else "attnzoo ZooCache (each layer's own slot)"}
    return described


def summarise(rows: list[dict], families: list[str], baseline: str) -> dict:
    """Ratios of every family's row against the baseline's (and gpt2_static's) at the same (batch, context), and each
    implementation's longest-context over shortest-context time per token."""
    ok = {(r["impl"], r["batch"], r["context"]): r for r in rows if r.get("status") == "ok"}
    order = {impl: index for index, impl in enumerate(families)}
    ratios = []
    for (impl, batch, context), row in sorted(ok.items(), key=lambda item: (order.get(item[0][0], -1), item[0][1:])):
        if impl not in families:
            continue
        base, gpt2 = ok.get((baseline, batch, context)), ok.get((GPT2_STATIC, batch, context))
        ratios.append({
            "family": impl, "batch": batch, "context": context, "ms_per_token": row["ms_per_token"],
            "speedup_vs_baseline": base["ms_per_token"] / row["ms_per_token"] if base else None,
            "decode_memory_vs_baseline": (row["decode_peak_MiB"] / base["decode_peak_MiB"] if base and min(
                row["decode_peak_MiB"], base["decode_peak_MiB"]) >= MEMORY_FLOOR_MIB else None),
            "speedup_vs_gpt2_static": gpt2["ms_per_token"] / row["ms_per_token"] if gpt2 else None,
        })
    flatness = []
    for impl in sorted({k[0] for k in ok}, key=lambda impl: order.get(impl, -1)):
        for batch in sorted({k[1] for k in ok if k[0] == impl}):
            contexts = sorted(k[2] for k in ok if k[:2] == (impl, batch))
            if len(contexts) > 1:
                short, long = ok[(impl, batch, contexts[0])], ok[(impl, batch, contexts[-1])]
                flatness.append({"impl": impl, "batch": batch, "shortest_context": contexts[0],
                                 "longest_context": contexts[-1],
                                 "longest_over_shortest": long["ms_per_token"] / short["ms_per_token"]})
    return {"vs_baseline": ratios, "flat_in_context": flatness,
            "not_run": [{k: r.get(k) for k in ("impl", "batch", "context", "status", "error")}
                        for r in rows if r.get("status") != "ok"]}


def sweep_setup(device: str, settings: dict, families: list[str], transformers_static: bool, batch_sizes,
                contexts) -> dict:
    """A report's setup: what is measured (the model settings, the implementations, the batch sizes and contexts)
    and where."""
    return {"device": device, "settings": settings, "families": list(families),
            "transformers_static": transformers_static, "batch_sizes": sorted(set(batch_sizes)),
            "contexts": sorted(set(contexts))}


#: the setup of a report from before reports stored theirs: its device and settings, the families of its models,
#: the batch sizes and contexts of its rows
LEGACY_SETUP = setup_or_legacy(lambda r: sweep_setup(
    r["environment"]["device"], r["settings"], [m for m in r["models"] if m not in (ZOO_STATIC, GPT2_STATIC)],
    GPT2_STATIC in r["models"], [row["batch"] for row in r["rows"]], [row["context"] for row in r["rows"]]))


def merged_setup(previous: dict, setup: dict) -> dict:
    """The setup of a merged report: the earlier report's sweep and this run's together."""
    before = LEGACY_SETUP(previous) or setup
    return sweep_setup(setup["device"], setup["settings"], dict.fromkeys([*before["families"], *setup["families"]]),
                       before["transformers_static"] or setup["transformers_static"],
                       [*before["batch_sizes"], *setup["batch_sizes"]], [*before["contexts"], *setup["contexts"]])


def check_mergeable(previous: dict, report: dict, output: Path) -> None:
    """ValueError unless the run in `output` measured the same things on the same device as this one."""
    for key in ("settings", "baseline"):
        if previous.get(key) != report[key]:
            raise ValueError(f"--merge: {output} holds a run with other {key} ({previous.get(key)} against "
                             f"{report[key]}); use another --output or drop --merge.")
    device = report["environment"]["device"]
    if device is not None and previous["environment"]["device"] != device:
        raise ValueError(f"--merge: {output} was measured on {previous['environment']['device']}, this run on "
                         f"{device}; use another --output or drop --merge.")


def merged_rows(previous: list[dict], rows: list[dict]) -> list[dict]:
    """The previous run's rows not re-run now, then this run's."""
    now = {(r["impl"], r["batch"], r["context"]) for r in rows}
    return [r for r in previous if (r["impl"], r["batch"], r["context"]) not in now] + rows


def device_name(device: str, threads: int) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {threads or torch.get_num_threads()} of {os.cpu_count()} threads)"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    if args.worker:
        print(json.dumps({"rows": run_jobs(json.loads(args.worker))}))
        return None
    if args.docs_only:
        from harness import write_between_markers

        report = read_report(args.output, REPORT_CHECK, f"{SCRIPT}.py", flag="--output")
        committed = RESULTS / f"decoding_speed_{args.device.split(':')[0]}.json"
        if publishes_tables(args.output, committed):  # the docs show the committed report, no other
            write_between_markers(args.docs, TABLE_START, TABLE_END, decoding_table(report))
            print(f"wrote the decoding table of {args.output} into {args.docs}")
        else:
            print(f"{args.output} is not the committed report: the decoding table of {args.docs} shows {committed} "
                  "and is left as it is.")
        return report

    import transformers

    settings = settings_of(args)
    device = cuda_device_name(args.device) if args.device.startswith("cuda") else device_name(args.device, args.threads)
    setup = sweep_setup(device, settings, args.families, not args.skip_transformers_static, args.batch_sizes,
                        args.contexts)
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run; --merge adds
    # to --output only when it holds this benchmark's report
    if args.merge:
        output = args.output
        previous = read_report(output, REPORT_CHECK, f"{SCRIPT}.py", flag="--output",
                               fix="It is left as it is and nothing was written: --merge adds only to a report of "
                                   "this benchmark; drop --merge or name another --output")
    else:
        output = report_target(args.output, setup, REPORT_CHECK, f"{SCRIPT}.py", flag="--output",
                               setup_of=LEGACY_SETUP)
        previous = None
    static_ok, static_note = static_cache_probe(settings)
    baseline = ZOO_STATIC if static_ok else "softmax"
    impls = list(args.families)
    if baseline not in impls:
        impls.insert(0, baseline)
    if not args.skip_transformers_static:
        impls.insert(1, GPT2_STATIC)
    print(f"baseline: {baseline}. {static_note}", flush=True)
    report = {
        "benchmark": "decoding_speed",
        "setup": setup if previous is None else merged_setup(previous, setup),
        "environment": {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(),
                        "command": shlex.join(["python", "benchmarks/decoding_speed.py", *argv]),
                        "workers": "one for all configurations" if args.one_worker else "one per configuration"},
        "settings": settings,
        "baseline": {"impl": baseline, "static_cache_usable_by_attnzoo_softmax": static_ok, "note": static_note},
        "models": model_descriptions(impls, settings),
        "rows": [],
    }
    if previous is not None:
        check_mergeable(previous, report, output)
        report["environment"]["commands"] = previous["environment"].get(
            "commands", [previous["environment"]["command"]]) + [report["environment"]["command"]]
        report["models"] = {**previous.get("models", {}), **report["models"]}

    jobs = [{"impl": impl, "batch": batch, "context": context, "device": args.device, "settings": settings,
             "new_tokens": args.new_tokens, "warmup_tokens": args.warmup_tokens, "check_steps": args.check_steps,
             "verify": context <= args.verify_max_context, "timeout": args.worker_timeout, "threads": args.threads}
            for batch in args.batch_sizes for context in args.contexts for impl in impls]
    rows = []
    for group in [jobs] if args.one_worker else [[job] for job in jobs]:
        result = run_worker(__file__, [json.dumps(group)])
        if result is None:  # harness.run_worker printed the worker's stderr
            result = {"rows": [{"impl": j["impl"], "batch": j["batch"], "context": j["context"], "status": "failed",
                                "error": "the worker exited without a result (crashed, or killed, e.g. by the "
                                         "out-of-memory killer)"} for j in group]}
        for row in result["rows"]:
            brief = {k: v for k, v in row.items() if k not in ("ms_per_token_all", "decoded_tokens",
                                                               "full_forward_tokens")}
            print(json.dumps(brief), flush=True)
        rows += result["rows"]
        # the JSON is written after every worker, so a run stopped part-way keeps what it measured (and a --merge
        # run can complete it); the plot once, at the end
        write_report(report, rows, previous, output, with_plot=False)
    write_report(report, rows, previous, output, with_plot=True)
    print_summary(report["summary"])
    print(f"wrote {output} and {output.with_suffix('.png')}")
    return report


def write_report(report: dict, rows: list[dict], previous: dict | None, output: Path, with_plot: bool) -> None:
    report["rows"] = merged_rows(previous["rows"], rows) if previous is not None else list(rows)
    families = [impl for impl in report["models"] if impl not in (GPT2_STATIC, ZOO_STATIC)]
    report["summary"] = summarise(report["rows"], families, report["baseline"]["impl"])
    write_whole(output, report, indent=2)
    if with_plot:
        plot(report, output.with_suffix(".png"))


def print_summary(summary: dict) -> None:
    for r in summary["vs_baseline"]:
        speed = "-" if r["speedup_vs_baseline"] is None else f"{r['speedup_vs_baseline']:.2f}x"
        gpt2 = "-" if r["speedup_vs_gpt2_static"] is None else f"{r['speedup_vs_gpt2_static']:.2f}x"
        memory = "-" if r["decode_memory_vs_baseline"] is None else f"{r['decode_memory_vs_baseline']:.2f}x"
        print(f"{r['family']:>13} batch {r['batch']} context {r['context']:>6}: {r['ms_per_token']:8.3f} ms/token, "
              f"speed-up vs baseline {speed}, vs gpt2_static {gpt2}, decode memory vs baseline {memory}")
    for r in summary["flat_in_context"]:
        print(f"{r['impl']:>13} batch {r['batch']}: ms/token at {r['longest_context']} / at {r['shortest_context']} "
              f"= {r['longest_over_shortest']:.2f}")
    for r in summary["not_run"]:
        print(f"{r['impl']:>13} batch {r['batch']} context {r['context']}: {r['status']} ({r.get('error')})")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r.get("status") == "ok"]
    batches = sorted({r["batch"] for r in rows}) or [1]
    fig, axes = plt.subplots(2, len(batches), figsize=(6.5 * len(batches), 8), squeeze=False)
    baseline = report["baseline"]["impl"]
    colours = [f"C{i}" for i in range(10) if i != 7]  # C7 is the grey of gpt2_static
    for column, batch in enumerate(batches):
        for index, impl in enumerate(report["models"]):
            points = sorted((r["context"], r) for r in rows if r["impl"] == impl and r["batch"] == batch)
            if not points:
                continue
            style = dict(color="black", linestyle="--", linewidth=2.2) if impl == baseline else \
                dict(color="gray", linestyle=":", linewidth=2.2) if impl == GPT2_STATIC else \
                dict(color=colours[index % len(colours)], linestyle="-")
            label = f"{impl} (baseline)" if impl == baseline else impl
            contexts = [c for c, _ in points]
            axes[0][column].plot(contexts, [r["ms_per_token"] for _, r in points], marker="o", label=label, **style)
            axes[1][column].plot(contexts, [max(r["decode_peak_MiB"], 1e-3) for _, r in points], marker="o",
                                 label=label, **style)
        axes[0][column].set_title(f"decoding latency, batch {batch} (ms / token)", fontsize=10)
        axes[1][column].set_title(f"decoding memory above weights, batch {batch} (MiB)", fontsize=10)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"cached greedy decoding ({report['environment']['device']}, {report['settings']['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
