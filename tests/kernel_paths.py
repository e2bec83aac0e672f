"""The GPU kernel paths the property tests run, by family: for float32 the SIMT forward and the
plan's backward (tf32x3 on the DMMA backward's kernels up to d128, launched at any head dim, and on
sm_90 the tf32 wgmma route at head dims 40-64 in multiples of 4; SIMT past d128), and for float64 the DMMA kernels (flash_fwd_dmma and the DMMA backward, the defaults up
to d128, launched at any head dim) or SIMT's past d128; for float16/bfloat16 the device's default tensor-core kernels (on sm_90: flash_fwd_wgmma and the v10
wgmma backward; on sm_80: flash_fwd_mma and the mma.sync backward), and the mma.sync kernels of
sm_80 on any device through their overrides: ``mma_fwd.forward(config=FwdConfig(...))``
(flash_fwd_mma) and ``mma_bwd.backward(version=...)`` ("v5": v3's two kernels when
deterministic, the fused kernel otherwise; "v3" without determinism: the atomic dK/dV kernels
that run where the fused one does not fit). Outputs are NaN-poisoned before each launch."""
from __future__ import annotations

import numpy as np

from cupyflash import reference
from tolerance import SIXTEEN_BIT, assert_close, max_abs, output_rounding_allowance, references_and_baselines

# The sm_80 forward tiles (flash_fwd_mma) by head-dim tile, launched on any device by config=.
SM80_FWD = {64: dict(block_m=128, block_n=64, warps=4, q_in_regs=True, min_blocks=2, row_state="all_lanes"),
            128: dict(block_m=128, block_n=32, warps=4, q_in_regs=False, min_blocks=2),
            256: dict(block_m=128, block_n=32, warps=8, q_in_regs=False)}
# (version, deterministic) of the mma.sync backward paths (mma_bwd.backward's notes).
MMA_SYNC_BWD = [("v5", True), ("v5", False), ("v3", False)]
# Cost bounds of the GPU properties' problems: the default kernels', and the override paths'
# (small shapes, so that 200 examples stay within the budget).
GPU_MAX_COST = 4e7
SMALL_COST = 4e6


def mma_case(max_cost=GPU_MAX_COST, **kw):
    """attention_case, with the 16-bit problems the tensor-core kernels take (head dims multiples
    of 8 up to 256)."""
    from strategies import attention_case

    return attention_case(max_cost=max_cost, **kw).filter(
        lambda c: c.dtype not in SIXTEEN_BIT or (c.headdim % 8 == 0 and c.headdim <= 256))


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

    from cupyflash.kernels import dmma, mma_bwd, mma_fwd, simt
    from cupyflash.scores import Variant

    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    acc = np.float64 if case.dtype == np.float64 else np.float32
    o = _nan(q.shape[:3] + v.shape[3:], q.dtype)  # o has v's head dim (headdim_v may differ from q's)
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
        up_to_d128 = max(q.shape[3], v.shape[3]) <= dmma.D_TILES[-1]
        on_dmma = case.dtype == np.float64 and up_to_d128
        (dmma.forward if on_dmma else simt.forward)(qd, kd, vd, o, lse, **options)
        # the backward plans up to d128: float64's DMMA kernels (dmma-bwd-v0), float32's tf32x3 on
        # the same kernels (tf32x3-route) or sm_90's tf32 wgmma route (tf32-wgmma-bwd-route); the SIMT plan where the device lacks the shared memory or
        # the tensor cores
        (dmma.backward if up_to_d128 else simt.backward)(dod, qd, kd, vd, o, lse, *grads, deterministic=deterministic,
                                                         **options)
    cupy.cuda.get_current_stream().synchronize()
    return tuple(x.get() for x in (o, lse, *grads))


def check_against_reference(case, window, q, k, v, do, o, lse, grads, variant=None, dsink=None):
    """The tolerance rule (tolerance.py) for (o, lse, dq, dk, dv) of a kernel path, and dsink when
    given, against the float64 reference with the case's mask, ``window`` and ``variant`` (the
    variant keyword arguments); rows that see no key: o = 0 and zero dq."""
    variant = variant or {}
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=window, **variant)
    (o_ref, lse_ref, grads_ref), (o_std, lse_std, grads_std) = references_and_baselines(
        do, q, k, v, dtype=case.dtype, **kwargs)
    dsink_ref = grads_ref[3] if len(grads_ref) == 4 else None
    grads_ref, grads_std = grads_ref[:3], grads_std[:3]
    for name, x in zip(("o", "dq", "dk", "dv"), (o, *grads)):
        assert np.isfinite(x.astype(np.float64)).all(), f"{name}: NaN or inf (an unwritten or poisoned entry)"
    assert (np.isneginf(lse) == np.isneginf(lse_ref)).all(), "lse = -inf exactly where the reference's is"
    hidden_rows = ~reference.visible_keys(case.seqlen_q, case.seqlen_k, case.causal, window).any(axis=1)
    assert (o[:, hidden_rows] == 0).all() and (grads[0][:, hidden_rows] == 0).all(), "rows that see no key"
    assert_close("o", o, o_ref, o_std, dtype=case.dtype)
    assert_close("lse", lse, lse_ref, lse_std, dtype=case.dtype)
    grad_scale = max(max_abs(g) for g in grads_ref)
    allowances = output_rounding_allowance(do, q, k, v, o, o_ref, **kwargs)
    for name, grad, ref, std, atol in zip(("dq", "dk", "dv"), grads, grads_ref, grads_std, allowances):
        assert_close(name, grad, ref, std, dtype=case.dtype, factor=3.0, scale=grad_scale, atol=atol)
    if dsink is not None:
        # dsink sums D over the rows: D's error is that of o, e_i = do_i . (o_i - o_ref_i).
        p_sink = np.exp(variant["sink"].astype(np.float64)[None, :, None] - lse_ref)
        e = np.moveaxis(np.sum(do.astype(np.float64) * (o.astype(np.float64) - o_ref), axis=-1), 1, 2)
        atol = float(np.abs(p_sink * e).sum(axis=(0, 2)).max())
        floor = 1e-5 * (1 + float(np.abs(dsink_ref).max()) + float(np.abs(p_sink).sum(axis=(0, 2)).max()))
        err = float(np.abs(dsink.astype(np.float64) - dsink_ref).max())
        assert err <= 3 * atol + floor, f"dsink: error {err:.3e} > 3 x {atol:.3e} + {floor:.3e}"
