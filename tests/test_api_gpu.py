"""The CUDA kernels against the float64 reference: forward, lse and all three gradients, every
dtype and kernel family, hypothesis-drawn shapes. Outputs start as NaN (poisoned), so an element a
kernel never writes fails. Runs only where a CUDA device is usable (marker ``gpu``)."""
import contextlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings

import cupyflash
from cupyflash import reference
from cupyflash.testing import poisoned_outputs

from strategies import AttentionCase, attention_case, make_inputs
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
        flash = flash_rounding_baseline(do, q, k, v, dtype=case.dtype, o=o.get(), **kwargs)
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


@given(case=attention_case(dtypes=[np.dtype(np.float64)]))
def test_auto_float64_forward_and_backward_match_reference(case):
    """float64's default: the DMMA forward up to d128 (padded to a multiple of 8), SIMT past it,
    and the SIMT backward on its o and lse."""
    _check_forward(case, "auto")
    _check_backward(case, "auto")


@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_mma_forward_matches_reference(case):
    _check_forward(case, "mma")


# Found by the gpu profile: dq a sum dominated by two terms of dS whose bfloat16 rounding the
# handed o's D turns the same way (tolerance.flash_rounding_baseline).
@example(case=AttentionCase(batch=1, seqlen_q=1, seqlen_k=298, nheads_kv=1, group=1, headdim=1, causal=False,
                            softmax_scale=1.841796875, magnitude=1.8408036158268744, dtype="bfloat16", seed=954,
                            window_size=(-1, -1), headdim_v=1))
@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_mma_backward_matches_reference(case):
    _check_backward(case, "mma")


@settings(max_examples=40)
@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_mma_backward_with_atomic_dq_matches_reference(case):
    _check_backward(case, "mma", deterministic=False)


@contextlib.contextmanager
def _backward_version(version):
    """Runs dev/mma_bwd.py's ``version`` through the public API (mma_bwd.DEV_VERSION is read at
    call time)."""
    from cupyflash.kernels import mma_bwd

    saved = mma_bwd.DEV_VERSION
    mma_bwd.DEV_VERSION = version
    try:
        yield
    finally:
        mma_bwd.DEV_VERSION = saved


def _other_backward_versions():
    from cupyflash.bench import tune

    dev = tune.load_dev_backward()
    return [v.name for v in dev.VERSIONS if v.name != dev.LAST_VERSION] if dev is not None else []


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
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_bwd

    dev = tune.load_dev_backward()
    saved = dev.WGMMA_ORDERED_D_TILES
    dev.WGMMA_ORDERED_D_TILES = mma_bwd.D_TILES
    try:
        with _backward_version("v6"):
            _check_backward(case, "mma", deterministic=True)
    finally:
        dev.WGMMA_ORDERED_D_TILES = saved


@pytest.mark.parametrize("version", ["v7", "v9"])
@settings(max_examples=30)
@given(case=attention_case(dtypes=SIXTEEN_BIT))
def test_wgmma_fixed_dq_at_every_head_dim_matches_reference(version, case):
    """The fixed-point dQ wgmma kernels (v7's row-wise reductions, v9's panel-major ones) at every
    head-dim tile they have, including those where the default runs another kernel."""
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_bwd, mma_fwd

    if mma_fwd.current_arch() != "90":
        pytest.skip("the fixed-point dQ kernel is sm_90's (wgmma)")
    dev = tune.load_dev_backward()
    saved = dev.WGMMA_FIXED_D_TILES, dev.WGMMA_PANEL_D_TILES
    dev.WGMMA_FIXED_D_TILES = dev.WGMMA_PANEL_D_TILES = mma_bwd.WGMMA_FIXED_KERNEL_D_TILES
    try:
        with _backward_version(version):
            _check_backward(case, "mma", deterministic=True)
    finally:
        dev.WGMMA_FIXED_D_TILES, dev.WGMMA_PANEL_D_TILES = saved


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_auto_backend_and_numpy_arrays_round_trip(dtype):
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, 77, 4, 40)).astype(dtype) for _ in range(3))
    o = cupyflash.flash_attn_func(q, k, v, causal=True)
    assert isinstance(o, np.ndarray) and o.dtype == dtype
    o_ref, _ = reference.attention(q, k, v, causal=True)
    o_std, _ = reference.standard_attention(q, k, v, causal=True, dtype=dtype)
    assert_close("o", o, o_ref, o_std, dtype=dtype)


