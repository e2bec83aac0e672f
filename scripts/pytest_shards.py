"""Run a pytest selection as N concurrent shards and print one summary line per shard and in all.

The GPU suite's time goes mostly to NVRTC compiles and host-side reference math, which are
CPU-bound: shards on a 16-core machine share the one GPU and finish several times sooner. Tests
are dealt out round-robin by node id (parametrizations of one test land on different shards).

    python scripts/pytest_shards.py --shards 8 --out OUTDIR [--limit SECONDS] [-m gpu] tests/ ...
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected).*?) in [\d.]+s", re.MULTILINE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=540, help="seconds per shard")
    parser.add_argument("-m", dest="marker", default=None, help="pytest marker expression")
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    options = ["-m", args.marker] if args.marker else []
    selection = [*options, *args.paths]
    args.out.mkdir(parents=True, exist_ok=True)
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                *selection], capture_output=True, text=True)
    ids = [line for line in collected.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        print(collected.stdout[-3000:], collected.stderr[-3000:])
        return 2
    shards = [ids[i::args.shards] for i in range(args.shards)]
    t0 = time.time()
    procs = []
    for i, shard in enumerate(shards):
        if not shard:
            continue
        node_file = args.out / f"shard{i}.ids"
        node_file.write_text("\n".join(shard) + "\n")
        log = open(args.out / f"shard{i}.log", "w")
        cmd = ["timeout", str(args.limit), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={args.out / f'shard{i}.xml'}", *options, *shard]
        procs.append((i, len(shard), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    status = 0
    for i, n, proc, log in procs:
        rc = proc.wait()
        log.close()
        text = (args.out / f"shard{i}.log").read_text()
        found = _SUMMARY.findall(text)
        print(f"shard {i}: {n} tests, rc {rc}: {found[-1] if found else 'no summary (timed out?)'}")
        status |= rc != 0
    print(f"pytest_shards: {len(ids)} tests in {len(procs)} shards, {time.time() - t0:.0f} s")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
