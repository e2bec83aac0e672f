"""Side by side, the metrics of Nsight Compute raw CSV pages (``ncu --page raw --csv ...``, one
kernel launch a file) whose names match a regex: pipes, issue, stalls and time by default.

    python dev/ncu_summary.py A.csv B.csv ... [--match REGEX]"""
import csv
import re
import sys

DEFAULT = (r"gpu__time_duration\.sum|pipe_.*pct_of_peak_sustained_active|issue_active\.avg\.pct|"
           r"warp_issue_stalled_.*_per_warp_active\.pct|inst_executed\.sum$|registers_per_thread|"
           r"warps_active\.avg\.pct|sm__throughput\.avg\.pct")


def read(path: str) -> dict:
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not quoted
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        return {}
    names, units, values = rows[0], rows[1], rows[2]  # the first profiled launch
    return {n: f"{v} {u}".strip() for n, u, v in zip(names, units, values)}


def main(argv: list[str]) -> None:
    pattern = DEFAULT
    if "--match" in argv:
        i = argv.index("--match")
        pattern = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    tables = [read(p) for p in argv]
    names = sorted({n for t in tables for n in t if re.search(pattern, n)})
    print("metric\t" + "\t".join(argv))
    for n in names:
        print(n + "\t" + "\t".join(t.get(n, "-") for t in tables))


if __name__ == "__main__":
    main(sys.argv[1:])
