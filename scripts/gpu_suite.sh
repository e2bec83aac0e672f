#!/usr/bin/env bash
# The whole GPU suite in device calls that each fit the device's 600 s limit:
#   scripts/gpu_suite.sh warm   OUTDIR   # every kernel this device runs into CuPy's disk cache
#   scripts/gpu_suite.sh part-a OUTDIR   # the five largest GPU test files (about half the tests)
#   scripts/gpu_suite.sh part-b OUTDIR   # every other test marked gpu
# Issue the three calls back to back: the machine keeps the cache (.cupy-cache, ignored by git)
# only while it stays warm. With the cache cold, 14 shards compiling the same kernels did not
# finish the 952 GPU tests in 430 s (2026-12-03); warm, each part took about 250 s before.
# Summaries in OUTDIR/<step>.txt (gpu_suite_part.sh: shard lines, failures, totals).
set -uo pipefail
step=${1:?usage: gpu_suite.sh warm|part-a|part-b OUTDIR}
out=${2:?usage: gpu_suite.sh warm|part-a|part-b OUTDIR}
cd "$(dirname "$0")/.."
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cupy-cache} PYTHONPATH=$PWD
mkdir -p "$out"
PART_A="tests/test_headdim_v_gpu.py tests/test_api_gpu.py tests/kernels/test_flash_fwd_dmma.py
        tests/test_kvcache_kernel_gpu.py tests/test_robustness_gpu.py"
case "$step" in
    warm)
        timeout 540 python scripts/warm_kernel_cache.py > "$out/warm.txt" 2>&1
        tail -3 "$out/warm.txt";;
    part-a)
        # shellcheck disable=SC2086
        SHARDS=${SHARDS:-14} bash scripts/gpu_suite_part.sh "$out/part-a.txt" "${LIMIT:-520}" $PART_A
        cat "$out/part-a.txt";;
    part-b)
        rest=()
        for f in tests/test_*.py tests/kernels/test_*.py; do
            case " $(echo $PART_A) " in *" $f "*) ;; *) rest+=("$f");; esac
        done
        SHARDS=${SHARDS:-14} bash scripts/gpu_suite_part.sh "$out/part-b.txt" "${LIMIT:-520}" "${rest[@]}"
        cat "$out/part-b.txt";;
    *) echo "gpu_suite.sh: unknown step $step (warm, part-a, part-b)" >&2; exit 2;;
esac
