"""wgmma-bwd-ws-v0 on one machine (docs/perf-log.md): the backward's candidates with a producer
warpgroup (kernels_cu/flash_bwd_wgmma_ws.cu, flash_bwd_dq_wgmma_ws.cu) against the shipped kernels.

    PYTHONPATH=. python dev/bench_wgmma_bwd_ws.py warm [--processes N]
        compiles, in parallel into CuPy's cache, every kernel tests/test_wgmma_bwd_ws_gpu.py and the
        tuner's timing of the candidates launch (v13's pair in both 16-bit dtypes, no mask,
        causal and windows, plain, softcap and ALiBi, beside v10's kernels on the same tiles;
        every other entry in bfloat16; the forward that makes o and lse)
    PYTHONPATH=. python dev/bench_wgmma_bwd_ws.py kernels D SEQLEN [causal]
        one backward of v12 (v10's kernels), then one with v13's producer kernels (for ncu:
        flash_bwd_wgmma against flash_bwd_wgmma_ws, flash_bwd_dq_wgmma against
        flash_bwd_dq_wgmma_ws), on the bench's shape (batch * seqlen = 16384 tokens, nheads *
        headdim = 2048), bfloat16

The timing itself is the tuner's: python -m cupyflash tune --direction bwd --headdim 128 64 --seqlen
8192 --only "none dq" wgmma_ws (each entry checked against the float64 reference first)."""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _specs():
    from cupyflash import plans
    from cupyflash.backward_plans import backward_plan
    from cupyflash.bench import tune
    from cupyflash.masks import mask_for
    from cupyflash.scores import PLAIN, Score

    dev = tune.load_dev_backward()
    out = {}
    windows = ((False, (-1, -1)), (True, (-1, -1)), (True, (40, 0)), (False, (40, 7)))

    def add(dtype, dt, rows, scores):
        for causal, window in windows:
            for score in scores:
                mask = mask_for(causal, window, score)
                for row in rows:
                    for launch in backward_plan(dtype, dt, mask, row).launches:
                        out[launch.spec.name] = launch.spec
                fwd = plans.plan_forward("90", dtype, dt, mask, 227 * 1024).spec
                out[fwd.name] = fwd

    for dt in dev.WGMMA_WS_ROUTE:
        # the bitwise test's pair: both producer kernels against the shipped row on the same tiles,
        # both dtypes, every score variant it draws
        both = dev.kernels("v10", "90", None, "bfloat16", dt, False, True, wgmma_ws=dev.WGMMA_WS_ROUTE[dt][0],
                           dq_ws=dev.WGMMA_WS_ROUTE[dt][1])
        shipped = dev.kernels("v10", "90", None, "bfloat16", dt, False, True, wgmma=both.dkdv_tiles[:2],
                              dq_config=tuple(dev.DQ_WGMMA_CONFIG[dt]))
        for dtype in ("bfloat16", "float16"):
            add(dtype, dt, (both, shipped), (PLAIN, Score(softcap=True), Score(alibi=True)))
        # the tuner's entries (bfloat16, plain)
        rows = [dev.kernels(kw["version"], "90", None, "bfloat16", dt, False, True,
                            **{k: kw[k] for k in ("wgmma_ws", "dq_ws") if k in kw})
                for label, kw in dev.entries(dt, "90") if "_ws" in label]
        add("bfloat16", dt, rows, (PLAIN,))
    return list(out.values())


def _compile(names):
    sys.path.insert(0, str(REPO / "scripts"))
    import warm_kernel_cache

    return warm_kernel_cache._compile(names, _specs())


def warm(processes: int) -> int:
    names = [s.name for s in _specs()]
    chunks = [names[i::processes] for i in range(processes)]
    errors = []
    with ProcessPoolExecutor(processes) as pool:
        for _, errs in pool.map(_compile, [c for c in chunks if c]):
            errors.extend(errs)
    print(f"warm: {len(names)} kernels, {len(errors)} errors")
    for e in errors:
        print("  " + e)
    return 1 if errors else 0


def kernels(headdim: int, seqlen: int, causal: bool) -> int:
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_bwd

    import cupy

    dev = tune.load_dev_backward()
    dtype = SUPPORTED["bfloat16"]
    batch, nheads = 16384 // seqlen, 2048 // headdim
    (inputs,) = tune._bwd_inputs(batch, seqlen, nheads, headdim, dtype, causal, n_sets=1)
    for tiles in ({"version": "v12"}, {"wgmma_ws": dev.WGMMA_WS_ROUTE[headdim][0], "dq_ws": dev.WGMMA_WS_ROUTE[headdim][1]}):
        mma_bwd.backward(*inputs, softmax_scale=headdim ** -0.5, causal=causal, deterministic=True, **tiles)
    cupy.cuda.Device().synchronize()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warm")
    w.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    k = sub.add_parser("kernels")
    k.add_argument("headdim", type=int)
    k.add_argument("seqlen", type=int)
    k.add_argument("rest", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "warm":
        return warm(args.processes)
    return kernels(args.headdim, args.seqlen, "causal" in args.rest)


if __name__ == "__main__":
    raise SystemExit(main())
