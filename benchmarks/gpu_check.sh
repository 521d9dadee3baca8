#!/usr/bin/env bash
# Everything that needs a GPU, in one run, with the machine's own python3 and torch (no
# install, no network): the copy kernels' bandwidth and bits, the training bench on CUDA,
# the plan of that workload against it, and the CUDA-only tests. Results go to
# benchmarks/out/gpu/ (ignored by git; GPU_OUT overrides it), with the commit they measured. Each step runs even if an earlier one
# failed; the exit code is the first failure's.
#
#   make gpu-check                     # or: bash benchmarks/gpu_check.sh
#   GPU_PYTHON=/path/to/python make gpu-check
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
OUT=${GPU_OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
export TRITON_CACHE_DIR="$(mktemp -d)"  # first calls then include compiling the kernels
status=0
summary="$OUT/summary.txt"
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
} > "$summary"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$summary"
  if [ $rc -ne 0 ] && [ $status -eq 0 ]; then status=$rc; fi
}

step kernels 150 "$PY" benchmarks/gpu_check.py --time-budget 110 --out "$OUT/gpu_check.json"
# The whole step against compile + compiled autograd and the unsharded compiled model;
# four compiles, to stay within the step's limit.
step bench 210 "$PY" -m fsdp_traceable bench --device cuda --world-size 1 --mp bf16 \
  --dim 1024 --layers 8 --heads 16 --vocab-size 8192 --seq-len 512 --batch-size 8 \
  --modes fsdp2-eager,eager,compile-ca,whole-step,compile-blocks,compute-only,compute-only-compiled,comm-only \
  --bench-steps 10 --out "$OUT/bench"
# The plan of that workload (ours, eager, one rank) against the run: peak above the
# step's start and step time, planned / measured (benchmarks/plan_vs_run.py).
GPU_KIND=$("$PY" -c "import torch; n = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ''; print(next((k for k in ('h200', 'b200', 'h100') if k in n), 'h100'))")
step plan 90 bash -c '"$0" -m fsdp_traceable plan --model transformer --world-size 1 --param-dtype bf16 \
  --reduce-dtype fp32 --dim 1024 --layers 8 --heads 16 --vocab-size 8192 --seq-len 512 --batch-size 8 \
  --gpu "$1" --json > "$2"' "$PY" "$GPU_KIND" "$OUT/plan.json"
step plan-vs-run 30 "$PY" benchmarks/plan_vs_run.py --plan "$OUT/plan.json" \
  --bench "$OUT/bench/bench.json" --mode eager --out "$OUT/plan_vs_run.json"
if "$PY" -c "import pytest" 2>/dev/null; then
  step tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
else
  echo "tests: skipped, pytest is not installed for $PY" | tee -a "$summary"
fi
cat "$summary"
exit $status
