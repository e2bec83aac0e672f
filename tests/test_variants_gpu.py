"""Score variants (softcap, ALiBi, sinks) on every GPU kernel family, against the float64
reference (tolerance.py's rule), with NaN-poisoned outputs and fresh random inputs per example.

Families as in test_window_gpu.py (SIMT forwards for float32; the DMMA backward for float64, and tf32x3's for float32, up to d128); the device's default tensor-core
kernels for float16/bfloat16 (sm_90: flash_fwd_wgmma and the wgmma backward, with its d64 softcap
plan; sm_80: flash_fwd_mma and the mma.sync backward), and sm_80's mma.sync kernels on any device
through their overrides. Then the public API, which also returns dsink.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel_paths import GPU_MAX_COST, MMA_SYNC_BWD, SMALL_COST, check_against_reference, mma_case, run_path
from strategies import make_inputs
from tolerance import SIXTEEN_BIT
from variants import variant_kwargs
from windows import window_size

pytestmark = pytest.mark.gpu


@st.composite
def _problem(draw, max_cost=GPU_MAX_COST, **kw):
    case = draw(mma_case(max_cost, **kw))
    return case, draw(window_size()), draw(variant_kwargs(case.batch, case.nheads))


@given(_problem(), st.booleans())
def test_variant_matches_reference(problem, deterministic):
    """kernel_paths.run_path's kernels: the SIMT forward for fp32 and the DMMA one for fp64 up to d128,
    both backwards on the DMMA kernels up to d128 (fp32 as tf32x3), SIMT past it, the tensor-core
    defaults for fp16/bf16."""
    case, window, variant = problem
    q, k, v, do = make_inputs(case)
    o, lse, *grads = run_path(case, window, q, k, v, do, deterministic, variant=variant)
    check_against_reference(case, window, q, k, v, do, o, lse, grads, variant)


@given(_problem(SMALL_COST, dtypes=tuple(SIXTEEN_BIT)), st.sampled_from(MMA_SYNC_BWD))
def test_mma_sync_kernels_with_variant_match_reference(problem, path):
    """flash_fwd_mma and the mma.sync backward (sm_80's kernels), on whatever device runs the test."""
    case, window, variant = problem
    q, k, v, do = make_inputs(case)
    o, lse, *grads = run_path(case, window, q, k, v, do, mma_sync=path, variant=variant)
    check_against_reference(case, window, q, k, v, do, o, lse, grads, variant)


@given(_problem(dtypes=tuple(SIXTEEN_BIT)), st.booleans())
def test_deterministic_backward_with_variant_is_bitwise_repeatable(problem, mma_sync):
    case, window, variant = problem
    q, k, v, do = make_inputs(case)
    path = ("v5", True) if mma_sync else None
    first = run_path(case, window, q, k, v, do, deterministic=True, mma_sync=path, variant=variant)
    for _ in range(2):
        again = run_path(case, window, q, k, v, do, deterministic=True, mma_sync=path, variant=variant)
        for a, b in zip(first, again):
            assert np.array_equal(a.view(np.uint16) if a.itemsize == 2 else a,
                                  b.view(np.uint16) if b.itemsize == 2 else b)


@given(_problem(), st.booleans())
def test_public_api_with_variant_matches_reference(problem, deterministic):
    """flash_attn_func / flash_attn_backward with the variant arguments on CuPy arrays, dsink too."""
    import cupy

    import cupyflash

    case, window, variant = problem
    q, k, v, do = make_inputs(case)
    arrays = [cupy.asarray(x) for x in (q, k, v)]
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=window)
    device_variant = {name: cupy.asarray(x) if isinstance(x, np.ndarray) else x for name, x in variant.items()}
    o, lse = cupyflash.flash_attn_func(*arrays, return_lse=True, **kwargs, **device_variant)
    out = cupyflash.flash_attn_backward(cupy.asarray(do), *arrays, o, lse, deterministic=deterministic, **kwargs,
                                        **device_variant)
    assert len(out) == (4 if "sink" in variant else 3)
    check_against_reference(case, window, q, k, v, do, o.get(), lse.get(), [g.get() for g in out[:3]], variant,
                            dsink=out[3].get() if len(out) == 4 else None)


