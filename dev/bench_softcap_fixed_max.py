"""softcap-fixed-max (docs/perf-log.md): the bfloat16 softcap forward with the cap's bound as every
row's maximum (Score.fixed_max, plans.takes_fixed_max) against the same call with the running
maximum (the rule's range set to 0), beside the plain causal forward, on one machine:

    PYTHONPATH=. python dev/bench_softcap_fixed_max.py [--seqlen 8192] [--rounds 5] [--json OUT]

8k causal d128 bf16, 2 x 16 heads (issue 16's variant shape), fresh normal inputs; each form
checked against the float64 reference on a small causal problem first (the tuner's check), then
timed in rounds that take turns (CUDA events, the median of each form's rounds), with the
kernel each form launched.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import cupy

    from cupyflash import plans
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.kernels import mma_fwd
    from cupyflash.reference import attention
    from cupyflash.scores import Variant

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    bf16 = SUPPORTED["bfloat16"]
    launched = []
    real_launch = mma_fwd.launch

    def recording_launch(spec, grid, params):
        launched.append(spec.name)
        return real_launch(spec, grid, params)

    mma_fwd.launch = recording_launch
    shipped_range = plans.FIXED_MAX_LOG2_RANGE
    forms = {"plain": (None, shipped_range), "softcap 30, running max": (30.0, 0.0),
             "softcap 30, fixed max": (30.0, shipped_range), "softcap 50 (running max)": (50.0, shipped_range)}

    def call(q, k, v, o, lse, cap, log2_range):
        plans.FIXED_MAX_LOG2_RANGE = log2_range
        try:
            mma_fwd.forward(q, k, v, o, lse, softmax_scale=q.shape[3] ** -0.5, causal=True,
                            variant=None if cap is None else Variant(softcap=cap))
        finally:
            plans.FIXED_MAX_LOG2_RANGE = shipped_range

    rng = np.random.default_rng(0)
    # the check: 1 x 300 x 2 heads against float64
    small = [rng.standard_normal((1, 300, 2, 128)).astype(bf16) for _ in range(3)]
    for name, (cap, log2_range) in forms.items():
        q, k, v = (cupy.asarray(x) for x in small)
        o, lse = cupy.full(q.shape, np.nan, bf16), cupy.full((1, 2, 300), np.nan, np.float32)
        call(q, k, v, o, lse, cap, log2_range)
        ref, _ = attention(*(x.astype(np.float64) for x in small), softmax_scale=128 ** -0.5, causal=True,
                                   softcap=cap or 0.0)
        err = float(np.abs(cupy.asnumpy(o).astype(np.float64) - ref).max())
        print(f"check {name}: max |o - o_ref| {err:.2e}")
        assert err < 3e-2, name
    shape = (2, args.seqlen, 16, 128)
    q, k, v = (cupy.asarray(rng.standard_normal(shape).astype(bf16)) for _ in range(3))
    o, lse = cupy.empty_like(q), cupy.empty((2, 16, args.seqlen), np.float32)
    flops = 4 * 2 * 16 * args.seqlen * args.seqlen / 2 * 128
    times = {name: [] for name in forms}
    kernels = {}
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(args.rounds):
        for name, (cap, log2_range) in forms.items():
            for _ in range(3):
                call(q, k, v, o, lse, cap, log2_range)
            launched.clear()
            start.record()
            for _ in range(10):
                call(q, k, v, o, lse, cap, log2_range)
            stop.record()
            stop.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(start, stop) / 10)
            kernels[name] = sorted(set(launched))
    out = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "seqlen": args.seqlen, "forms": {}}
    plain = float(np.median(times["plain"]))
    for name in forms:
        ms = float(np.median(times[name]))
        out["forms"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "of_plain": plain / ms, "rounds": times[name],
                              "kernels": kernels[name]}
        print(f"{name:28} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  {plain / ms:.3f} of plain  {kernels[name]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
