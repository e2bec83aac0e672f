"""The producer / ping-pong 16-bit forward (flash_fwd_wgmma_ws: the last dev/mma_fwd.py version's
producer rows, sm_90's d128 since wgmma-fwd-ws-route, and the WS_CANDIDATES) alone, small, for
compute-sanitizer: each configuration on a 300-token bf16 batch of two heads, causal and not,
NaN-poisoned outputs checked finite. sm_90 only.

    compute-sanitizer --tool racecheck python dev/sanitize_wgmma_ws.py

Run on an H100 (2026-12-06) with four configurations (d64 / d128 / d256, with and without the
turns): racecheck 0 hazards, memcheck 0 errors (docs/results/2026-12-06-session7-wgmma-ws-tests-h100.txt);
then on the routed configuration and those four (docs/results/2026-12-06-session8-gpu-h100.txt): the same.
"""
from __future__ import annotations


def main() -> None:
    import cupy
    import numpy as np

    from cupyflash._dtypes import SUPPORTED
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_fwd

    dtype = SUPPORTED["bfloat16"]
    rng = np.random.default_rng(1)
    for _, d_tile, config in tune.load_dev_forward().producer_configs():
        for causal in (False, True):
            q, k, v = (cupy.asarray(rng.standard_normal((1, 300, 2, d_tile)).astype(dtype)) for _ in range(3))
            o = cupy.full_like(q, np.nan)
            lse = cupy.full((1, 2, 300), np.nan, np.float32)
            mma_fwd.forward(q, k, v, o, lse, softmax_scale=d_tile ** -0.5, causal=causal, config=config)
            cupy.cuda.runtime.deviceSynchronize()
            assert bool(cupy.isfinite(o).all()) and bool(cupy.isfinite(lse).all()), (config, causal)
            print(f"d{d_tile} {config} causal={causal}: finite")


if __name__ == "__main__":
    main()
