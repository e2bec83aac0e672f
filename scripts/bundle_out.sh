#!/usr/bin/env bash
# The last step of a device command: everything under OUT into two files, since a call brings back
# at most 8 files, two folders down (the device tool's limits). Twice a part's summary of the GPU
# suite stayed on the machine that way (2026-12-07 and 2026-12-08), each time the one that failed.
#   scripts/bundle_out.sh OUT
# leaves OUT/summary.txt (every step line of scripts/gpu_check.sh, "NAME: rc N in S s; ...", and
# every pytest or shard summary line, each with the file it came from) and OUT/bundle.tar.gz (all
# the rest, folders as they were; tar -xzf bundle.tar.gz on this side).
set -uo pipefail
out=${1:?usage: scripts/bundle_out.sh OUT}
cd "$out" || exit 1
find . -type f ! -path ./bundle.tar.gz ! -path ./summary.txt -print0 | sort -z |
    xargs -0 -r grep -HE "^[A-Za-z0-9_.+-]+: rc [0-9]+ in [0-9]+ s|[0-9]+ (passed|failed|error)|^(xfailed|passed|failed) [0-9]" \
    > summary.txt
tar -czf bundle.tar.gz --exclude=./bundle.tar.gz --exclude=./summary.txt .
find . -mindepth 1 -maxdepth 1 ! -name bundle.tar.gz ! -name summary.txt -exec rm -rf {} +
echo "bundle_out: $(tar -tzf bundle.tar.gz | grep -cv '/$') files in bundle.tar.gz, $(wc -l < summary.txt) summary lines"
