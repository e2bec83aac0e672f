"""cupyflash.testing, the oracle users fuzz their own attention code with: its strategies keep their
bounds, its assertion passes correct implementations (the reference, the NumPy twin, a naive one
written here) and fails wrong ones (scale, mask, GQA sum, NaN, an unwritten output, lse, dtype)."""
from __future__ import annotations

import dataclasses
import inspect
import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import reference
from cupyflash.testing import (
    AttentionProblem,
    as_numpy,
    assert_attention_close,
    poison_enabled,
    poisoned_outputs,
)
from cupyflash.testing import tolerance as shipped_tolerance
from cupyflash.testing.strategies import HEADDIMS, attention_problems

import strategies
import tolerance

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL_DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
SMALL = dict(max_seqlen=40, max_cost=2e5, max_headdim=64)  # each example well under 50 ms


def naive_attention(problem, q, k, v, do, bug=None):
    """(o, lse, (dq, dk, dv)) as a plain NumPy user implementation computes them (float64 inside,
    results in the problem's dtype), with one of the bugs below when ``bug`` names it."""
    dtype, group = problem.dtype, problem.group
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1 / math.sqrt(problem.headdim) if bug == "ignores_softmax_scale" else problem.scale
    i = np.arange(problem.seqlen_q)[:, None]
    j = np.arange(problem.seqlen_k)[None, :]
    diagonal = i + problem.seqlen_k - problem.seqlen_q + (1 if bug == "causal_off_by_one" else 0)
    visible = (j <= diagonal) if problem.causal else np.ones_like(i * j, dtype=bool)
    s = np.where(visible, scale * np.einsum("bihd,bjhd->bhij", q, k), -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    sees = np.isfinite(m)
    e = np.exp(s - np.where(sees, m, 0.0))
    l = e.sum(axis=-1, keepdims=True)  # noqa: E741 - the paper's l
    p = e / np.where(sees, l, 1.0)
    o = np.einsum("bhij,bjhd->bihd", p, v)
    with np.errstate(divide="ignore"):
        lse = np.where(sees, m + np.log(l), -np.inf)[..., 0]
    if bug == "log2_lse":
        lse = lse / math.log(2)
    dp = np.einsum("bihd,bjhd->bhij", do, v)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, k)
    dk = scale * np.einsum("bhij,bihd->bjhd", ds, q)
    dv = np.einsum("bhij,bihd->bjhd", p, do)
    shape = (problem.batch, problem.seqlen_k, problem.nheads_kv, group, problem.headdim)
    if bug == "gqa_first_head_only":
        dk, dv = (x.reshape(shape)[:, :, :, 0] for x in (dk, dv))
    else:
        dk, dv = (x.reshape(shape).sum(axis=3) for x in (dk, dv))
    if bug == "nan_output":
        o[0, -1, -1, -1] = np.nan
    if bug == "unwritten_last_row":  # a tile loop that stops one row short
        out = np.full(o.shape, np.nan) if poison_enabled() else np.zeros(o.shape)
        out[:, :-1] = o[:, :-1]
        o = out
    if bug == "float32_output":
        return o.astype(np.float32), lse, (dq, dk, dv)
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    return o.astype(dtype), lse.astype(lse_dtype), tuple(g.astype(dtype) for g in (dq, dk, dv))


def _problem(dtype, **changes):
    fields = dict(batch=2, seqlen_q=5, seqlen_k=7, nheads_kv=2, group=2, headdim=8, causal=True,
                  softmax_scale=0.5, magnitude=1.0, dtype=np.dtype(dtype), seed=7)
    return AttentionProblem(**{**fields, **changes})


# --- the helper passes correct implementations ----------------------------------------------


@given(attention_problems(**SMALL))
def test_passes_on_the_reference_rounded_to_the_dtype(problem):
    q, k, v, do = problem.arrays()
    o, lse = reference.attention(q, k, v, **problem.kwargs)
    grads = reference.attention_backward(do, q, k, v, **problem.kwargs)
    lse_dtype = np.float64 if problem.dtype == np.float64 else np.float32
    assert_attention_close(problem, o.astype(problem.dtype), lse.astype(lse_dtype),
                           [g.astype(problem.dtype) for g in grads])


