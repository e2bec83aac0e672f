"""Small forwards of the producer-warpgroup candidates (flash_fwd_tf32_wgmma_ws, perf log
tf32-wgmma-v2: as measured, with the consumers taking turns (pingpong), and that with SUMS_APART)
against the float64 reference, before anything longer runs them: a barrier parity or a turn
wrong would hang here, under a short timeout, not inside a test shard or the bench. The last
shape (200 queries, 7 keys, causal) gives its first query block no key block at all, so a consumer
with no turns to take must still keep the other's turns balanced. (A dense call with 0 keys is not
this function's input: the API answers it without a launch, and mma_fwd refuses its strides.)

    timeout 90 python dev/smoke_tf32_wgmma_ws.py

Exit status 0: the outputs are within the float32 rule; 1: they are not; a hang: the timeout's.
"""
from __future__ import annotations

import sys


def main() -> int:
    import cupy
    import numpy as np

    from cupyflash import reference
    from cupyflash.kernels import mma_fwd
    from cupyflash.plans import WgmmaTf32FwdConfig
    from cupyflash.testing.tolerance import RTOL, max_abs_error

    rng = np.random.default_rng(7)
    configs = {"v2": WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4),
               "v2 presplit": WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=4, presplit=True),
               "v2 pingpong": WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4, pingpong=True),
               "v2 pingpong apart": WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4, pingpong=True,
                                                       sums_apart=True)}
    worst = 0.0
    for (name, config), (seqlen_q, seqlen_k, causal) in ((c, s) for c in configs.items() for s in
                                                         ((256, 256, True), (130, 333, False), (64, 7, False),
                                                          (200, 7, True))):
        q = rng.standard_normal((2, seqlen_q, 4, 64)).astype(np.float32)
        k, v = (rng.standard_normal((2, seqlen_k, 2, 64)).astype(np.float32) for _ in range(2))
        o = cupy.full(q.shape, np.nan, np.float32)
        lse = cupy.full((2, 4, seqlen_q), np.nan, np.float32)
        mma_fwd.forward(*(cupy.asarray(x) for x in (q, k, v)), o, lse, softmax_scale=0.125, causal=causal,
                        config=config)
        cupy.cuda.runtime.deviceSynchronize()
        o_ref, _ = reference.attention(q, k, v, softmax_scale=0.125, causal=causal)
        err = max_abs_error(cupy.asnumpy(o), o_ref) / (1 + float(np.abs(o_ref).max()))
        print(f"smoke tf32 wgmma ws, {name}: {seqlen_q} x {seqlen_k} causal={causal}: relative error {err:.3g}",
              flush=True)
        worst = max(worst, err)
    return 0 if worst <= RTOL[np.dtype(np.float32)] else 1


if __name__ == "__main__":
    sys.exit(main())
