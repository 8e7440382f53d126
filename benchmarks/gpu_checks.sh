#!/usr/bin/env bash
# What only a GPU can check, in as few device commands as possible (device time is
# short). On the GPU machine, after staging (see docs/performance.md, "CUDA performance"):
#
#   bash .gpu/remote.sh bash benchmarks/gpu_checks.sh tests       # the CUDA tests (~4 min)
#   bash .gpu/remote.sh bash benchmarks/gpu_checks.sh speed       # throughput vs transformers (~5 min)
#   bash .gpu/remote.sh bash benchmarks/gpu_checks.sh structured  # masking cost on CUDA (~3 min)
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

case "${1:-}" in
  tests)
    part tests 540 python3 -m pytest -q tests/cuda tests/engine/test_async_scheduling.py \
        tests/model/test_triton_kernels.py tests/model/test_logits_controls.py tests/batch/test_gpus.py ;;
  speed)
    part throughput 560 python3 benchmarks/throughput_cuda.py --model "$model" --json "$out/throughput.json" ;;
  structured)
    part structured 300 python3 benchmarks/structured_output.py --device cuda --model "$model" ;;
  *)
    echo "usage: $0 tests|speed|structured" >&2
    exit 2 ;;
esac
