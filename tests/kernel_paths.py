"""The GPU kernel paths the property tests run, by family: SIMT for float32/float64; for
float16/bfloat16 the device's default tensor-core kernels (on sm_90: flash_fwd_wgmma and the v10
wgmma backward; on sm_80: flash_fwd_mma and the mma.sync backward), and the mma.sync kernels of
sm_80 on any device through their overrides: ``mma_fwd.forward(config=FwdConfig(...))``
(flash_fwd_mma) and ``mma_bwd.backward(version=...)`` ("v5": v3's two kernels when
deterministic, the fused kernel otherwise; "v3" without determinism: the atomic dK/dV kernels
that run where the fused one does not fit). Outputs are NaN-poisoned before each launch."""
from __future__ import annotations

import numpy as np

from tolerance import SIXTEEN_BIT

# The sm_80 forward tiles (flash_fwd_mma) by head-dim tile, launched on any device by config=.
SM80_FWD = {64: dict(block_m=128, block_n=64, warps=4, q_in_regs=True, min_blocks=2, row_state="all_lanes"),
            128: dict(block_m=128, block_n=32, warps=4, q_in_regs=False, min_blocks=2),
            256: dict(block_m=128, block_n=32, warps=8, q_in_regs=False)}
# (version, deterministic) of the mma.sync backward paths (mma_bwd.backward's notes).
MMA_SYNC_BWD = [("v5", True), ("v5", False), ("v3", False)]


def _nan(shape, dtype):
    import cupy

    return cupy.full(shape, np.nan, dtype=dtype)


def _d_tile(headdim):
    return next(t for t in (64, 128, 256) if headdim <= t)


def run_path(case, window, q, k, v, do, deterministic=True, mma_sync=None, variant=None):
    """(o, lse, dq, dk, dv) as NumPy arrays from the family that serves case.dtype; ``mma_sync`` a
    (version, deterministic) of MMA_SYNC_BWD runs the sm_80 kernels instead of the device's;
    ``variant`` the variant keyword arguments (softcap, alibi_slopes, sink: tests/variants.py)."""
    import cupy

    from cupyflash.kernels import mma_bwd, mma_fwd, simt
    from cupyflash.scores import Variant

    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    acc = np.float64 if case.dtype == np.float64 else np.float32
    o = _nan(q.shape, q.dtype)
    lse = _nan((case.batch, case.nheads, case.seqlen_q), acc)
    grads = [_nan(x.shape, x.dtype) for x in (q, k, v)]
    options = dict(softmax_scale=case.scale, causal=case.causal, window_size=window)
    if variant:
        options["variant"] = Variant(**variant).to(cupy)
    if mma_sync is not None:
        version, deterministic = mma_sync
        config = mma_fwd.FwdConfig(**SM80_FWD[_d_tile(case.headdim)])
        mma_fwd.forward(qd, kd, vd, o, lse, config=config, **options)
        mma_bwd.backward(dod, qd, kd, vd, o, lse, *grads, deterministic=deterministic, version=version, **options)
    elif case.dtype in SIXTEEN_BIT:
        mma_fwd.forward(qd, kd, vd, o, lse, **options)
        mma_bwd.backward(dod, qd, kd, vd, o, lse, *grads, deterministic=deterministic, **options)
    else:
        simt.forward(qd, kd, vd, o, lse, **options)
        simt.backward(dod, qd, kd, vd, o, lse, *grads, deterministic=deterministic, **options)
    cupy.cuda.get_current_stream().synchronize()
    return tuple(x.get() for x in (o, lse, *grads))
