"""A small workload for compute-sanitizer on flash_fwd_wgmma's persistent instances (sm_90, d128
and d64): more tiles than CTAs, so that CTAs run several tiles and the next tile's copies land
while this one's products and epilogue run; a causal problem with more queries than keys, so
that tiles whose rows see no key come between tiles that do; a causal window (short walks).

    compute-sanitizer --tool racecheck python dev/persistent_forward_workload.py
    compute-sanitizer --tool memcheck python dev/persistent_forward_workload.py

Each case's output is also checked against the grid kernel's (mma-fwd-v6) bit for bit.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = (  # (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, causal, window)
    (1, 1024, 1024, 17, 17, 128, False, (-1, -1)),  # 136 tiles on 132 CTAs
    (1, 1024, 512, 34, 17, 128, True, (-1, -1)),    # 272 tiles, half of them without a key
    (1, 1024, 1024, 34, 2, 64, True, (100, 0)),     # d64: two CTAs per SM, a window
)


def main() -> int:
    import cupy
    import ml_dtypes

    from cupyflash.kernels import mma_fwd
    from cupyflash.plans import WgmmaFwdConfig

    rng = np.random.default_rng(0)
    for batch, sq, sk, h, hkv, d, causal, window in CASES:
        q = cupy.asarray(rng.standard_normal((batch, sq, h, d)).astype(ml_dtypes.bfloat16))
        k, v = (cupy.asarray(rng.standard_normal((batch, sk, hkv, d)).astype(ml_dtypes.bfloat16)) for _ in range(2))
        results = []
        for persistent in (True, False):
            o = cupy.full(q.shape, np.nan, q.dtype)
            lse = cupy.full((batch, h, sq), np.nan, np.float32)
            config = WgmmaFwdConfig(128, 64 if d == 64 else 128, persistent=persistent)
            mma_fwd.forward(q, k, v, o, lse, softmax_scale=d ** -0.5, causal=causal, window_size=window,
                            config=config)
            results.append((o.get().view(np.uint16), lse.get().view(np.uint32)))
        same = all(np.array_equal(a, b) for a, b in zip(*results))
        print(f"{(batch, sq, sk, h, hkv, d, causal, window)}: persistent {'==' if same else '!='} grid", flush=True)
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
