"""What a CTA's short walk costs: causal sliding windows of growing width at one shape, forward
and backward, and a straight-line fit of time against the key blocks the forward visits.

    python dev/window_overhead_study.py [--seqlen 16384] [--windows 256 1024 4096] [--json out.json]
    python dev/window_overhead_study.py --configs local v7   # the forward alone, per tile config

--configs times only the forward, launched with each named tile configuration (a dev/mma_fwd.py
version at d128, "wsN": its WS_CANDIDATES[128][N], or "local": plans.LOCAL_FORWARD_TILES' window
row) and fitted in that
configuration's own blocks (its block_m x block_n tiles), so the fixed cost of a tile can be
compared between the one-role kernel's window tiles and the producer kernel (v7).

(Branch experiment/persistent-forward has a --tiles option that also times the rejected
persistent forward, perf log mma-fwd-v7.)

Why: at 16k a causal window of 1024 runs at 0.73-0.75 of the causal kernel's TFLOP/s over the
visible pairs (perf log, mask-policy), where the tiles alone allow 0.89. Every CTA of the forward
runs one walk of ~9 key blocks instead of causal's 64 on average, so whatever a CTA pays once
(Q and the first K/V tiles before the first product, the epilogue's O store) weighs 7x more. The
fit t = a * blocks + c over the windows (default 256 .. 4096 keys) (the CTA count is the same for all of
them: one per query block and head) gives a, the time per visited block, and c, the time all
CTAs pay besides; c / (a * CTAs) is that fixed cost in block iterations per CTA, which is what a
persistent kernel that overlaps one tile's epilogue and the next one's prologue could hide. The
backward is fitted against the same regressor (the forward's visited blocks and query-block
tiles), so its figure is in those units, not per backward CTA.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupyflash.bench import variants as V  # noqa: E402

BLOCK = 128  # flash_fwd_wgmma's query and key tiles at d128 (plans.FORWARD_TILES)


def forward_blocks(seqlen: int, left: int, block_m: int = BLOCK, block_n: int = BLOCK) -> int:
    """Key blocks of ``block_n`` keys all query blocks (``block_m`` rows) of one head visit with a
    causal window of ``left`` keys (-1: plain causal), from the definition (query i sees keys
    i - left .. i)."""
    total = 0
    for m0 in range(0, seqlen, block_m):
        last_row = min(m0 + block_m, seqlen) - 1
        first_key = 0 if left < 0 else max(0, m0 - left)
        total += last_row // block_n - first_key // block_n + 1
    return total


def forward_configs(names: list[str], seqlen: int, batch: int, heads: int, windows: list[int]) -> None:
    """The forward alone with each named tile configuration: time against visited blocks, fitted."""
    import cupy

    from cupyflash import plans
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_fwd

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_statistics import time_ms

    dev = tune.load_dev_forward(Path(__file__).resolve().parent)
    q, k, v = (cupy.asarray(x) for x in V._inputs(batch, seqlen, heads, (128, 128), 1, 0)[0][:3])
    o, lse = cupy.empty_like(q), cupy.empty((batch, heads, seqlen), np.float32)
    for name in names:
        if name == "local":
            config = plans.LOCAL_FORWARD_TILES[("mma", plans.SM90, 128)]
        elif name.startswith("ws") and name[2:].isdigit():
            config = dev.WS_CANDIDATES[128][int(name[2:])]
        else:
            config = next(ver for ver in dev.VERSIONS if ver.name == name).tiles[128]
        rows = []
        for left in [*windows, -1]:
            window = (-1, -1) if left < 0 else (left, 0)
            ms = time_ms(lambda: mma_fwd.forward(q, k, v, o, lse, softmax_scale=128 ** -0.5, causal=True,
                                                 window_size=window, config=config), 20)
            pairs = V.pairs_of(V.Variant("", True, window), seqlen)
            blocks = forward_blocks(seqlen, left, config.block_m, config.block_n) * batch * heads
            rows.append((left, blocks, ms, 4.0 * batch * heads * pairs * 128 / (ms * 1e-3) / 1e12))
            print(f"{name} left {left:>5}: blocks {blocks:>7}  fwd {ms:8.3f} ms {rows[-1][3]:6.1f} TFLOP/s", flush=True)
        ctas = math.ceil(seqlen / config.block_m) * batch * heads
        a, c = np.polyfit([r[1] for r in rows[:-1]], [r[2] for r in rows[:-1]], 1)
        print(f"{name} {config}: {a * 1e3:.4f} us per visited block, intercept {c:.3f} ms = "
              f"{c / (a * ctas):.2f} block iterations per CTA ({ctas} tiles); window {windows[-1]} at "
              f"{rows[-2][3] / rows[-1][3]:.2f} of causal's TFLOP/s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--configs", nargs="+", help="time the forward alone with these tiles (see above)")
    args = parser.parse_args(argv)
    if args.configs:
        forward_configs(args.configs, args.seqlen, args.batch, args.heads, args.windows)
        return 0
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    with stream:
        sets = V._inputs(args.batch, args.seqlen, args.heads, (128, 128), 2, 0)
        for left in [*args.windows, -1]:
            variant = V.Variant("causal" if left < 0 else f"causal window {left}", True,
                                (-1, -1) if left < 0 else (left, 0))
            fwd, bwd = V._cupyflash_runs(variant, sets)
            pairs = V.pairs_of(variant, args.seqlen)
            flops = 4.0 * args.batch * args.heads * pairs * 128
            row = {"left": left, "pairs": pairs, "blocks": forward_blocks(args.seqlen, left) * args.batch * args.heads}
            for mode, fn, f in (("fwd", fwd, flops), ("bwd", bwd, 2.5 * flops)):
                ms = V._time(fn, 2, stream)
                row[f"{mode}_ms"], row[f"{mode}_tflops"] = ms, f / (ms * 1e-3) / 1e12
            rows.append(row)
            print(f"left {left:>5}: blocks {row['blocks']:>7}  fwd {row['fwd_ms']:8.3f} ms {row['fwd_tflops']:6.1f}"
                  f"  bwd {row['bwd_ms']:8.3f} ms {row['bwd_tflops']:6.1f} TFLOP/s", flush=True)
    ctas = math.ceil(args.seqlen / BLOCK) * args.batch * args.heads
    windows = [r for r in rows if r["left"] >= 0]
    causal = next(r for r in rows if r["left"] < 0)
    for r in windows:
        print(f"left {r['left']:>5}: fwd {r['fwd_tflops'] / causal['fwd_tflops']:.2f} / bwd "
              f"{r['bwd_tflops'] / causal['bwd_tflops']:.2f} of causal's TFLOP/s, "
              f"{causal['fwd_ms'] / r['fwd_ms']:.2f}x / {causal['bwd_ms'] / r['bwd_ms']:.2f}x faster")
    fit = {}
    for mode in ("fwd", "bwd"):
        a, c = np.polyfit([r["blocks"] for r in windows], [r[f"{mode}_ms"] for r in windows], 1)
        fit[mode] = {"ms_per_block": a, "intercept_ms": c, "fixed_blocks_per_cta": c / (a * ctas)}
        print(f"{mode}: {a * 1e3:.4f} us per visited block, intercept {c:.3f} ms = "
              f"{c / (a * ctas):.2f} block iterations per CTA ({ctas} query-block tiles)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "fit": fit, "ctas": ctas}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