# --- batch and heads beyond CUDA's 65535 grid limit (api.MAX_GRID_YZ): chunked launches --------

BEYOND_GRID_LIMIT = [  # (batch, nheads_kv, group): the API splits each of these into launches
    pytest.param(70000, 1, 1, id="batch70000"),
    pytest.param(1, 70000, 1, id="heads70000"),
    pytest.param(2, 35000, 2, id="heads70000_gqa2"),
    pytest.param(1, 1, 70000, id="heads70000_mqa"),  # one group split, its dk, dv added over the parts
]
FAMILIES = [pytest.param("simt", np.dtype(np.float32), id="simt-fp32"),
            pytest.param("simt", np.dtype(ml_dtypes.bfloat16), id="simt-bf16"),
            pytest.param("mma", np.dtype(ml_dtypes.bfloat16), id="mma-bf16"),
            pytest.param("mma", np.dtype(np.float16), id="mma-fp16")]


def _beyond_limit_case(batch, nheads_kv, group, dtype):
    return AttentionCase(batch=batch, seqlen_q=3, seqlen_k=5, nheads_kv=nheads_kv, group=group, headdim=8,
                         causal=True, softmax_scale=None, magnitude=1.0, dtype=dtype, seed=batch + nheads_kv)


@pytest.mark.parametrize("batch,nheads_kv,group", BEYOND_GRID_LIMIT)
@pytest.mark.parametrize("backend,dtype", FAMILIES)
def test_forward_beyond_the_grid_limit_matches_reference(backend, dtype, batch, nheads_kv, group):
    from cupyflash import api

    assert max(batch, nheads_kv * group) > api.MAX_GRID_YZ
    _check_forward(_beyond_limit_case(batch, nheads_kv, group, dtype), backend)


@pytest.mark.parametrize("batch,nheads_kv,group", BEYOND_GRID_LIMIT)
@pytest.mark.parametrize("backend,dtype", FAMILIES)
def test_backward_beyond_the_grid_limit_matches_reference(backend, dtype, batch, nheads_kv, group):
    _check_backward(_beyond_limit_case(batch, nheads_kv, group, dtype), backend)


@pytest.mark.parametrize("batch,nheads_kv,group", BEYOND_GRID_LIMIT[:3])
def test_chunked_launches_equal_one_launch_of_each_chunk(batch, nheads_kv, group):
    """The kernels are per (batch, head): a chunked call is bitwise the concatenation of the
    chunks computed alone (here: the first and the last batch entry / kv group)."""
    import cupy

    case = _beyond_limit_case(batch, nheads_kv, group, np.dtype(ml_dtypes.bfloat16))
    q, k, v, do = (cupy.asarray(x) for x in make_inputs(case))
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=True)
    for b, kv in ((slice(0, 1), slice(0, 1)), (slice(batch - 1, batch), slice(nheads_kv - 1, nheads_kv))):
        h = slice(kv.start * group, kv.stop * group)
        o_part, lse_part = cupyflash.flash_attn_func(q[b, :, h], k[b, :, kv], v[b, :, kv], causal=True,
                                                     return_lse=True)
        assert cupy.array_equal(o[b, :, h], o_part) and cupy.array_equal(lse[b, h], lse_part)
        parts = cupyflash.flash_attn_backward(do[b, :, h], q[b, :, h], k[b, :, kv], v[b, :, kv], o_part,
                                              lse_part, causal=True)
        for whole, part, heads in zip(grads, parts, (h, kv, kv)):
            assert cupy.array_equal(whole[b, :, heads], part)


# --- zero-size dimensions, scales, and arrays of other libraries on the device -----------------

@pytest.mark.parametrize("backend,dtype", FAMILIES)
@pytest.mark.parametrize("b,sq,sk,h,hkv", [(1, 5, 7, 0, 1), (1, 5, 7, 0, 0), (0, 5, 7, 2, 1), (2, 0, 7, 2, 1),
                                           (2, 5, 0, 4, 2)])
