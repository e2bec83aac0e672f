"""The CUDA kernels against the float64 reference: forward, lse and all three gradients, every
dtype and kernel family, hypothesis-drawn shapes. Outputs start as NaN (poisoned), so an element a
kernel never writes fails. Runs only where a CUDA device is usable (marker ``gpu``)."""
import contextlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import reference
from cupyflash.testing import poisoned_outputs

from strategies import attention_case, make_inputs
from tolerance import assert_close, flash_rounding_baseline, max_abs, output_rounding_allowance, worse_baseline

pytestmark = pytest.mark.gpu

SIXTEEN_BIT = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
ALL_DTYPES = SIXTEEN_BIT + [np.dtype(np.float32), np.dtype(np.float64)]


def _run_forward(case, backend):
    import cupy

    q, k, v, do = make_inputs(case)
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                                           softmax_scale=case.softmax_scale, causal=case.causal,
                                           return_lse=True, backend=backend)
    return (q, k, v, do), o, lse


def _check_forward(case, backend):
    (q, k, v, _), o, lse = _run_forward(case, backend)
    o_ref, lse_ref = reference.attention(q, k, v, softmax_scale=case.softmax_scale, causal=case.causal)
    o_std, lse_std = reference.standard_attention(q, k, v, softmax_scale=case.softmax_scale,
                                                  causal=case.causal, dtype=case.dtype)
    assert o.dtype == case.dtype
    assert_close("o", o.get(), o_ref, o_std, dtype=case.dtype)
    assert_close("lse", lse.get(), lse_ref, lse_std, dtype=case.dtype)


def _check_backward(case, backend, deterministic=True):
    import cupy

    (q, k, v, do), o, lse = _run_forward(case, backend)
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal)
    with poisoned_outputs():
        grads = cupyflash.flash_attn_backward(cupy.asarray(do), cupy.asarray(q), cupy.asarray(k),
                                              cupy.asarray(v), o, lse, backend=backend,
                                              deterministic=deterministic, **kwargs)
    refs = reference.attention_backward(do, q, k, v, **kwargs)
    stds = reference.standard_attention_backward(do, q, k, v, dtype=case.dtype, **kwargs)
    if case.dtype in SIXTEEN_BIT:  # the kernels' own operand rounding (tolerance.flash_rounding_baseline)
        flash = flash_rounding_baseline(do, q, k, v, dtype=case.dtype, **kwargs)
        stds = [worse_baseline(ref, std, f) for ref, std, f in zip(refs, stds, flash)]
    o_ref, _ = reference.attention(q, k, v, **kwargs)
    # D = rowsum(dO * o) uses the stored (rounded) o; standard attention never forms D, so its
    # error is allowed for separately, computed exactly (see tolerance.output_rounding_allowance).
    allowances = output_rounding_allowance(do, q, k, v, o.get(), o_ref, **kwargs)
    grad_scale = max(max_abs(r) for r in refs)  # dq, dk may cancel to 0 while their terms do not
    for name, g, ref, std, atol in zip(("dq", "dk", "dv"), grads, refs, stds, allowances):
        assert g.dtype == case.dtype
        # flash-attn allows gradients 3x the baseline's error
        assert_close(name, g.get(), ref, std, dtype=case.dtype, factor=3.0, scale=grad_scale, atol=atol)


@given(case=attention_case(dtypes=ALL_DTYPES))
def test_simt_forward_matches_reference(case):
    _check_forward(case, "simt")


@given(case=attention_case(dtypes=ALL_DTYPES))
def test_simt_backward_matches_reference(case):
    _check_backward(case, "simt")


@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_mma_forward_matches_reference(case):
    _check_forward(case, "mma")


@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_mma_backward_matches_reference(case):
    _check_backward(case, "mma")


@settings(max_examples=40)
@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_mma_backward_with_atomic_dq_matches_reference(case):
    _check_backward(case, "mma", deterministic=False)


@contextlib.contextmanager
def _backward_version(version):
    """Runs the mma backward's ``version`` through the public API (mma_bwd.DEFAULT_VERSION is read
    at call time)."""
    from cupyflash.kernels import mma_bwd

    saved = mma_bwd.DEFAULT_VERSION
    mma_bwd.DEFAULT_VERSION = version
    try:
        yield
    finally:
        mma_bwd.DEFAULT_VERSION = saved


def _other_backward_versions():
    from cupyflash.kernels import mma_bwd

    return [v for v in mma_bwd.VERSIONS if v != mma_bwd.DEFAULT_VERSION]


# The default version gets the full example count above; the others stay launchable (the tuner
# times them side by side) and keep a smaller property check, both dQ modes.
@pytest.mark.parametrize("version", _other_backward_versions())
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered_dq", "atomic_dq"])
@settings(max_examples=30)
@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_mma_backward_versions_match_reference(version, deterministic, case):
    with _backward_version(version):
        _check_backward(case, "mma", deterministic=deterministic)


@settings(max_examples=30)
@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_wgmma_ordered_dq_at_every_head_dim_matches_reference(case):
    """v6's ordered-dQ wgmma kernels where the default runs v3's instead (d64, d256 on sm_90)."""
    from cupyflash.kernels import mma_bwd

    saved = mma_bwd.WGMMA_ORDERED_D_TILES
    mma_bwd.WGMMA_ORDERED_D_TILES = mma_bwd.D_TILES
    try:
        with _backward_version("v6"):
            _check_backward(case, "mma", deterministic=True)
    finally:
        mma_bwd.WGMMA_ORDERED_D_TILES = saved


@pytest.mark.parametrize("version", ["v7", "v9"])
@settings(max_examples=30)
@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_wgmma_fixed_dq_at_every_head_dim_matches_reference(version, case):
    """The fixed-point dQ wgmma kernels (v7's row-wise reductions, v9's panel-major ones) at every
    head-dim tile they have, including those where the default runs another kernel."""
    from cupyflash.kernels import mma_bwd, mma_fwd

    if mma_fwd.current_arch() != "90":
        pytest.skip("the fixed-point dQ kernel is sm_90's (wgmma)")
    saved = mma_bwd.WGMMA_FIXED_D_TILES, mma_bwd.WGMMA_PANEL_D_TILES
    mma_bwd.WGMMA_FIXED_D_TILES = mma_bwd.WGMMA_PANEL_D_TILES = mma_bwd.WGMMA_FIXED_KERNEL_D_TILES
    try:
        with _backward_version(version):
            _check_backward(case, "mma", deterministic=True)
    finally:
        mma_bwd.WGMMA_FIXED_D_TILES, mma_bwd.WGMMA_PANEL_D_TILES = saved


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_auto_backend_and_numpy_arrays_round_trip(dtype):
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, 77, 4, 40)).astype(dtype) for _ in range(3))
    o = cupyflash.flash_attn_func(q, k, v, causal=True)
    assert isinstance(o, np.ndarray) and o.dtype == dtype
    o_ref, _ = reference.attention(q, k, v, causal=True)
    o_std, _ = reference.standard_attention(q, k, v, causal=True, dtype=dtype)
    assert_close("o", o, o_ref, o_std, dtype=dtype)
