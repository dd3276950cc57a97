#!/usr/bin/env bash
# On a GPU machine: the GPU tests, then the cuLA-vs-FLA benchmark, results and logs into one folder.
#   bash scripts/gpu_check.sh OUTDIR [benchmark arguments...]
# On the project's H200 test machine, first `. .device/b/setup.sh` (see NOTES.md, "GPU runs").
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [benchmark args]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
python3 -m pytest -q -m gpu -rs tests 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
python3 -m benchmarks.run --out "$out" "$@" 2>&1 | tee "$out/benchmark.log"
bench=${PIPESTATUS[0]}
echo "gpu tests exit $tests, benchmark exit $bench" | tee -a "$out/gpu.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