def test_zero_size_dimensions_give_empty_results(backend, dtype, b, sq, sk, h, hkv):
    import cupy

    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((b, sq, h, 8)).astype(dtype))
    k, v = (cupy.asarray(rng.standard_normal((b, sk, hkv, 8)).astype(dtype)) for _ in range(2))
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend=backend)
        grads = cupyflash.flash_attn_backward(cupy.ones_like(q), q, k, v, o, lse, backend=backend)
    assert isinstance(o, cupy.ndarray) and o.shape == q.shape and o.dtype == dtype and not o.any()
    assert lse.shape == (b, h, sq) and bool((lse == -np.inf).all())
    for g, x in zip(grads, (q, k, v)):
        assert isinstance(g, cupy.ndarray) and g.shape == x.shape and g.dtype == dtype and not g.any()


@pytest.mark.parametrize("backend,dtype", FAMILIES)
@pytest.mark.parametrize("scale", [0.0, -0.7, 4.0], ids=["zero", "negative", "amplifying"])
def test_any_finite_scale_matches_reference(backend, dtype, scale):
    case = AttentionCase(batch=2, seqlen_q=70, seqlen_k=90, nheads_kv=2, group=2, headdim=40, causal=True,
                         softmax_scale=scale, magnitude=1.0, dtype=dtype, seed=7)
    _check_forward(case, backend)
    _check_backward(case, backend)


@pytest.mark.parametrize("backend,dtype", FAMILIES)
def test_scale_that_overflows_the_scores_is_refused(backend, dtype):
    import cupy

    q, k, v = (cupy.asarray(x) for x in np.random.default_rng(0).standard_normal((3, 1, 9, 2, 16)).astype(dtype))
    with pytest.raises(ValueError, match=r"^softmax_scale=1e\+37 can overflow the float32 scores"):
        cupyflash.flash_attn_func(q, k, v, softmax_scale=1e37, backend=backend)


@pytest.mark.filterwarnings("ignore:cupyx.allow_synchronize will be removed")
def test_the_ordinary_call_does_not_synchronise():
    """bf16 at scale 1/sqrt(headdim): no max-abs reduction is read back (cupyx raises on a
    synchronising CuPy call inside allow_synchronize(False))."""
    import cupy
    import cupyx

    q, k, v = (cupy.asarray(x).astype(ml_dtypes.bfloat16)
               for x in np.random.default_rng(0).standard_normal((3, 2, 128, 4, 64)))
    cupyflash.flash_attn_func(q, k, v, causal=True)  # compiles and caches the kernel first
    with cupyx.allow_synchronize(False):
        cupyflash.flash_attn_func(q, k, v, causal=True)
        with pytest.raises(cupyx.DeviceSynchronized):  # the check is live: an amplifying scale reads
            cupyflash.flash_attn_func(q, k, v, causal=True, softmax_scale=2.0)


def test_zero_d_cupy_scale_is_accepted():
    import cupy

    q, k, v = (cupy.asarray(x) for x in np.random.default_rng(0).standard_normal((3, 1, 9, 2, 16)).astype(np.float32))
    o = cupyflash.flash_attn_func(q, k, v, softmax_scale=cupy.asarray(0.3), backend="simt")
    expected = cupyflash.flash_attn_func(q, k, v, softmax_scale=0.3, backend="simt")
    assert cupy.array_equal(o, expected)


def test_torch_cuda_bfloat16_tensors_are_taken_zero_copy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import cupy

    q, k, v = (torch.randn(2, 33, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = cupyflash.flash_attn_func(q, k, v, causal=True)
    assert isinstance(o, cupy.ndarray) and o.dtype == ml_dtypes.bfloat16
    q_view = cupyflash._arrays.to_cupy(q, "q")
    assert q_view.data.ptr == q.data_ptr()  # the same memory, no copy
    expected = cupyflash.flash_attn_func(*(cupy.asarray(x.float().cpu().numpy()).astype(ml_dtypes.bfloat16)
                                           for x in (q, k, v)), causal=True)
    assert cupy.array_equal(o, expected)
