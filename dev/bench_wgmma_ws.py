"""wgmma-fwd-ws-v0 (docs/perf-log.md): the producer / ping-pong forward's candidates
(dev/mma_fwd.py WS_CANDIDATES) beside the shipped plan, on one machine:

    PYTHONPATH=. python dev/bench_wgmma_ws.py [OUT.json]
    PYTHONPATH=. python dev/bench_wgmma_ws.py --variants

The candidates' and the plan's kernels (no mask, causal) are compiled side by side first; then
each is checked against float64 (the tuner's check: error over twice standard attention's, <= 1
passes), then timed on the tuner's shapes (16k tokens, 2048 model dim, bf16; 2k / 8k / 16k,
causal or not), the plan first, each row's ratio to it. A wrong barrier parity hangs: run it
under a timeout (scripts/gpu_check.sh wgmma_ws does). --variants: the score variants (plain,
softcap 30, dropout 0.1, ALiBi) at 8k causal d128 in the plan's kernel and the d128 candidates.
Run on an H100 (2026-12-06): docs/results/2026-12-06-session7-wgmma-ws-*-h100.*.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def candidate_configs() -> list:
    """(head-dim tile, label, config): the plan's, v6's where the plan's differs (the one-role
    kernel: sm_90's d128 row before wgmma-fwd-ws-route), then each candidate."""
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_fwd
    dev = tune.load_dev_forward()
    out = []
    for dt in (64, 128, 256):
        default = mma_fwd.plan(SUPPORTED["bfloat16"], dt, True).tiles
        out.append((dt, "default", default))
        v6 = next(v for v in dev.VERSIONS if v.name == "v6").tiles[dt]
        if v6 != default:
            out.append((dt, "v6", v6))
        for c in dev.WS_CANDIDATES[dt]:
            out.append((dt, f"ws s{c.stages}{' pp' if c.pingpong else ''}", c))
    return out


def warm(item) -> str:
    """Compile one configuration's kernels (no mask, causal) into CuPy's cache."""
    dt, label, c = item
    from cupyflash import plans
    from cupyflash.kernels import _module
    from cupyflash.masks import NoMask, Causal
    t0 = time.time()
    for m in (NoMask(), Causal()):
        _module.get_function(plans.specialization_for("bfloat16", dt, m, c))
    return f"{dt} {label}: compiled in {time.time() - t0:.0f} s"


def variants() -> None:
    """The score variants at 8k causal d128 (2 x 16 heads) in the plan's kernel and in the d128
    candidates, median of 20: plain, softcap 30, dropout 0.1, ALiBi."""
    import cupy
    import numpy as np

    from cupyflash._dtypes import SUPPORTED
    from cupyflash.dropout import Dropout
    from cupyflash.kernels import mma_fwd
    from cupyflash.scores import Variant

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_statistics import time_ms

    dtype = SUPPORTED["bfloat16"]
    configs = [(label, c) for dt, label, c in candidate_configs() if dt == 128]
    batch, seqlen, nheads, d = 2, 8192, 16, 128
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, d)).astype(dtype)) for _ in range(3))
    o, lse = cupy.empty_like(q), cupy.empty((batch, nheads, seqlen), np.float32)
    slopes = cupy.asarray(np.linspace(0.05, 0.5, nheads).astype(np.float32))
    for name, variant in (("plain", None), ("softcap 30", Variant(softcap=30.0)),
                          ("dropout 0.1", Variant(dropout=Dropout(0.1, 1234, 0))), ("alibi", Variant(alibi_slopes=slopes))):
        for label, config in configs:
            def call():
                mma_fwd.forward(q, k, v, o, lse, softmax_scale=d ** -0.5, causal=True, config=config, variant=variant)
            ms = time_ms(call, 20)
            tflops = 4 * batch * nheads * seqlen * seqlen * d * 0.5 / ms / 1e9
            print(f"{seqlen} causal d128 {name:11s} {label:12s} {ms:.3f} ms {tflops:.1f} TFLOP/s", flush=True)


def main():
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.bench import tune
    items = candidate_configs()
    with ProcessPoolExecutor(max_workers=len(items), mp_context=mp.get_context("spawn")) as pool:
        for line in pool.map(warm, items):
            print(line, flush=True)
    dtype = SUPPORTED["bfloat16"]
    rows = []
    for dt, label, c in items:
        for causal in (False, True):
            err = tune._check(c, dt, dtype, causal)
            print(f"d{dt} {label} causal={causal}: check {err:.3f}", flush=True)
    inputs = {}
    for dt in (64, 128, 256):
        for seqlen in (2048, 8192, 16384):
            for causal in (False, True):
                base = None
                for d2, label, c in items:
                    if d2 != dt:
                        continue
                    ms = tune._time_forward(c, dt, seqlen, causal, dtype, 20, inputs)
                    flops = 4 * 16384 * seqlen * 2048 * (0.5 if causal else 1.0)  # the tuner's count
                    tf = flops / ms / 1e9
                    base = base or tf
                    rows.append((dt, seqlen, causal, label, ms, tf, tf / base))
                    print(f"d{dt} {seqlen:5d} causal={causal!s:5} {label:12s} {ms:7.3f} ms {tf:6.1f} TFLOP/s x{tf / base:.3f}", flush=True)
    if len(sys.argv) > 1 and not sys.argv[1].startswith("--"):
        json.dump(rows, open(sys.argv[1], "w"))


if __name__ == "__main__":
    if "--variants" in sys.argv:
        variants()
    else:
        main()
