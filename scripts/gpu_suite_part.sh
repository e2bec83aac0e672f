#!/usr/bin/env bash
# One part of the GPU test suite as concurrent shards, everything it says in one file:
#   scripts/gpu_suite_part.sh OUTFILE LIMIT_S PYTEST_PATHS...
# Shard summaries, then every failure's and error's lines and hypothesis's falsifying examples
# from the shard logs (the logs
# themselves are deleted: a device run returns few files). HYPOTHESIS_PROFILE and SHARDS from the
# environment (defaults dev, 14); benchmark tests run once each (--benchmark-disable).
# Warm the kernel cache first, in a device call of its own (scripts/gpu_check.sh OUTDIR warm, then
# OUTDIR suite with SUITE_PART=1, 2 and 3): with the cache cold, 14 shards compiling the same kernels side by side (and a warm-up
# beside them) did not finish the 952 GPU tests in 430 s (2026-12-03); warm, two parts of about
# 250 s each did. A shard killed by its limit still reports what it finished, what failed and what
# it was running (scripts/pytest_shards.py reads pytest -v's lines).
set -uo pipefail
outfile=${1:?usage: gpu_suite_part.sh OUTFILE LIMIT_S PATHS...}
limit=${2:?}
shift 2
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONPATH=$PWD PYTEST_ADDOPTS="--benchmark-disable"
# One BLAS thread a shard: the shards already fill the cores, and the float64 references and
# rounding baselines (NumPy matmuls) each took every core's thread before (14 shards x 16
# threads on 16 cores). Not yet measured: the ring's file, heavy in those baselines, was the part
# that ran out of time on 2026-12-05.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
python scripts/pytest_shards.py --shards "${SHARDS:-14}" --limit "$limit" --out "$dir" -m gpu "$@" > "$outfile" 2>&1
status=$?
for log in "$dir"/shard*.log; do
    if grep -qE "FAILED|ERROR|Error|Timeout|no summary" "$log" || ! grep -qE "[0-9]+ passed" "$log"; then
        echo "=== $(basename "$log")" >> "$outfile"
        # hypothesis's falsifying examples too: the draw is what the next session reproduces
        grep -E "^(FAILED|ERROR)|^E  |Error|passed|failed|Falsifying|Draw [0-9]|AttentionProblem\(|^\s*\|?\s*[a-z_]+=.*,\s*(#.*)?$" "$log" \
            | head -80 >> "$outfile"
    fi
done
grep -h -oE "[0-9]+ (passed|failed|skipped|xfailed|errors?)" "$dir"/shard*.log | awk '{n[$2]+=$1} END {for (k in n) printf "%s %d  ", k, n[k]; print ""}' >> "$outfile"
rm -rf "$dir"
exit $status
