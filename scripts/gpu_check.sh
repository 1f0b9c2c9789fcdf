#!/usr/bin/env bash
# One command for a GPU machine: set up, run the CUDA test tier, then measure slipstream against
# DDP and FSDP2 on the same GPU(s).
#
#   scripts/gpu_check.sh            set up (.venv), run every test marked `cuda`, run benchmarks/bench_gpu.py
#   scripts/gpu_check.sh --dry      no GPU needed: list every CUDA test as "needs a GPU", check the
#                                   benchmark script parses, exit 0 (CI runs this so the script cannot rot)
#   --no-setup                      skip scripts/setup.sh (the environment is already there)
#
# Without --dry on a machine where torch sees no GPU, it behaves as --dry and says so.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
SETUP=1
for arg in "$@"; do
  case "$arg" in
    --dry) DRY=1 ;;
    --no-setup) SETUP=0 ;;
    *) echo "gpu_check: unknown argument $arg (use --dry, --no-setup)" >&2; exit 2 ;;
  esac
done

if [ "$SETUP" = 1 ]; then
  ./scripts/setup.sh
fi
PY="${PYTHON:-.venv/bin/python}"

GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$DRY" = 0 ] && [ "$GPUS" = 0 ]; then
  echo "gpu_check: torch sees no GPU on this machine; running the dry mode"
  DRY=1
fi

echo "== CUDA test tier"
if [ "$DRY" = 1 ]; then
  # Collect (import every test module, so the tier keeps compiling) and list what would run.
  TESTS="$("$PY" -m pytest --collect-only -q -m cuda -p no:cacheprovider tests | grep '::' || true)"
  if [ -z "$TESTS" ]; then
    echo "gpu_check: no test is marked cuda" >&2
    exit 1
  fi
  while IFS= read -r test; do
    echo "needs a GPU: $test"
  done <<< "$TESTS"
  echo "== benchmark"
  "$PY" benchmarks/bench_gpu.py --help > /dev/null
  echo "needs a GPU: benchmarks/bench_gpu.py (slipstream ZeRO-0/3 vs DDP and FSDP2: step time, tokens/s, MFU, peak memory_allocated)"
  echo "gpu_check: dry run done ($(wc -l <<< "$TESTS") CUDA tests listed)"
  exit 0
fi

echo "gpu_check: $GPUS GPU(s): $("$PY" -c 'import torch; print(", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))')"
SLIPSTREAM_ACCELERATOR=cuda "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs tests
echo "== benchmark"
"$PY" benchmarks/bench_gpu.py --gpus "$GPUS"
