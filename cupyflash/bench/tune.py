"""``python -m cupyflash.bench.tune``: time every candidate tile configuration of the tensor-core
forward kernel (the default the current device launches, every earlier default in
``mma_fwd.VERSIONS`` and ``mma_fwd.CANDIDATES``) on the papers' shapes, after checking each
against the float64 reference on a small odd shape. The winners go into ``mma_fwd.CONFIGS`` (or
``LARGE_SMEM_CONFIGS``) by hand, as a new VERSIONS entry, with the numbers in docs/perf-log.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np


def _time_ms(fn, input_sets, repeats: int) -> float:
    import cupy

    for inputs in input_sets:
        fn(*inputs)  # compile and warm up
    times = []
    for i in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        inputs = input_sets[i % len(input_sets)]
        start.record()
        fn(*inputs)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def _inputs(batch, seqlen, nheads, headdim, dtype, n_sets=3, seed=0):
    import cupy

    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        q, k, v = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim)).astype(dtype))
                   for _ in range(3))
        o = cupy.empty_like(q)
        lse = cupy.empty((batch, nheads, seqlen), dtype=np.float32)
        sets.append((q, k, v, o, lse))
    return sets


def _check(config, headdim, dtype, causal) -> float:
    """Max error of the configuration on an odd shape, relative to 2x the error of standard
    attention in the same dtype (<= 1 passes)."""
    import cupy

    from .. import reference
    from ..kernels import mma_fwd

    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 333, 4, headdim)).astype(dtype)
    k, v = (rng.standard_normal((2, 301, 2, headdim)).astype(dtype) for _ in range(2))
    o = cupy.full(q.shape, np.nan, dtype=dtype)
    lse = cupy.full((2, 4, 333), np.nan, dtype=np.float32)
    mma_fwd.forward(*(cupy.asarray(x) for x in (q, k, v)), o, lse, softmax_scale=headdim ** -0.5,
                    causal=causal, config=config)
    ref, _ = reference.attention(q, k, v, causal=causal)
    std, _ = reference.standard_attention(q, k, v, causal=causal, dtype=dtype)
    err = np.abs(o.get().astype(np.float64) - ref).max()
    allowed = 2 * np.abs(std.astype(np.float64) - ref).max() + 1e-4
    return float(err / allowed) if np.isfinite(err) else float("inf")


def _configs(mma_fwd, dt: int) -> list[tuple[str, object]]:
    """[(label, config)] to time for head-dim tile ``dt``, each configuration once: the current
    device's default, then the VERSIONS entries (labelled by version) and CANDIDATES ("cand")."""
    entries = [("default", mma_fwd.default_config(dt, mma_fwd.current_smem_optin()))]
    entries += [(name, table[dt]) for name, (_, table) in mma_fwd.VERSIONS.items() if dt in table]
    entries += [("cand", c) for c in mma_fwd.CANDIDATES.get(dt, ())]
    labels: dict = {}
    for label, config in entries:
        labels.setdefault(config, []).append(label)
    return [("+".join(names), config) for config, names in labels.items()]


def main(argv=None) -> int:
    from ..kernels import mma_fwd
    from .._dtypes import SUPPORTED

    parser = argparse.ArgumentParser(prog="python -m cupyflash.bench.tune", description=__doc__)
    parser.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    dtype = SUPPORTED[args.dtype]
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6}  {'label':8} {'config':58} {'check':>6} {'ms':>8} {'TFLOP/s':>8}")
    for headdim in args.headdim:
        for label, config in _configs(mma_fwd, mma_fwd.d_tile(headdim)):
            try:
                checks = [_check(config, headdim, dtype, causal) for causal in (False, True)]
            except Exception as e:  # a candidate that does not fit this GPU
                print(f"{headdim:>4} {'':>6} {'':>6}  {label:8} {str(config)[9:]:58} skipped: {e}")
                continue
            for seqlen in args.seqlen:
                batch, nheads = 16384 // seqlen, 2048 // headdim
                sets = _inputs(batch, seqlen, nheads, headdim, dtype)
                for causal in (False, True):
                    ms = _time_ms(lambda q, k, v, o, lse: mma_fwd.forward(
                        q, k, v, o, lse, softmax_scale=headdim ** -0.5, causal=causal, config=config),
                        sets, args.repeats)
                    flops = 4 * batch * nheads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
                    ok = "ok" if max(checks) <= 1 else f"x{max(checks):.1f}"
                    print(f"{headdim:>4} {seqlen:>6} {str(causal):>6}  {label:8} {str(config)[9:]:58} {ok:>6} "
                          f"{ms:8.3f} {flops / ms / 1e9:8.1f}", flush=True)
                del sets
    return 0


if __name__ == "__main__":
    sys.exit(main())
