#!/usr/bin/env bash
# On a GPU machine: the GPU tests, then the cuLA-vs-FLA benchmark; its JSON, markdown table and plot, and the logs,
# into one folder.
#   bash scripts/gpu_check.sh OUTDIR [benchmark arguments...]     (SKIP_GPU_TESTS=1: the benchmark only)
#   e.g. bash scripts/gpu_check.sh out --op gdn kda --shapes core varlen long layer   (python -m benchmarks.run --help)
# GPU_TESTS="...": pytest arguments for a part of the GPU tests instead of all of them.
# SANITIZE=1: first every SM90 kernel on awkward shapes (scripts/sanitize_kernels.py) under compute-sanitizer's
# memcheck and racecheck; each log's summary goes to OUTDIR/sanitize.txt, and an error fails the check. The kernels are
# compiled with line info there (CUTE_DSL_LINEINFO), so that a report names the source line of each access;
# SANITIZE_OPS="gla gdn_train ..." narrows the calls (scripts/sanitize_kernels.py --op).
# Without matplotlib there the plot is skipped; draw it elsewhere with `python -m benchmarks.plot OUTDIR/benchmark.json`.
# FLA autotunes each op at each new shape on its first call (up to minutes). Its choices are kept on disk
# (TRITON_CACHE_AUTOTUNING) and packed into OUTDIR/fla_autotune.tgz; a later run reads them back from
# FLA_AUTOTUNE_TGZ (default: benchmarks/results/fla_autotune_h100.tgz on an H100, else fla_autotune_h200.tgz, FLA's
# GDN, KDA and GLA forward choices for the core, varlen, long and layer grids from the project's H200 with triton
# 3.6) and skips that autotuning. On the project's H200 test machine, first
# `. .device/b/setup.sh` (see PERF.md, "GPU runs on the H200 test machine").
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [benchmark args]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/cula_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -z "${FLA_AUTOTUNE_TGZ:-}" ]; then  # FLA's choices from the same kind of GPU, where the project has them
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H100*) FLA_AUTOTUNE_TGZ=benchmarks/results/fla_autotune_h100.tgz ;;
    *) FLA_AUTOTUNE_TGZ=benchmarks/results/fla_autotune_h200.tgz ;;
  esac
fi
if [ -f "$FLA_AUTOTUNE_TGZ" ]; then
  tar -xzf "$FLA_AUTOTUNE_TGZ" -C "$TRITON_CACHE_DIR"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
sanitize=0
if [ "${SANITIZE:-0}" = 1 ]; then
  : > "$out/sanitize.txt"
  for tool in memcheck racecheck; do
    # without the variable, torch's caching allocator hides overruns inside its blocks
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 CUTE_DSL_LINEINFO=1 compute-sanitizer --tool "$tool" --error-exitcode 1 --report-api-errors no --show-backtrace no \
      python3 scripts/sanitize_kernels.py ${SANITIZE_OPS:+--op $SANITIZE_OPS} > "$out/sanitize_$tool.log" 2>&1
    rc=$?
    echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1)" | tee -a "$out/sanitize.txt"
    [ "$rc" -eq 0 ] || sanitize=1
  done
fi
if [ "${SKIP_GPU_TESTS:-0}" = 1 ]; then  # a benchmark-only call, right after a call that ran the tests
  echo "GPU tests skipped (SKIP_GPU_TESTS=1)" | tee "$out/gpu_tests.log"
  tests=0
else
  # GPU_TESTS="tests/test_gla_sm90_backward.py -k kernel": a part of the suite (pytest arguments)
  # the counts also go to gpu_tests.xml: a -q in GPU_TESTS makes pytest drop its summary line
  python3 -m pytest -q -m gpu -rs --junitxml="$out/gpu_tests.xml" ${GPU_TESTS:-tests} 2>&1 | tee "$out/gpu_tests.log"
  tests=${PIPESTATUS[0]}
  python3 - "$out/gpu_tests.xml" <<'PY' | tee -a "$out/gpu_tests.log"
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
print(f"GPU tests: {n['tests']} collected, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped or xfailed")
PY
fi
python3 -m benchmarks.run --out "$out" "$@" 2>&1 | tee "$out/benchmark.log"
bench=${PIPESTATUS[0]}
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar -czf "$out/fla_autotune.tgz" --null -T -)
echo "gpu tests exit $tests, benchmark exit $bench, sanitizer $sanitize" | tee -a "$out/gpu.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$sanitize" -eq 0 ]
