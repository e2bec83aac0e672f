"""A wave model of the causal packed (varlen) forward against the dense one (CPU only): issue 17's
"causal varlen within 10% of dense" miss (0.81-0.87x measured, perf log "varlen").

The packed launch's grid is (query blocks of the longest sequence, heads, sequences), x fastest,
each sequence's query blocks issued heaviest first (Mask::query_block); CTAs past a sequence's end
return at once. Each CTA costs `overhead` + the key blocks it visits (causal: up to its diagonal),
in units of one key block's time, and goes to the slot (an SM's CTA place) that frees first.
Compared: the grid's order (sequences in batch order), the longest sequences first (a permutation
of blockIdx.z the launch does not have; the "not tried" of the perf log), and a dense causal
problem of one sequence of the same total tokens, as rates of useful (query, key) pairs.

    python dev/varlen_wave_model.py [--overheads 1 2 4]
"""
from __future__ import annotations

import argparse
import heapq
import math


def makespan(costs, slots: int) -> float:
    """Greedy list scheduling in issue order onto `slots` identical slots."""
    free = [0.0] * slots
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def packed_costs(lengths, order, heads: int, block_m: int, block_n: int, overhead: float, empty: float):
    blocks = math.ceil(max(lengths) / block_m)
    for z in order:
        n = lengths[z]
        for _ in range(heads):
            for x in range(blocks):
                qb = blocks - 1 - x  # heaviest first
                if qb * block_m >= n:
                    yield empty
                else:
                    yield overhead + (min(n, (qb + 1) * block_m) - 1) // block_n + 1


def rates(lengths, heads, block_m, block_n, slots, overhead, empty=0.3):
    """Pairs per unit time: (grid order, longest first) over the dense problem's."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    total = sum(lengths)
    dense = makespan(packed_costs([total], [0], heads, block_m, block_n, overhead, empty), slots)
    dense_rate = total * (total + 1) // 2 / dense
    out = []
    for order in (range(len(lengths)), sorted(range(len(lengths)), key=lambda i: -lengths[i])):
        t = makespan(packed_costs(lengths, order, heads, block_m, block_n, overhead, empty), slots)
        out.append(pairs / t / dense_rate)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--overheads", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                    help="a CTA's fixed cost in key-block times")
    args = ap.parse_args(argv)
    from cupyflash.bench.varlen import NHEADS, draw_lengths

    lengths = draw_lengths()
    print(f"lengths {lengths} ({sum(lengths)} tokens), {NHEADS} heads")
    print("| d | tile | CTAs per SM | overhead | x dense, grid order | x dense, longest first |")
    print("|---|---|---|---|---|---|")
    # the sm_90 bf16 causal forward rows (plans.plan_forward): d64 128 x 64 (58 KiB), d128 128 x 128
    # (193 KiB: one CTA per SM); 132 SMs
    for d, block_n, per_sm in ((64, 64, 2), (64, 64, 3), (128, 128, 1)):
        for overhead in args.overheads:
            grid, longest = rates(lengths, NHEADS, 128, block_n, 132 * per_sm, overhead)
            print(f"| {d} | 128 x {block_n} | {per_sm} | {overhead:g} | {grid:.3f} | {longest:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
