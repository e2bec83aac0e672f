"""Run a pytest selection as N concurrent shards and print one summary line per shard and in all.

The GPU suite's time goes mostly to NVRTC compiles and host-side reference math, which are
CPU-bound: shards on a 16-core machine share the one GPU and finish several times sooner. Tests
are dealt out round-robin by node id (parametrizations of one test land on different shards).

    python scripts/pytest_shards.py --shards 8 --out OUTDIR [--limit SECONDS] [-m gpu] [-k EXPR] tests/ ...
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
# pytest -v's line per test: "<node id> PASSED [ 12%]"; a test still running when the shard was
# killed has its node id and no outcome
# (parametrized ids may hold spaces: "test_x[alibi per sequence]")
_OUTCOME = re.compile(r"^(\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)


def partial_summary(text: str) -> str:
    """What a shard killed before its summary had done: its outcomes counted from -v's lines, the
    failed tests by name, and the test it was running."""
    outcomes = _OUTCOME.findall(text)
    counts = {}
    for _, outcome in outcomes:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    parts = [", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "nothing finished"]
    failed = [node for node, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    if failed:
        parts.append("failed: " + " ".join(failed))
    last = text.rstrip().splitlines()[-1] if text.strip() else ""
    if "::" in last and not _OUTCOME.match(last):
        parts.append(f"running when killed: {last.strip()}")
    return "no summary (timed out?); " + "; ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=540, help="seconds per shard")
    parser.add_argument("-m", dest="marker", default=None, help="pytest marker expression")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest keyword expression")
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    options = (["-m", args.marker] if args.marker else []) + (["-k", args.keyword] if args.keyword else [])
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
        cmd = ["timeout", str(args.limit), sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
               f"--junitxml={args.out / f'shard{i}.xml'}", *options, *shard]
        procs.append((i, len(shard), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    status = 0
    for i, n, proc, log in procs:
        rc = proc.wait()
        log.close()
        text = (args.out / f"shard{i}.log").read_text()
        found = _SUMMARY.findall(text)
        print(f"shard {i}: {n} tests, rc {rc}: {found[-1] if found else partial_summary(text)}")
        status |= rc != 0
    print(f"pytest_shards: {len(ids)} tests in {len(procs)} shards, {time.time() - t0:.0f} s")
    print(time_report(sorted(args.out.glob("shard*.xml"))))
    return int(status)


def time_report(xml_files, top: int = 12) -> str:
    """Where the shards' time went, from their JUnit XML: seconds per test file (summed over
    shards) and the slowest tests, so that a suite too long for its call shows what to trim."""
    import xml.etree.ElementTree as ET
    from collections import Counter

    per_file, per_test = Counter(), []
    for xml_file in xml_files:
        try:
            root = ET.parse(xml_file).getroot()
        except (ET.ParseError, OSError):  # a shard killed before it wrote its report
            continue
        for case in root.iter("testcase"):
            seconds = float(case.get("time", 0.0))
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            parts = case.get("classname", "").split(".")  # tests.test_x or tests.test_x.TestClass
            module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
            per_file[".".join(parts[:module + 1])] += seconds
            per_test.append((seconds, name))
    if not per_test:
        return "time per file: no JUnit report"
    lines = ["time per file (s, summed over shards): " + ", ".join(
        f"{name} {seconds:.0f}" for name, seconds in per_file.most_common())]
    lines += [f"  {seconds:7.1f} s  {name}" for seconds, name in sorted(per_test, reverse=True)[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