@given(attention_problems(**SMALL))
def test_passes_on_the_numpy_backend(problem):
    q, k, v, do = problem.arrays()
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy", **problem.kwargs)
    grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend="numpy", **problem.kwargs)
    assert_attention_close(problem, o, lse, grads)


@given(attention_problems(distinct_v=True, **SMALL))
def test_problems_with_a_head_dim_of_v_of_their_own(problem):
    q, k, v, do = problem.arrays()
    assert v.shape == problem.v_shape and do.shape == problem.o_shape
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy", **problem.kwargs)
    grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend="numpy", **problem.kwargs)
    assert_attention_close(problem, o, lse, grads)


def test_distinct_v_draws_other_head_dims():
    drawn = set()

    @settings(max_examples=60, database=None)
    @given(attention_problems(distinct_v=True, **SMALL))
    def collect(problem):
        drawn.add(problem.headdim_v != problem.headdim)

    collect()
    assert drawn == {True, False}


@given(attention_problems(**SMALL))
def test_passes_on_a_naive_implementation(problem):
    o, lse, grads = naive_attention(problem, *problem.arrays())
    assert_attention_close(problem, o, lse, grads)


def _reference_has_windows() -> bool:
    return "window_size" in inspect.signature(reference.attention).parameters


@pytest.mark.skipif(not _reference_has_windows(), reason="cupyflash.reference has no window_size")
@given(attention_problems(windows=True, **SMALL))
def test_windowed_problems_are_checked_against_the_windowed_reference(problem):
    q, k, v, do = problem.arrays()
    o, lse = reference.attention(q, k, v, **problem.kwargs)
    grads = reference.attention_backward(do, q, k, v, **problem.kwargs)
    assert_attention_close(problem, o.astype(problem.dtype), lse, [g.astype(problem.dtype) for g in grads])
    if problem.window_size != (-1, -1):
        # The windowed o checked as if no window were asked for fails wherever it differs from
        # the full o by more than the rule allows (a window that hides only a few small weights
        # may stay inside the 16-bit tolerance).
        unwindowed = dataclasses.replace(problem, window_size=(-1, -1))
        (o_full, _, _), (o_std, _, _) = shipped_tolerance.references_and_baselines(
            do, q, k, v, dtype=problem.dtype, **unwindowed.kwargs)
        allowed = shipped_tolerance.bound(o_full, dtype=problem.dtype)
        if o_std is not None:
            allowed += shipped_tolerance.OUTPUT_FACTOR * shipped_tolerance.max_abs_error(o_std, o_full)
        if shipped_tolerance.max_abs_error(o.astype(problem.dtype), o_full) > allowed:
            with pytest.raises(AssertionError, match="o "):
                assert_attention_close(unwindowed, o.astype(problem.dtype))


