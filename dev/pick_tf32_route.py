"""Which float32 backward route the device should run next, from one dev/bench_dmma_bwd.py run.

    python dev/pick_tf32_route.py BENCH_JSON [--margin 0.03] [--pick FILE]

Each candidate below is a patch of dev/experiments/ that routes float32's d64 backward (statistics
"saved") to one of bench_dmma_bwd's WGMMA_CANDIDATES. The picked one is the fastest whose error
against the SIMT backward stays within the bench's float32 bound in every row and whose time,
the geometric mean over the rows, beats the route's (``wgmma_producer``) by ``margin``. Its patch
name is written to FILE (scripts/gpu_check.sh's picked-patches), or nothing when none wins: the
suite that follows on the same machine then runs on what was picked (gpu_check.sh picked)."""

import argparse
import json
import math

BASELINE = "wgmma_producer"
CANDIDATES = {"wgmma_producer_dq": "tf32_dq_producer_route",
              "wgmma_producer_dq_c2": "tf32_dq_two_consumers_route"}
BOUND = 1e-4  # bench_dmma_bwd's float32 bound: two float32 backwards' own rounding apart


def pick(rows: list, margin: float) -> tuple[str | None, dict]:
    """(patch name or None, each candidate's speed-up over the baseline; None where it was wrong)"""
    gains = {}
    for name in CANDIDATES:
        keys = [f"saved_{name}_tflops", f"saved_{name}_rel_err_vs_simt"]
        if not rows or any(key not in row for row in rows for key in keys + [f"saved_{BASELINE}_tflops"]):
            continue
        if not all(row[keys[1]] <= BOUND for row in rows):
            gains[name] = None
            continue
        logs = [math.log(row[keys[0]] / row[f"saved_{BASELINE}_tflops"]) for row in rows]
        gains[name] = math.exp(sum(logs) / len(logs))
    winners = [(gain, name) for name, gain in gains.items() if gain is not None and gain >= 1 + margin]
    return (CANDIDATES[max(winners)[1]] if winners else None), gains


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json")
    parser.add_argument("--margin", type=float, default=0.03)
    parser.add_argument("--pick", help="write the picked patch's name here")
    args = parser.parse_args()
    with open(args.bench_json) as f:
        rows = json.load(f)
    patch, gains = pick(rows, args.margin)
    for name, gain in gains.items():
        print(f"{name}: " + ("WRONG (error above the bound)" if gain is None else f"{gain:.3f}x {BASELINE}"))
    print(f"picked: {patch or 'none'}")
    if args.pick:
        with open(args.pick, "w") as f:
            f.write(patch or "")


if __name__ == "__main__":
    main()
