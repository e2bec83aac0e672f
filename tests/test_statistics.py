"""Recomputed row statistics for the float32 / float64 backward (issue 18's saturated softmax), on
the CPU: the NumPy twin against attention's gradients in extended precision (tests/saturation.py),
the plans, and the API's choice of statistics."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given

import cupyflash
from cupyflash import backward_plans

import saturation


# Found by CI's draw (2026-12-04): float32, d16, causal, scale 1.33, magnitude 3.7 (scale x
# magnitude^2 = 18), dq 1.23e-5 against an allowed 2 x 5.14e-6 + 1.0e-6: 1.09x over the bar. The
# twin follows the kernels' statistics recipe (docs/perf-log.md bwd-stats-v1), so they likely
# share the miss. Traced (2026-12-04, on the CPU): at the worst entry (row 6, head 1; top P 0.992
# and 0.0079) the error that P's rounding alone puts into dq is the same for the twin's recipe
# (8.9e-6), for P from (S - S_max) scaled after the subtraction (8.5e-6) and for standard
# attention's softmax (8.7e-6); standard attention's other roundings happen to cancel half of
# its error there (4.55e-6). Over 3000 other seeds of this shape the twin's max error over
# standard attention's is median 0.94, at most 1.63: a tail of rounding luck against a per-case
# 2x bar, not a flaw the recipe could remove (issue 18).
KNOWN_MISS = saturation.Case(np.dtype(np.float32), 13, 59, 2, 16, True, 10.0 ** 0.125, 3.684734918695216, 14822)


@given(saturation.cases())
@example(KNOWN_MISS).xfail(raises=AssertionError, reason="1.09x over 2x standard attention's dq error (issue 18)")
def test_recomputed_statistics_are_as_accurate_as_standard_attention(case):
    """The saturated-softmax property on the NumPy twin: flash_attn_vjp's backward (recomputed
    statistics for float32 / float64) within 2x standard attention's error above the rounding floor,
    softmax scales up to 1e4, q and k magnitudes up to 1e2."""
    q, k, v, do = case.arrays()
    _, vjp = cupyflash.flash_attn_vjp(q, k, v, softmax_scale=case.softmax_scale, causal=case.causal, backend="numpy")
    saturation.check(case, vjp(do))


def _one_hot_case(dtype):
    """The reported case: float32 inputs with softmax_scale = 1e4, every row one-hot."""
    return saturation.Case(np.dtype(dtype), 48, 48, 2, 32, False, 1e4, 1.0, 20261203)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_saved_statistics_fail_the_saturated_case_and_recomputed_pass(dtype):
    """The property can fail: with the saved o and lse, D = rowsum(dO o O) leaves a residue of
    eps |dO| |V| against the backward's own dP, and scale times |K| makes dq of order 1e-2
    (float32) or 1e-10 (float64) where the true gradients are below 1e-100; the recomputed
    statistics give them to the floor."""
    case = _one_hot_case(dtype)
    q, k, v, do = case.arrays()
    options = dict(softmax_scale=case.softmax_scale, causal=case.causal, backend="numpy")
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **options)
    saved = cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics="saved", **options)
    with pytest.raises(AssertionError, match="exceeds the floor"):
        saturation.check(case, saved)
    recomputed = cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics="recomputed", **options)
    saturation.check(case, recomputed)
    truth, _ = saturation.extended_gradients(do, q, k, v, softmax_scale=case.softmax_scale, causal=False)
    assert float(np.abs(truth[0]).max()) < 1e-100
    # the residue the issue reported (0.3 at its float32 sizes): eps |dO| |V| scale |K|
    assert float(np.abs(saved[0]).max()) > {np.float32: 1e-4, np.float64: 1e-12}[dtype]


def test_extended_truth_agrees_with_the_float64_reference_at_ordinary_scales():
    """The extended-precision truth is attention's gradient: against cupyflash.reference (float64,
    written independently) where float64 is ample."""
    case = saturation.Case(np.dtype(np.float64), 37, 53, 2, 16, True, 0.25, 1.0, 7)
    q, k, v, do = case.arrays()
    truth, sizes = saturation.extended_gradients(do, q, k, v, softmax_scale=case.softmax_scale, causal=True)
    ref = cupyflash.reference.attention_backward(do, q, k, v, softmax_scale=case.softmax_scale, causal=True)
    for t, r, size in zip(truth, ref, sizes):
        assert np.abs(t.astype(np.float64) - r).max() <= 1e-12 * max(1.0, np.abs(r).max())
        assert (size >= np.abs(t)).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_recomputed_plan_launches_the_statistics_kernel(dtype):
    plan = backward_plans.plan_backward(None, dtype, 64, True, None, True, statistics="recomputed")
    assert [launch.role for launch in plan.launches] == ["stats", "dkdv", "dq"]
    # float64 on the FP64 tensor cores, float32 on their tf32x3 form (flash_bwd_stats_dmma): the dQ
    # kernel's tiles
    assert plan.spec("stats").name == f"flash_bwd_stats_dmma_{'fp32' if dtype == 'float32' else 'fp64'}" \
        f"_hdim64_causal_{plan.spec('dq').name.split('_causal_')[1]}"
    saved = backward_plans.plan_backward(None, dtype, 64, True, None, True)
    assert [launch.role for launch in saved.launches] == ["preprocess", "dkdv", "dq"]
    assert plan.spec("dq") == saved.spec("dq") and plan.spec("dkdv") == saved.spec("dkdv")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_recomputed_statistics_are_refused_for_16_bit(dtype):
    with pytest.raises(ValueError, match="float32 and float64"):
        backward_plans.plan_backward("90", dtype, 64, True, None, True, statistics="recomputed")
    x = np.ones((1, 4, 1, 8), np.float16)
    with pytest.raises(ValueError, match="float32 and float64"):
        cupyflash.flash_attn_backward(x, x, x, x, x, np.zeros((1, 1, 4), np.float32), backend="numpy",
                                      statistics="recomputed")


def test_unknown_statistics_are_refused():
    x = np.ones((1, 4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="statistics must be one of 'saved', 'recomputed'"):
        cupyflash.flash_attn_backward(x, x, x, x, x, np.zeros((1, 1, 4), np.float32), backend="numpy",
                                      statistics="exact")


@pytest.mark.parametrize("dtype, expected", [(np.float32, "recomputed"), (np.float64, "recomputed"),
                                             (np.float16, "saved")])
def test_vjp_recomputes_where_it_can(dtype, expected, monkeypatch):
    """flash_attn_vjp's backward takes this forward's o and lse, so it recomputes for float32 /
    float64 unless told otherwise; flash_attn_backward keeps the saved ones (ring attention)."""
    seen = []
    original = cupyflash.api.flash_attn_backward
    monkeypatch.setattr(cupyflash.api, "flash_attn_backward",
                        lambda *a, **kw: seen.append(kw["statistics"]) or original(*a, **kw))
    x = np.random.default_rng(0).standard_normal((1, 8, 1, 8)).astype(dtype)
    _, vjp = cupyflash.flash_attn_vjp(x, x, x, backend="numpy")
    vjp(x)
    _, vjp = cupyflash.flash_attn_vjp(x, x, x, backend="numpy", statistics="saved")
    vjp(x)
    assert seen == [expected, "saved"]


def test_twin_statistics_with_a_sink_and_dropout_match_the_saved_ones_at_ordinary_scales():
    """Where nothing saturates, recomputed and saved statistics give the same gradients to
    rounding, with the sink (its share of each row has no dP) and dropout (dP takes Z / (1 - p))."""
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((2, 40, 2, 16)) for _ in range(4))
    options = dict(causal=True, sink=np.array([0.5, -1.0], np.float32), dropout_p=0.25, seed=11, backend="numpy")
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **options)
    saved = cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics="saved", **options)
    recomputed = cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics="recomputed", **options)
    for a, b in zip(saved, recomputed):
        assert np.abs(a - b).max() <= 1e-12 * max(1.0, np.abs(a).max())


@pytest.mark.parametrize("dtype, gap", [(np.float32, 104.0), (np.float64, 760.0)])
def test_a_dominant_sink_gives_finite_gradients(dtype, gap):
    """A sink far above every score (float32: 2^(sink - m) past float32's range): P_sink is formed
    against the row's top, so the recomputed gradients are finite and equal the saved ones (all
    but 0: the sink takes the row's weight)."""
    q = np.full((1, 6, 1, 8), np.sqrt(gap / 8), dtype)
    k = -q[:, :5].copy()
    v, do = np.ones((1, 5, 1, 8), dtype), np.ones((1, 6, 1, 8), dtype)
    options = dict(softmax_scale=1.0, sink=np.zeros(1, np.float32), backend="numpy")
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **options)
    saved = cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics="saved", **options)
    recomputed = cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics="recomputed", **options)
    for a, b in zip(saved, recomputed):
        assert np.isfinite(b).all()
        assert np.abs(a - b).max() <= 1e-30


def test_vjp_refuses_recomputed_16_bit_when_it_is_made():
    x = np.ones((1, 4, 1, 8), np.float16)
    with pytest.raises(ValueError, match="float32 and float64"):
        cupyflash.flash_attn_vjp(x, x, x, backend="numpy", statistics="recomputed")