def test_problems_outside_the_strategy_are_checked_too():
    # Empty sequences, and causal rows that see no key (o = 0, lse = -inf).
    for seqlen_q, seqlen_k in [(0, 5), (5, 0), (9, 4)]:
        problem = _problem(np.float16, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        o, lse, grads = naive_attention(problem, *problem.arrays())
        assert_attention_close(problem, o, lse, grads)


# --- and fails wrong ones, naming the output --------------------------------------------------

BUGS = {  # bug -> the outputs it must fail
    "ignores_softmax_scale": {"o", "lse", "dq", "dk", "dv"},
    "causal_off_by_one": {"o", "lse", "dq", "dk", "dv"},
    "gqa_first_head_only": {"dk", "dv"},
    "nan_output": {"o"},
    "log2_lse": {"lse"},
}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("bug", BUGS)
def test_fails_on_a_wrong_implementation(bug, dtype):
    problem = _problem(dtype)
    o, lse, grads = naive_attention(problem, *problem.arrays(), bug=bug)
    with pytest.raises(AssertionError) as failure:
        assert_attention_close(problem, o, lse, grads)
    report = str(failure.value)
    failing = {line.split()[0] for line in report.splitlines()[1:]}
    assert failing == BUGS[bug], report
    assert f"{len(BUGS[bug])} of 5 outputs fail" in report and repr(problem) in report


def test_an_unwritten_output_fails_under_poisoned_outputs():
    problem = _problem(np.float32)
    with poisoned_outputs():
        o, lse, grads = naive_attention(problem, *problem.arrays(), bug="unwritten_last_row")
    with pytest.raises(AssertionError, match=r"o \(float32\): max abs error inf at \[0, 4, 0, 0\]"
                                              r".* 64 non-finite where the reference is finite"):
        assert_attention_close(problem, o, lse, grads)


def test_a_nan_output_fails_even_where_the_reference_is_infinite():
    problem = _problem(np.float32, seqlen_q=9, seqlen_k=4)  # queries 0..4 see no key
    o, lse, grads = naive_attention(problem, *problem.arrays())
    lse = lse.copy()
    lse[0, 0, 0] = np.nan
    with pytest.raises(AssertionError, match=r"lse .* 1 entries differ where the reference is "
                                              r"\+-inf \(first at \[0, 0, 0\]\)"):
        assert_attention_close(problem, o, lse)


def test_wrong_dtype_and_shape_are_reported():
    problem = _problem(np.float16)
    o32 = naive_attention(problem, *problem.arrays(), bug="float32_output")[0]
    with pytest.raises(AssertionError, match="o: dtype float32, expected float16"):
        assert_attention_close(problem, o32)
    assert_attention_close(problem, o32, check_dtype=False)  # more accurate than float16 needs
    o, _, (dq, dk, dv) = naive_attention(problem, *problem.arrays())
    with pytest.raises(AssertionError, match=r"1 of 4 outputs fail .*\n"
                                              r"  dk: shape \(2, 5, 4, 8\), expected \(2, 7, 2, 8\)$"):
        assert_attention_close(problem, o, grads=(dq, dq, dv))


def test_the_report_says_what_where_and_by_which_rule():
    problem = _problem(BF16)
    o, lse, grads = naive_attention(problem, *problem.arrays())
    o = o.copy()
    o[1, 2, 3, 4] += 0.5
    with pytest.raises(AssertionError) as failure:
        assert_attention_close(problem, o, lse, grads)
    (line,) = str(failure.value).splitlines()[1:]
    assert line.startswith("  o (bfloat16): max abs error ")
    assert "at [1, 2, 3, 4] (got " in line and "2 x baseline error" in line
    assert "+ float32 floor" in line


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_the_output_rounding_allowance_takes_its_errors_two_roundings(dtype):
    """output_rounding_allowance is an error of exact arithmetic (D's, from o's rounding). On its
    way out a 16-bit backward rounds it twice: dS as the tensor-core operand of dQ = dS K, then dQ
    itself. Where the reference and standard attention both give exactly 0 (a row of one key: the
    gpu profile drew one with dropout, dq 0.324219 against an allowance of 0.3229), nothing else
    in the rule covers those roundings. Simulated with k = 1.75 over many errors: one rounding's
    allowance is not enough, two are; and the allowance for an o in the 16-bit dtype is (1 + u)^2
    that for the same values in float64, u the dtype's unit roundoff."""
    from tolerance import UNIT_ROUNDOFF, output_rounding_allowance

    u = UNIT_ROUNDOFF[dtype]
    assert u == (2.0 ** -8 if dtype == BF16 else 2.0 ** -11)

    def nearest(x):  # round to nearest even, as the kernels' conversions
        return float(np.asarray([x], np.float64).astype(dtype)[0])

    rng = np.random.default_rng(0)
    worst = max(nearest(nearest(error / 1.75) * 1.75) / error
                for error in rng.uniform(50.0, 400.0, 4000) * (1.0 if dtype == BF16 else 0.1))
    assert 1 + u < worst <= (1 + u) ** 2

    q, k, v, do = (rng.standard_normal((1, 40, 2, 16)) for _ in range(4))
    o_ref = cupyflash.reference.attention(q, k, v)[0]
    o = o_ref.astype(dtype)  # the output a backward is handed, in its dtype
    in_dtype = output_rounding_allowance(do, q, k, v, o, o_ref, softmax_scale=None, causal=True)
    in_float64 = output_rounding_allowance(do, q, k, v, o.astype(np.float64), o_ref, softmax_scale=None, causal=True)
    assert in_float64[0] > 0 and in_float64[1] > 0
    assert in_dtype == (in_float64[0] * (1 + u) ** 2, in_float64[1] * (1 + u) ** 2, 0.0)


# --- arrays of every kind ---------------------------------------------------------------------


def test_as_numpy_takes_lists_and_torch_tensors():
    assert as_numpy([[1.0, 2.0]]).shape == (1, 2)
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    got = as_numpy(x)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.astype(np.float32), x.detach().float().numpy())


