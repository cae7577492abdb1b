#!/usr/bin/env bash
# The GPU runs of the speed and decoding goals (docs/benchmarks.md), in eight stages of under 10 minutes each, in the
# order they matter: first whether the fused kernels and graph-captured decoding are right on a GPU, then how fast.
#
# What they need of the machine:
#   - one CUDA GPU; the paper-size Reformer step (12 x 1024 at 64K tokens) needs 16 GB, the 64K decoding rows more;
#   - Python 3.12 with torch >= 2.11 (CUDA build), transformers >= 5.17, triton 3.6 and einops, and this checkout
#     (it runs from the repository root, with PYTHONPATH set to it, nothing installed);
#   - fla (flash-linear-attention, the causal-Performer baseline), which GPU images rarely have: bring its wheels in
#     .whl/ (`pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#     --platform manylinux_2_17_x86_64 -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0`); without them the fla
#     rows are left out and the rest runs.
# Stages, in the order they matter, with what the first GPU session (2026-11-26, one H200) saw of them:
#   checks    tests/ops (Triton = PyTorch reference, fp32/bf16/fp16, forward and backward) and
#             tests/models/test_cuda.py (reversible RNG replay, LSH/local on CUDA, CUDA-graph decoding = eager); the
#             tests took 54 s under pytest-xdist (-n 3, one file per worker; used when the image has it)
#   speed     kernels (Triton vs PyTorch, SDPA, FlexAttention; 115 s on the third session's H100). In the second
#             session (2026-11-27) the checks took 100 s and fla's rows alone used the kernels step's 270 s (its
#             autotuning on a cold cache), so the speed stage leaves fla out and the fla stage measures it alone. In
#             the third (2026-11-27, one H100) the checks took 110 s and the paper-size run (three models, --repeats 2)
#             did not finish in the 200 s left to it here (with --repeats 1, its first two models took about 150 s),
#             so it is a stage of its own:
#   paper     the paper-size Reformer at 64K: ours, transformers', checkpointed SDPA softmax
#   fla       the decayed-linear kernels with fla's chunk_simple_gla and chunk_linear_attn beside them
#   decode    eager decoding at batch 8 over 1K-64K contexts (1K and 16K took about 240 s)
#   graphs    graph-captured decoding (static caches, reduce-overhead)
#   reformer  Reformer against transformers' (1K-64K), Performer, RA/LARA
#   near      issue 46's benchmark on the GPU: SmolLM2-135M's shapes, transformers' SDPA Llama against the window and
#             lsh_window conversions in bfloat16 at 8K, 32K and 128K, decoding after 128K (not yet run on a GPU)
#   smollm    issue 47's benchmark on the GPU: the real SmolLM2-135M-Instruct and its block-retrieval conversions
#             (every head with 16 and 64 blocks, and 64 with the far store in 8/4 bits) on pass keys at 32K and 128K
#             in bfloat16,
#             into their own report (not yet run on a GPU). The GGUF (98 MB) is over one call's 64 MiB, so it travels
#             in two halves, in two calls on one warm machine (a machine stays warm 30 s after a call, and keeps the
#             ignored files an earlier call brought): here, once (.smol/ is ignored), `mkdir -p .smol;
#             split -b 48M "$SMOL/SmolLM2-135M-Instruct.Q4_1.gguf" .smol/SmolLM2-135M-Instruct.Q4_1.gguf.part_`
#             and gguf's wheel in .whl (`pip download --no-deps gguf==0.19.0 -d .whl`); the first call carries
#             .smol/*part_aa (with the checks stage, say), the second .smol/*part_ab and .whl and runs this stage.
# A session is lent 15 minutes of device time, the machine's start included: checks (about 110 s) and one or two more
# stages fit in one call of at most 600 s, under one deadline (`export GPU_DEADLINE=$(( $(date +%s) + 580 ));
# bash benchmarks/gpu_session.sh checks; bash benchmarks/gpu_session.sh speed`). Whatever a command writes outside
# this script's packing (an ad hoc rerun) must be copied into $OUT in the same call: the next call starts from this
# checkout again, and the third session lost a paper-size JSON that way.
# Each step has its own time limit, so a slow one cannot take the stage's later steps with it. Each benchmark writes
# its own JSON and plot under benchmarks/results/ (the device name inside); the stage packs what it wrote, with its log
# and the tests' JUnit report, into $OUT/results_<stage>.tgz ($OUT: default /tmp/gpu_session_out). Commit the JSON and
# PNG files from it; never transcribe a figure.
set -uo pipefail
stage=${1:?"name a stage: checks, speed, paper, fla, decode, graphs, reformer, near or smollm"}
OUT=${OUT:-/tmp/gpu_session_out}
mkdir -p "$OUT"
log="$OUT/log_$stage.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="$PWD:/tmp/site"
fi
stamp=$(mktemp)  # results written after this are the stage's

