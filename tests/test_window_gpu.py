"""Sliding windows on the GPU kernel families, against the float64 reference (tolerance.py's
rule), with NaN-poisoned outputs and fresh random inputs per example.

The public API does not take ``window_size`` yet (the mma.sync backward, the sm_80 path, has no
window so far), so these call the family launchers: SIMT for float32/float64, the tensor-core
forward (wgmma on sm_90) and the sm_90 wgmma backward (v10) for float16/bfloat16.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupyflash import reference
from strategies import attention_case, make_inputs
from tolerance import SIXTEEN_BIT, assert_close, max_abs
from test_masks import _allowance as window_allowance
from windows import window_size

pytestmark = pytest.mark.gpu
GPU_MAX_COST = 4e7


def _nan(shape, dtype):
    import cupy

    return cupy.full(shape, np.nan, dtype=dtype)


def _run(case, window, q, k, v, do, deterministic=True):
    """(o, lse, dq, dk, dv) as NumPy arrays from the family that serves case.dtype."""
    import cupy

    from cupyflash.kernels import mma_bwd, mma_fwd, simt

    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    acc = np.float64 if case.dtype == np.float64 else np.float32
    o = _nan(q.shape, q.dtype)
    lse = _nan((case.batch, case.nheads, case.seqlen_q), acc)
    grads = [_nan(x.shape, x.dtype) for x in (q, k, v)]
    options = dict(softmax_scale=case.scale, causal=case.causal, window_size=window)
    if case.dtype in SIXTEEN_BIT:
        if mma_fwd.current_arch() != "90":
            pytest.skip("windows on the tensor-core backward need sm_90 so far")
        mma_fwd.forward(qd, kd, vd, o, lse, **options)
        mma_bwd.backward(dod, qd, kd, vd, o, lse, *grads, deterministic=deterministic, **options)
    else:
        simt.forward(qd, kd, vd, o, lse, **options)
        simt.backward(dod, qd, kd, vd, o, lse, *grads, **options)
    cupy.cuda.get_current_stream().synchronize()
    return tuple(x.get() for x in (o, lse, *grads))


def _check(case, window, q, k, v, do, o, lse, grads):
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=window)
    o_ref, lse_ref = reference.attention(q, k, v, **kwargs)
    grads_ref = reference.attention_backward(do, q, k, v, **kwargs)
    o_std = lse_std = None
    grads_std = (None, None, None)
    if case.dtype in SIXTEEN_BIT:
        o_std, lse_std = reference.standard_attention(q, k, v, dtype=case.dtype, **kwargs)
        grads_std = reference.standard_attention_backward(do, q, k, v, dtype=case.dtype, **kwargs)
    for name, x in zip(("o", "dq", "dk", "dv"), (o, *grads)):
        assert np.isfinite(x.astype(np.float64)).all(), f"{name}: NaN or inf (an unwritten or poisoned entry)"
    hidden_rows = np.isneginf(lse_ref)
    assert (np.isneginf(lse) == hidden_rows).all(), "rows that see no key must have lse = -inf, only they"
    assert (np.moveaxis(o, 2, 1)[hidden_rows] == 0).all() and (np.moveaxis(grads[0], 2, 1)[hidden_rows] == 0).all()
    assert_close("o", o, o_ref, o_std, dtype=case.dtype)
    assert_close("lse", lse, lse_ref, lse_std, dtype=case.dtype)
    grad_scale = max(max_abs(g) for g in grads_ref)
    # D = rowsum(dO o) from the rounded o (tolerance.output_rounding_allowance, with the window).
    allowances = window_allowance(do, q, k, v, o, o_ref, kwargs)
    for name, grad, ref, std, atol in zip(("dq", "dk", "dv"), grads, grads_ref, grads_std, allowances):
        assert_close(name, grad, ref, std, dtype=case.dtype, factor=3.0, scale=grad_scale, atol=atol)


def _mma_case(**kw):
    return attention_case(max_cost=GPU_MAX_COST, **kw).filter(
        lambda c: c.dtype not in SIXTEEN_BIT or (c.headdim % 8 == 0 and c.headdim <= 256))


@given(_mma_case(), window_size(), st.booleans())
def test_window_matches_reference(case, window, deterministic):
    q, k, v, do = make_inputs(case)
    o, lse, *grads = _run(case, window, q, k, v, do, deterministic)
    _check(case, window, q, k, v, do, o, lse, grads)


@given(_mma_case(dtypes=tuple(d for d in SIXTEEN_BIT)), window_size())
def test_deterministic_backward_with_window_is_bitwise_repeatable(case, window):
    q, k, v, do = make_inputs(case)
    first = _run(case, window, q, k, v, do, deterministic=True)
    for _ in range(3):
        again = _run(case, window, q, k, v, do, deterministic=True)
        for a, b in zip(first, again):
            assert np.array_equal(a.view(np.uint16) if a.itemsize == 2 else a, b.view(np.uint16) if b.itemsize == 2 else b)


@pytest.mark.parametrize("window", [(1024, 0), (512, 512), (0, 0), (1, 1), (127, 128), (5000, -1)])
def test_long_window_matches_reference(window):
    """One long sequence (2k): many key blocks skipped at both ends, the walk starting deep."""
    from strategies import AttentionCase
    import ml_dtypes

    case = AttentionCase(1, 2048, 2048, 1, 2, 128, False, None, 1.0, np.dtype(ml_dtypes.bfloat16), 7)
    q, k, v, do = make_inputs(case)
    o, lse, *grads = _run(case, window, q, k, v, do)
    _check(case, window, q, k, v, do, o, lse, grads)