def test_torch_results_are_checked():
    torch = pytest.importorskip("torch")
    problem = _problem(BF16)
    o, lse, grads = naive_attention(problem, *problem.arrays())
    to_torch = lambda x: torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)  # noqa: E731
    assert_attention_close(problem, to_torch(o), torch.from_numpy(lse), [to_torch(g) for g in grads])


# --- the strategies -------------------------------------------------------------------------


@st.composite
def bounds(draw):
    min_seqlen = draw(st.integers(0, 20))
    use_headdims = draw(st.booleans())
    low_scale = draw(st.floats(0.01, 1.0))
    low_magnitude = draw(st.floats(0.01, 2.0))
    return dict(
        dtypes=draw(st.lists(st.sampled_from(["float16", "bfloat16", "float32", np.float64]),
                             min_size=1, max_size=3)),
        causal=draw(st.sampled_from([None, True, False])),
        min_seqlen=min_seqlen,
        max_seqlen=draw(st.integers(min_seqlen, 64)),
        same_seqlens=draw(st.booleans()),
        headdims=draw(st.lists(st.sampled_from(HEADDIMS), min_size=1, max_size=3))
        if use_headdims else None,
        max_headdim=draw(st.integers(1, 256)),
        max_batch=draw(st.integers(1, 4)),
        max_heads_kv=draw(st.integers(1, 4)),
        max_group=draw(st.integers(1, 8)),
        scales=draw(st.sampled_from([None, (low_scale, low_scale * 3)])),
        magnitudes=(low_magnitude, low_magnitude * draw(st.floats(1.0, 4.0))),
        max_logit_std=draw(st.sampled_from([None, 2.0, 8.0])),
        max_cost=draw(st.sampled_from([1e3, 1e5, 2.5e7])),
    )


@given(st.data())
def test_strategies_respect_their_bounds(data):
    b = data.draw(bounds(), label="bounds")
    problem = data.draw(attention_problems(**b), label="problem")
    assert problem.dtype in {np.dtype(ml_dtypes.bfloat16 if d == "bfloat16" else d) for d in b["dtypes"]}
    assert b["causal"] is None or problem.causal == b["causal"]
    assert b["min_seqlen"] <= problem.seqlen_q <= b["max_seqlen"]
    assert b["min_seqlen"] <= problem.seqlen_k <= b["max_seqlen"]
    assert not b["same_seqlens"] or problem.seqlen_q == problem.seqlen_k
    smallest_headdim = 1
    if b["headdims"] is None:
        assert 1 <= problem.headdim <= b["max_headdim"]
    else:
        assert problem.headdim in b["headdims"]
        smallest_headdim = min(b["headdims"])
    assert 1 <= problem.batch <= b["max_batch"]
    assert 1 <= problem.nheads_kv <= b["max_heads_kv"] and 1 <= problem.group <= b["max_group"]
    if b["scales"] is None:
        assert problem.softmax_scale is None
    elif problem.softmax_scale is not None:
        assert b["scales"][0] <= problem.softmax_scale <= b["scales"][1]
    low, high = b["magnitudes"]
    assert problem.magnitude <= high
    logit_std = problem.scale * problem.magnitude**2 * math.sqrt(problem.headdim)
    if b["max_logit_std"] is None:
        assert problem.magnitude >= low
    else:
        assert logit_std <= b["max_logit_std"] * (1 + 1e-9)
        assert problem.magnitude >= low or math.isclose(logit_std, b["max_logit_std"])
    if problem.seqlen_q * problem.seqlen_k * smallest_headdim <= b["max_cost"]:
        assert problem.cost <= b["max_cost"]
    assert problem.window_size == (-1, -1)


@given(attention_problems(windows=True, max_seqlen=50, max_cost=1e4))
def test_windows_are_drawn_when_asked(problem):
    left, right = problem.window_size
    reach = max(problem.seqlen_q, problem.seqlen_k)
    assert -1 <= left <= reach and -1 <= right <= reach
    assert not problem.causal or right == 0