# GPU_DEADLINE (seconds since the epoch, optional): when the whole call must end. Several stages share one call
# (`GPU_DEADLINE=$(( $(date +%s) + 570 ))`), so each step's limit is cut to what is left before it, less a margin for
# packing; a step with under a minute left is skipped. Without it, each step keeps its own limit.
step() {  # step SECONDS COMMAND...: run it under its own limit, logged; the stage goes on whatever it returns
    local limit=$1
    shift
    if [ -n "${GPU_DEADLINE:-}" ]; then
        local left=$(( GPU_DEADLINE - $(date +%s) - 15 ))
        if [ "$left" -lt 60 ]; then
            echo "== $(date -u +%T) skipped, ${left}s left before GPU_DEADLINE: $*" | tee -a "$log"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "== $(date -u +%T) $* (limit ${limit}s)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "== exit ${PIPESTATUS[0]} (124: over its limit)" | tee -a "$log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1; } 2>&1 | tee -a "$log"

case "$stage" in
checks)
    workers=""
    python3 -c "import xdist" 2>/dev/null && workers="-n 3 --dist loadfile"
    # shellcheck disable=SC2086  # $workers is empty or three words
    step 240 python3 -m pytest -q -p no:cacheprovider -rs $workers tests/ops tests/models/test_cuda.py \
        --junitxml="$OUT/junit_checks.xml"
    ;;
speed)
    step 220 python3 benchmarks/kernels_gpu.py --quick --no_fla
    ;;
paper)
    step 540 python3 benchmarks/paper_size_reformer.py --device cuda --repeats 2
    ;;
fla)
    step 500 python3 benchmarks/kernels_gpu.py --quick --ops linear \
        --output benchmarks/results/kernels_gpu_fla_quick.json
    ;;
decode)
    step 500 python3 benchmarks/decoding_speed.py --device cuda --batch_sizes 8 --contexts 1024 16384 65536 \
        --families softmax performer reformer lara --worker_timeout 90
    ;;
graphs)
    step 520 python3 benchmarks/decoding_speed.py --device cuda --compiled_static --batch_sizes 1 8 \
        --contexts 1024 16384 65536 --families softmax performer reformer lara ra --worker_timeout 90
    ;;
reformer)
    step 300 python3 benchmarks/reformer_vs_transformers.py --device cuda --lengths 1024 4096 16384 65536 \
        --output benchmarks/results/reformer_vs_transformers_cuda.json
    step 120 python3 benchmarks/performer_speed.py --device cuda
    step 120 python3 benchmarks/randomized_efficiency.py --device cuda
    ;;
near)
    step 540 python3 benchmarks/near_part_speed.py --device cuda --dtypes bfloat16 --lengths 8192 32768 131072 \
        --decode_steps 32 --results benchmarks/results/near_part_speed_cuda.json
    ;;
smollm)
    gguf=.smol/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$gguf" ] || cat .smol/SmolLM2-135M-Instruct.Q4_1.gguf.part_* > "$gguf"
    if [ "$(stat -c %s "$gguf")" != 98362432 ]; then  # the bytes the CPU report's source has
        echo "$gguf has $(stat -c %s "$gguf") bytes, not 98362432: a half did not travel" | tee -a "$log"
        rm -f "$gguf"
        exit 3
    fi
    step 560 python3 benchmarks/pretrained_long_context.py --device cuda --dtype bfloat16 --source "$gguf" \
        --models_dir /tmp/plc_models --designs source block_fixed block_fixed_wide block_wide_quantised \
        --lengths 32768 131072 \
        --fillers repeat --depths 0.25 0.5 0.75 --trials 1 --long_length 131072 --long_trials 1 --no_loss \
        --no_ruler --threads 16 --results benchmarks/results/pretrained_long_context_cuda.json
    ;;
*)
    echo "unknown stage $stage: use checks, speed, paper, fla, decode, graphs, reformer, near or smollm" | tee -a "$log"
    exit 2
    ;;
esac

find benchmarks/results -newer "$stamp" -type f \( -name '*.json' -o -name '*.png' \) -print0 |
    tar czf "$OUT/results_$stage.tgz" --null -T -
echo "packed: $(tar tzf "$OUT/results_$stage.tgz" | tr '\n' ' ')" | tee -a "$log"
