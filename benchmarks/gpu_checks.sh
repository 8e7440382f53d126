#!/usr/bin/env bash
# What only a GPU can check, in as few device commands as possible (device time is
# short). On the GPU machine, after staging (see docs/performance.md, "CUDA performance"):
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

case "${1:-}" in
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
    python3 - "$out/rows.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
words = "the of and a to in is you that it he was for on are as with his they at be this have from".split()
with open(sys.argv[1], "w") as f:
    for i in range(1024):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(100, 1000)))
        f.write(json.dumps({"prompt": text, "sampling_params": {"max_tokens": 128, "ignore_eos": True}}) + "\n")
PY
    n=0
    for flags in "" "--max-num-seqs 128 --max-num-batched-tokens 2048" "--max-num-seqs 512 --max-num-batched-tokens 16384"; do
      n=$((n + 1))
      # shellcheck disable=SC2086
      part "defaults-$n" 240 python3 -c 'import sys; from gristmill.cli import main; main(sys.argv[1:])' batch \
          "$out/rows.jsonl" -o "$out/out-$n.jsonl" --model "$model" --device cuda --max-model-len 2048 \
          --batch-size 256 $flags
    done ;;
  *)
    echo "usage: $0 tests|speed|structured|defaults" >&2
    exit 2 ;;
esac
