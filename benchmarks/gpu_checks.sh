#!/usr/bin/env bash
# What only a GPU can check, in as few device commands as possible (device time is
# short). On the GPU machine, after staging (see docs/performance.md, "CUDA performance"):
#
#   bash .gpu/remote.sh bash benchmarks/gpu_checks.sh all         # everything below, ~8 min
#
# `all` runs, ordered by value, each part time-boxed inside GPU_BUDGET_S (default 450 s;
# a part that would not fit is skipped and named in the summary): the tests; the model
# shapes (benchmarks/gpu_shapes.py: Gemma 3 270M, Qwen3-0.6B with nano-vllm's workload,
# Llama 3.1 8B, Llama 3.2 1B); structured output and penalties; gristmill batch at the
# CUDA defaults against 512 / 16384. It leaves four files under $OUT: summary.txt (the
# tables), results.json (every figure), tests.txt and log.txt. The parts one at a time:
#
#   bash .gpu/remote.sh bash benchmarks/gpu_checks.sh tests       # the CUDA tests (~4 min)
#   bash .gpu/remote.sh bash benchmarks/gpu_checks.sh speed       # throughput vs transformers (~5 min)
#   bash .gpu/remote.sh bash benchmarks/gpu_checks.sh structured  # masking cost on CUDA (~3 min)
#   bash .gpu/remote.sh bash benchmarks/gpu_checks.sh defaults    # gristmill batch: engine defaults on CUDA (~3 min)
#
# Each part writes its full output under $OUT (or ./gpu-results) and prints its last
# lines; a part that fails does not stop the next one.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
model=${GRISTMILL_GPU_MODEL:?run it through .gpu/remote.sh, which builds the model}

part() {  # part NAME SECONDS COMMAND...: run COMMAND into $out/NAME.txt, bounded in time
    local name=$1 seconds=$2
    shift 2
    echo "== $name: $*"
    timeout "$seconds" "$@" > "$out/$name.txt" 2>&1
    echo "   exit $?"
    tail -n 25 "$out/$name.txt"
}

SHAPES="gemma3-270m qwen3-0.6b llama3.1-8b llama3.2-1b"

case "${1:-}" in
  all)
    work=/tmp/gpu-run
    rm -rf "$work" && mkdir -p "$work"
    budget=${GPU_BUDGET_S:-450}
    deadline=$((SECONDS + budget))
    exec > >(tee -a "$out/log.txt") 2>&1
    box() {  # box NAME SECONDS COMMAND...: COMMAND into $work/NAME.txt, within its box and the budget
        local name=$1 seconds=$2 left=$((deadline - SECONDS))
        shift 2
        [ "$left" -lt "$seconds" ] && seconds=$left
        if [ "$seconds" -lt 20 ]; then
            echo "== $name: skipped, ${left}s of the budget left" | tee -a "$work/skipped.txt"
            return
        fi
        echo "== $name (${seconds}s box, $((SECONDS))s in): $*"
        timeout "$seconds" "$@" > "$work/$name.txt" 2>&1
        echo "   $name: exit $? after $((SECONDS))s"
        tail -n 15 "$work/$name.txt"
    }
    # 1. Tests, two processes at once (the kernels' and the engine's), failing fast.
    tests_box=$((budget * 2 / 5))  # tests/cuda took over 100 s on an H100 (2026-11-26)
    timeout "$tests_box" python3 -m pytest -q --maxfail=3 -p no:cacheprovider tests/cuda > "$work/tests-cuda.txt" 2>&1 &
    cuda_pid=$!
    timeout "$tests_box" python3 -m pytest -q --maxfail=3 -p no:cacheprovider tests/model/test_triton_kernels.py \
        tests/model/test_logits_controls.py tests/engine/test_async_scheduling.py tests/batch/test_gpus.py \
        > "$work/tests-rest.txt" 2>&1
    echo "tests (kernels, logits controls, async scheduling, GPUs): exit $?" > "$work/tests-exit.txt"
    wait $cuda_pid
    echo "tests/cuda: exit $?" >> "$work/tests-exit.txt"
    cat "$work/tests-exit.txt" "$work/tests-cuda.txt" "$work/tests-rest.txt" > "$out/tests.txt"
    cat "$work/tests-exit.txt"; tail -n 5 "$work/tests-cuda.txt" "$work/tests-rest.txt"
    # 2. The model shapes.
    for shape in $SHAPES; do
      extra=""; seconds=70
      case $shape in qwen3-0.6b) extra="--nano"; seconds=90 ;; llama3.1-8b) seconds=100 ;; esac
      # shellcheck disable=SC2086
      box "shape-$shape" $seconds python3 benchmarks/gpu_shapes.py --shape "$shape" --tokenizer "$model" \
          --json "$work/shape-$shape.json" $extra
    done
    # 3. Structured output and penalties on CUDA.
    box structured 60 python3 benchmarks/structured_output.py --device cuda --model "$model"
    # 4. gristmill batch at the CUDA defaults against one alternative.
    python3 benchmarks/gpu_checks_rows.py "$work/rows.jsonl"
    n=0
    for flags in "" "--max-num-seqs 512 --max-num-batched-tokens 16384"; do
      n=$((n + 1))
      # shellcheck disable=SC2086
      box "defaults-$n" 60 python3 -c 'import sys; from gristmill.cli import main; main(sys.argv[1:])' batch \
          "$work/rows.jsonl" -o "$work/out-$n.jsonl" --model "$model" --device cuda --max-model-len 2048 --batch-size 256 $flags
    done
    python3 benchmarks/gpu_summary.py "$work" "$out"
    ;;
  tests)
    part tests 540 python3 -m pytest -q tests/cuda tests/engine/test_async_scheduling.py \
        tests/model/test_triton_kernels.py tests/model/test_logits_controls.py tests/batch/test_gpus.py ;;
  speed)
    part throughput 560 python3 benchmarks/throughput_cuda.py --model "$model" --json "$out/throughput.json" ;;
  structured)
    part structured 300 python3 benchmarks/structured_output.py --device cuda --model "$model" ;;
  defaults)
    # Are the CUDA defaults (max_num_seqs=256 / max_num_batched_tokens=8192) right? 1,024
    # rows of 100-1,000 prompt tokens and 128 output tokens through `gristmill batch`, at
    # the defaults, at the CPU's (128 / 2048) and at 512 / 16384; compare the tok/s lines.
    python3 benchmarks/gpu_checks_rows.py "$out/rows.jsonl"
    n=0
    for flags in "" "--max-num-seqs 128 --max-num-batched-tokens 2048" "--max-num-seqs 512 --max-num-batched-tokens 16384"; do
      n=$((n + 1))
      # shellcheck disable=SC2086
      part "defaults-$n" 240 python3 -c 'import sys; from gristmill.cli import main; main(sys.argv[1:])' batch \
          "$out/rows.jsonl" -o "$out/out-$n.jsonl" --model "$model" --device cuda --max-model-len 2048 \
          --batch-size 256 $flags
    done ;;
  *)
    echo "usage: $0 all|tests|speed|structured|defaults" >&2
    exit 2 ;;
esac