@given(attention_problems(max_seqlen=20, max_cost=1e4))
def test_arrays_are_reproducible_random_and_shaped(problem):
    q, k, v, do = problem.arrays()
    assert q.shape == do.shape == problem.q_shape and k.shape == v.shape == problem.kv_shape
    assert all(x.dtype == problem.dtype for x in (q, k, v, do))
    assert all(np.count_nonzero(x) > x.size // 2 for x in (q, k, v, do))  # never zeros
    for x, again in zip((q, k, v, do), problem.arrays()):
        np.testing.assert_array_equal(x, again)
    other = dataclasses.replace(problem, seed=(problem.seed + 1) % 2**32).arrays()[0]
    assert not np.array_equal(q, other)


def test_a_problem_is_rebuilt_from_its_repr():
    assert eval(repr(_problem("float32", headdim_v=5)), {"AttentionProblem": AttentionProblem}).headdim_v == 5  # noqa: S307
    problem = _problem("bfloat16", window_size=[3, 0])
    assert problem.dtype == BF16 and problem.window_size == (3, 0)
    assert "dtype='bfloat16'" in repr(problem)
    assert eval(repr(problem), {"AttentionProblem": AttentionProblem}) == problem  # noqa: S307
    from hypothesis.vendor.pretty import pretty  # how Hypothesis prints a falsifying example

    assert pretty(problem) == repr(problem)


def test_arrays_have_the_drawn_magnitude():
    q = _problem(np.float64, batch=4, seqlen_q=64, headdim=64, magnitude=0.3).arrays()[0]
    assert abs(q.std() - 0.3) < 0.01


@pytest.mark.parametrize("bad, match", [
    (dict(dtypes=["int8"]), "unsupported dtype"),
    (dict(dtypes=[]), "dtypes is empty"),
    (dict(min_seqlen=10, max_seqlen=5), "min_seqlen"),
    (dict(magnitudes=(0.0, 1.0)), "magnitudes must be positive"),
    (dict(scales=(2.0, 1.0)), "scales"),
    (dict(max_group=0), "max_group"),
    (dict(headdims=[]), "headdims"),
])
def test_strategies_reject_bad_bounds_when_built(bad, match):
    with pytest.raises(ValueError, match=match):
        attention_problems(**bad)


# --- the project fuzzes itself with what it ships ---------------------------------------------


def test_the_suite_uses_the_shipped_strategies_and_rule():
    assert strategies.AttentionCase is AttentionProblem
    assert strategies.make_inputs(_problem(np.float32))[0].shape == (2, 5, 4, 8)
    for name in ("assert_close", "bound", "flash_rounding_baseline", "output_rounding_allowance",
                 "worse_baseline", "max_abs", "rel_fro_error", "RTOL", "SIXTEEN_BIT"):
        assert getattr(tolerance, name) is getattr(shipped_tolerance, name)


def test_importing_cupyflash_does_not_import_hypothesis():
    code = ("import sys, cupyflash, cupyflash.testing; "
            "assert 'hypothesis' not in sys.modules, 'hypothesis imported'; "
            "cupyflash.testing.attention_problems; "
            "assert 'hypothesis' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- on a device ------------------------------------------------------------------------------


@pytest.mark.gpu
@settings(max_examples=50)
@given(attention_problems(dtypes=ALL_DTYPES, max_seqlen=300))
def test_passes_on_the_cuda_kernels_with_cupy_arrays(problem):
    import cupy

    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **problem.kwargs)
        grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, **problem.kwargs)
    assert isinstance(o, cupy.ndarray)
    assert_attention_close(problem, o, lse, grads)


@pytest.mark.gpu
def test_fails_on_a_poisoned_unwritten_cupy_output():
    import cupy

    problem = _problem(np.float16)
    q, k, v, _ = (cupy.asarray(x) for x in problem.arrays())
    with poisoned_outputs():
        o = cupyflash.flash_attn_func(q, k, v, **problem.kwargs)
    o[:, -1] = cupy.nan  # as a kernel that skips the last row leaves a poisoned buffer
    with pytest.raises(AssertionError, match=r"o \(float16\): max abs error inf at \[0, 4, 0, 0\]"):
        assert_attention_close(problem, o)
