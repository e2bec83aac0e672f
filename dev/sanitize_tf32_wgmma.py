"""The float32 forward on tf32 wgmma (flash_fwd_tf32_wgmma, candidates no plan routes to) alone,
small, for compute-sanitizer: every candidate of dev/bench_tf32_wgmma.py (v0 .. v2, and the staged-Q
form of tf32-wgmma-d128 at d64 and d128), head dims
40 / 64 / 128, full, causal and a window, GQA, v's own head dim, a packed batch with an empty
sequence, both precisions. sm_90 only.

    compute-sanitizer --tool racecheck python dev/sanitize_tf32_wgmma.py [NAME_REGEX]

NAME_REGEX (optional) keeps the candidates whose names it matches ("qstaged": the staged-Q forms
alone, which the whole list's racecheck does not reach in 140 s).
"""
from __future__ import annotations


def main() -> None:
    import cupy
    import numpy as np

    import re
    import sys
    from pathlib import Path

    from cupyflash.kernels import mma_fwd
    from cupyflash.kernels.params import PackedBatch
    from cupyflash.scores import Variant

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_tf32_wgmma import candidates

    keep = re.compile(sys.argv[1] if len(sys.argv) > 1 else "")

    def kept(headdim: int) -> list:
        return [c for name, c in candidates(headdim).items() if keep.search(name)]

    rng = np.random.default_rng(0)
    for headdim, headdim_v, config in ((h, hv, c) for h, hv in ((40, 40), (64, 64), (128, 128), (64, 128))
                                       for c in kept(max(h, hv))):
        for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (19, 70))):
            # (chains of 4 are the apart sums' alone: "ieee" only, plans.specialization_for)
            for precision in ("ieee",) if config.hh_chain != 2 else ("ieee", "tf32"):
                q = cupy.asarray(rng.standard_normal((1, 77, 4, headdim), np.float32))
                k = cupy.asarray(rng.standard_normal((1, 130, 2, headdim), np.float32))
                v = cupy.asarray(rng.standard_normal((1, 130, 2, headdim_v), np.float32))
                o = cupy.empty((1, 77, 4, headdim_v), np.float32)
                lse = cupy.empty((1, 4, 77), np.float32)
                mma_fwd.forward(q, k, v, o, lse, softmax_scale=headdim ** -0.5, causal=causal,
                                window_size=window, variant=Variant(precision=precision), config=config)
    lengths = [0, 33, 90, 7]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    q, k, v = (cupy.asarray(rng.standard_normal((1, sum(lengths), 4, 64), np.float32)) for _ in range(3))
    o, lse = cupy.empty_like(q), cupy.empty((1, 4, sum(lengths)), np.float32)
    for config in kept(64):
        mma_fwd.forward(q, k, v, o, lse, softmax_scale=0.125, causal=True,
                        packed=PackedBatch(cu, cu, max(lengths), max(lengths)), config=config)
    cupy.cuda.runtime.deviceSynchronize()
    print("sanitize_tf32_wgmma: done")


if __name__ == "__main__":
    main()
