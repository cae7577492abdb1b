#!/usr/bin/env bash
# The GPU runs of the speed and decoding goals (docs/benchmarks.md), in four stages of under 10 minutes each, in the
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
# Stages and their time on one H100/H200:
#   checks    ~4 min: tests/ops (Triton = PyTorch reference, fp32/bf16/fp16, forward and backward) and
#             tests/models/test_cuda.py (reversible RNG replay, LSH/local on CUDA, CUDA-graph decoding = eager)
#   speed     ~9 min: kernels (Triton vs PyTorch, fla, SDPA, FlexAttention), the paper-size Reformer at 64K, eager
#             decoding at batch 8 over 1K-64K contexts
#   decode    ~9 min: graph-captured decoding (static caches, reduce-overhead)
#   reformer  ~9 min: Reformer against transformers' (1K-64K), Performer, RA/LARA
# Each step has its own time limit, so a slow one cannot take the stage's later steps with it. Each benchmark writes
# its own JSON and plot under benchmarks/results/ (the device name inside); the stage packs what it wrote, with its log
# and the tests' JUnit report, into $OUT/results_<stage>.tgz ($OUT: default /tmp/gpu_session_out). Commit the JSON and
# PNG files from it; never transcribe a figure.
set -uo pipefail
stage=${1:?"name a stage: checks, speed, decode or reformer"}
OUT=${OUT:-/tmp/gpu_session_out}
mkdir -p "$OUT"
log="$OUT/log_$stage.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="$PWD:/tmp/site"
fi
stamp=$(mktemp)  # results written after this are the stage's

step() {  # step SECONDS COMMAND...: run it under its own limit, logged; the stage goes on whatever it returns
    local limit=$1
    shift
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
    step 330 python3 -m pytest -q -p no:cacheprovider -rs tests/ops tests/models/test_cuda.py \
        --junitxml="$OUT/junit_checks.xml"
    ;;
speed)
    step 150 python3 benchmarks/kernels_gpu.py --quick
    step 150 python3 benchmarks/paper_size_reformer.py --device cuda --repeats 2
    step 220 python3 benchmarks/decoding_speed.py --device cuda --batch_sizes 8 --contexts 1024 16384 65536 \
        --families softmax performer reformer lara --worker_timeout 60
    ;;
decode)
    step 520 python3 benchmarks/decoding_speed.py --device cuda --compiled_static --batch_sizes 1 8 \
        --contexts 1024 16384 65536 --families softmax performer reformer lara ra --worker_timeout 90
    ;;
reformer)
    step 300 python3 benchmarks/reformer_vs_transformers.py --device cuda --lengths 1024 4096 16384 65536 \
        --output benchmarks/results/reformer_vs_transformers_cuda.json
    step 120 python3 benchmarks/performer_speed.py --device cuda
    step 120 python3 benchmarks/randomized_efficiency.py --device cuda
    ;;
*)
    echo "unknown stage $stage: use checks, speed, decode or reformer" | tee -a "$log"
    exit 2
    ;;
esac

find benchmarks/results -newer "$stamp" -type f \( -name '*.json' -o -name '*.png' \) -print0 |
    tar czf "$OUT/results_$stage.tgz" --null -T -
echo "packed: $(tar tzf "$OUT/results_$stage.tgz" | tr '\n' ' ')" | tee -a "$log"
