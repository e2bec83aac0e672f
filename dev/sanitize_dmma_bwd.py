"""The float64 DMMA backward alone, small, for compute-sanitizer (racecheck on the full
``python -m cupyflash sanitize`` workload takes minutes): sm_90's plan rows and the other archs'
rows at d16 / d64 / d128 tiles (sm_90's d128 row: the warp pairs' dK/dV kernel), causal, a window
and a packed batch, both statistics; then the float32 experiment's kernels (tf32x3) at d40 / d128,
and on sm_90 its wgmma candidates (flash_bwd_dkdv_tf32_wgmma, flash_bwd_dq_tf32_wgmma) at d40 / d64
with their three staging modes (raw rows two blocks ahead, one, none), dQ by the dK/dV kernel's
atomics, and the producer warpgroups' dK/dV and dQ (their barriers under racecheck); at d128 / d100
the pair's dK/dV and dQ kernels (tf32-wgmma-bwd-pair).

    compute-sanitizer --tool racecheck python dev/sanitize_dmma_bwd.py [pair]

"pair": the pair's kernels alone.
"""
from __future__ import annotations


def main() -> None:
    import sys

    import cupy
    import numpy as np

    import cupyflash
    from cupyflash.backward_plans import DMMA_BACKWARD_TILES, MMA_SYNC, Tf32WgmmaBwdConfig, tf32x3_backward_config
    from cupyflash.kernels import _module, dmma, simt
    from cupyflash.kernels.params import PackedBatch
    from cupyflash.scores import Variant

    rng = np.random.default_rng(0)
    pair_only = sys.argv[1:] == ["pair"]
    for headdim in () if pair_only else (8, 40, 72, 128):
        for config in (None, DMMA_BACKWARD_TILES[(MMA_SYNC, dmma.d_tile(headdim))]):
            for causal, window in ((True, (-1, -1)), (False, (19, 70))):
                q, do = (cupy.asarray(rng.standard_normal((1, 77, 4, headdim))) for _ in range(2))
                k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, headdim))) for _ in range(2))
                o, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
                for statistics in ("saved", "recomputed"):
                    grads = [cupy.empty_like(x) for x in (q, k, v)]
                    dmma.backward(do, q, k, v, o, lse, *grads, softmax_scale=headdim ** -0.5, causal=causal,
                                  window_size=window, variant=Variant(statistics=statistics), config=config)
    lengths = [0, 33, 90, 7]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    packed = PackedBatch(cu, cu, max(lengths), max(lengths))
    if not pair_only:
        q, k, v, do = (cupy.asarray(rng.standard_normal((1, sum(lengths), 4, 64))) for _ in range(4))
        o, lse = cupy.empty_like(q), cupy.empty((1, 4, sum(lengths)))
        simt.forward(q, k, v, o, lse, softmax_scale=0.125, causal=True, packed=packed)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        dmma.backward(do, q, k, v, o, lse, *grads, softmax_scale=0.125, causal=True, packed=packed,
                      variant=Variant(statistics="recomputed"))
    for headdim in () if pair_only else (40, 128):  # the float32 experiment on the same kernels
        q, do = (cupy.asarray(rng.standard_normal((1, 77, 4, headdim), np.float32)) for _ in range(2))
        k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, headdim), np.float32)) for _ in range(2))
        o, lse = cupy.empty_like(q), cupy.empty((1, 4, 77), np.float32)
        simt.forward(q, k, v, o, lse, softmax_scale=headdim ** -0.5, causal=True)
        for statistics in ("saved", "recomputed"):
            grads = [cupy.empty_like(x) for x in (q, k, v)]
            dmma.backward(do, q, k, v, o, lse, *grads, softmax_scale=headdim ** -0.5, causal=True,
                          variant=Variant(statistics=statistics), config=tf32x3_backward_config(headdim))
    pairs = ((128, Tf32WgmmaBwdConfig(32, 0, dq_block_n=0, pair=True)),
             (100, Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True, dq_pair=True)),
             (72, Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True, dq_pair=True, prefetch=True)))
    if _module.device_arch() == "90":  # the wgmma candidates: GQA, a ragged last block of each side
        for headdim, config in pairs if pair_only else ((40, Tf32WgmmaBwdConfig()), (64, Tf32WgmmaBwdConfig(64, 0, False, 64, 1)),
                                (64, Tf32WgmmaBwdConfig(32, 0, True, 32, 0)), (56, Tf32WgmmaBwdConfig(fused_dq=True)),
                                (64, Tf32WgmmaBwdConfig(32, 1, producer=True)),
                                (48, Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True)),
                                (64, Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True,
                                                        dq_consumers=2)),
                                (52, Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=0, dq_producer=True,
                                                        dq_presplit=True)),
                                (44, Tf32WgmmaBwdConfig(32, 0, producer=True, presplit=True, dq_raw_stages=0,
                                                        dq_producer=True, dq_consumers=2, dq_presplit=True)),
                                *pairs):
            q, do = (cupy.asarray(rng.standard_normal((1, 77, 4, headdim), np.float32)) for _ in range(2))
            k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, headdim), np.float32)) for _ in range(2))
            o, lse = cupy.empty_like(q), cupy.empty((1, 4, 77), np.float32)
            for causal, window in ((True, (-1, -1)), (False, (19, 70))):
                simt.forward(q, k, v, o, lse, softmax_scale=headdim ** -0.5, causal=causal, window_size=window)
                grads = [cupy.empty_like(x) for x in (q, k, v)]
                dmma.backward(do, q, k, v, o, lse, *grads, softmax_scale=headdim ** -0.5, causal=causal,
                              window_size=window, config=config, deterministic=not config.fused_dq)
        for headdim, config in pairs:  # and a packed batch with an empty sequence
            q, k, v, do = (cupy.asarray(rng.standard_normal((1, sum(lengths), 4, headdim), np.float32))
                           for _ in range(4))
            o, lse = cupy.empty_like(q), cupy.empty((1, 4, sum(lengths)), np.float32)
            simt.forward(q, k, v, o, lse, softmax_scale=headdim ** -0.5, causal=True, packed=packed)
            grads = [cupy.empty_like(x) for x in (q, k, v)]
            dmma.backward(do, q, k, v, o, lse, *grads, softmax_scale=headdim ** -0.5, causal=True, packed=packed,
                          config=config)
    cupy.cuda.runtime.deviceSynchronize()
    print("sanitize_dmma_bwd: done")


if __name__ == "__main__":
    main()
