"""Score variants (softcap, ALiBi, sinks) on every GPU kernel family, against the float64
reference (tolerance.py's rule), with NaN-poisoned outputs and fresh random inputs per example.

Families as in test_window_gpu.py: SIMT for float32/float64; the device's default tensor-core
kernels for float16/bfloat16 (sm_90: flash_fwd_wgmma and the wgmma backward, with its d64 softcap
plan; sm_80: flash_fwd_mma and the mma.sync backward), and sm_80's mma.sync kernels on any device
through their overrides. Then the public API, which also returns dsink.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupyflash import reference
from kernel_paths import MMA_SYNC_BWD, run_path
from strategies import attention_case, make_inputs
from tolerance import SIXTEEN_BIT, assert_close, max_abs, output_rounding_allowance, references_and_baselines
from variants import variant_kwargs
from windows import window_size

pytestmark = pytest.mark.gpu
GPU_MAX_COST = 4e7
SMALL_COST = 4e6


def _mma_case(max_cost=GPU_MAX_COST, **kw):
    return attention_case(max_cost=max_cost, **kw).filter(
        lambda c: c.dtype not in SIXTEEN_BIT or (c.headdim % 8 == 0 and c.headdim <= 256))


def _check(case, window, variant, q, k, v, do, o, lse, grads, dsink=None):
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


@st.composite
def _problem(draw, max_cost=GPU_MAX_COST, **kw):
    case = draw(_mma_case(max_cost, **kw))
    return case, draw(window_size()), draw(variant_kwargs(case.batch, case.nheads))


@given(_problem(), st.booleans())
def test_variant_matches_reference(problem, deterministic):
    """The device's default kernels: SIMT (fp32/fp64), the tensor-core defaults (fp16/bf16)."""
    case, window, variant = problem
    q, k, v, do = make_inputs(case)
    o, lse, *grads = run_path(case, window, q, k, v, do, deterministic, variant=variant)
    _check(case, window, variant, q, k, v, do, o, lse, grads)


@given(_problem(SMALL_COST, dtypes=tuple(SIXTEEN_BIT)), st.sampled_from(MMA_SYNC_BWD))
def test_mma_sync_kernels_with_variant_match_reference(problem, path):
    """flash_fwd_mma and the mma.sync backward (sm_80's kernels), on whatever device runs the test."""
    case, window, variant = problem
    q, k, v, do = make_inputs(case)
    o, lse, *grads = run_path(case, window, q, k, v, do, mma_sync=path, variant=variant)
    _check(case, window, variant, q, k, v, do, o, lse, grads)


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
    _check(case, window, variant, q, k, v, do, o.get(), lse.get(), [g.get() for g in out[:3]],
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
    _check(case, (-1, -1), kwargs, q, k, v, do, o, lse, grads)


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