@pytest.mark.parametrize("mma_sync", [None, *MMA_SYNC_BWD])
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("variant", [{"softcap": 30.0}, {"alibi": True}, {"sink": True},
                                     {"softcap": 5.0, "alibi": True, "sink": True}], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_with_variant_matches_reference(variant, causal, headdim, mma_sync):
    """One 2k sequence, bfloat16: blocks inside and across the mask, the plans' variant rows (the
    d64 softcap wgmma tiles, the mma.sync fallbacks)."""
    import ml_dtypes

    from strategies import AttentionCase

    case = AttentionCase(1, 2048, 2048, 2, 2, headdim, causal, None, 1.0, np.dtype(ml_dtypes.bfloat16), 11)
    q, k, v, do = make_inputs(case)
    rng = np.random.default_rng(5)
    kwargs = {}
    if "softcap" in variant:
        kwargs["softcap"] = variant["softcap"]
    if "alibi" in variant:
        kwargs["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, 5) / 4)).astype(np.float32)
    if "sink" in variant:
        kwargs["sink"] = (rng.standard_normal(4) * 3).astype(np.float32)
    o, lse, *grads = run_path(case, (-1, -1), q, k, v, do, mma_sync=mma_sync, variant=kwargs)
    check_against_reference(case, (-1, -1), q, k, v, do, o, lse, grads, kwargs)


def test_plain_scores_after_variants_are_unchanged():
    """A plain call after variant calls runs the plain kernels (the score is in the name, so no
    variant kernel is reused for it): its result equals a first plain call's bitwise."""
    import ml_dtypes

    from strategies import AttentionCase

    case = AttentionCase(2, 300, 300, 4, 2, 128, True, None, 1.0, np.dtype(ml_dtypes.bfloat16), 3)
    q, k, v, do = make_inputs(case)
    plain = run_path(case, (-1, -1), q, k, v, do)
    run_path(case, (-1, -1), q, k, v, do, variant={"softcap": 10.0})
    again = run_path(case, (-1, -1), q, k, v, do)
    for a, b in zip(plain, again):
        assert np.array_equal(a.view(np.uint16) if a.itemsize == 2 else a, b.view(np.uint16) if b.itemsize == 2 else b)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_sink_grad_on_the_device_equals_the_host_formula(dtype):
    """scores.sink_grad on CuPy (one reduction kernel reading 16-bit inputs as they are) against
    the same formula on NumPy in float64."""
    import cupy
    import ml_dtypes

    from cupyflash.scores import sink_grad

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(4)
    do, o = (rng.standard_normal((2, 37, 3, 72)).astype(dt) for _ in range(2))
    lse = rng.standard_normal((2, 3, 37)) + 2.0
    lse[0, 1, :5] = -np.inf  # rows that saw nothing add 0
    sink = rng.standard_normal(3).astype(np.float32)
    acc = np.float64 if dt == np.float64 else np.float32
    got = sink_grad(cupy.asarray(sink), cupy.asarray(do), cupy.asarray(o), cupy.asarray(lse.astype(acc)), xp=cupy)
    want = sink_grad(sink, do.astype(np.float64), o.astype(np.float64), lse)
    np.testing.assert_allclose(got.get(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ["drawn", "every_score_near_minus_cap"])
def test_softcap_with_the_cap_as_row_maximum_matches_reference(rows, monkeypatch):
    """softcap-fixed-max: a bfloat16 softcap forward on sm_90 at d128 (the producer kernel) with a
    cap of 30 takes the cap's bound as every row's maximum (plans.takes_fixed_max); it meets the
    tolerance rule, and so does the same call with the running maximum (the rule's range set to
    0). "every_score_near_minus_cap": queries opposite to every key, so that each row's capped
    scores sit near -30 and its weights near 2^-86 before the normalisation, with values of 1e-6:
    the corner of the range the rule allows (P V stays normal in float32 for |v| >= 2^-30)."""
    import ml_dtypes

    from cupyflash import plans
    from cupyflash.kernels import mma_fwd
    from cupyflash.kernels._module import device_arch
    from strategies import AttentionCase

    if device_arch() != "90":
        pytest.skip("the producer forward (the kernel that takes the fixed maximum) is sm_90's")
    case = AttentionCase(2, 700, 700, 4, 2, 128, True, None, 1.0, np.dtype(ml_dtypes.bfloat16), 17)
    q, k, v, do = make_inputs(case)
    if rows == "every_score_near_minus_cap":
        rng = np.random.default_rng(23)
        u = rng.standard_normal(128)
        u *= 12.0 / np.linalg.norm(u)  # q . k scale = -(36)^2 / sqrt(128) = -114.6: capped -29.97
        k = (u * 3.0 + 0.01 * rng.standard_normal(k.shape)).astype(case.dtype)
        q = (-u * 3.0 + 0.01 * rng.standard_normal(q.shape)).astype(case.dtype)
        v = (1e-6 * rng.standard_normal(v.shape)).astype(case.dtype)
    launched = []
    real_launch = mma_fwd.launch

    def recording_launch(spec, grid, args):
        launched.append(spec.name)
        return real_launch(spec, grid, args)

    monkeypatch.setattr(mma_fwd, "launch", recording_launch)
    variant = {"softcap": 30.0}
    results = {}
    for form, log2_range in (("fixed", plans.FIXED_MAX_LOG2_RANGE), ("running", 0.0)):
        monkeypatch.setattr(plans, "FIXED_MAX_LOG2_RANGE", log2_range)
        launched.clear()
        o, lse, *grads = run_path(case, (-1, -1), q, k, v, do, variant=variant)
        assert any("flash_fwd_wgmma_ws_" in n for n in launched), launched
        assert any("_softcap_fixedmax_" in n for n in launched) == (form == "fixed"), launched
        check_against_reference(case, (-1, -1), q, k, v, do, o, lse, grads, variant)
        results[form] = (o, lse)
    if rows == "every_score_near_minus_cap":  # each row's lse: -29.97 + log(its keys), 1 to 700
        lse = results["fixed"][1]
        assert (lse > -30.1).all() and (lse < -23.0).all(), (lse.min(), lse.max())
