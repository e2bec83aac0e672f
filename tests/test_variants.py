"""Attention variants (softcap, ALiBi, attention sinks): the float64 reference against brute force
and finite differences, the NumPy twin against the reference, rows that see no key, and
cupyflash.scores.sink_grad."""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupyflash import numpy_backend, reference
from cupyflash.scores import Variant, sink_grad
from strategies import attention_case, make_inputs
from tolerance import SIXTEEN_BIT, assert_close, max_abs, references_and_baselines
from windows import window_size
from brute_force import brute_force_attention, numerical_gradient

FLOAT64 = (np.dtype(np.float64),)
TWIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16))
# Block sizes the kernels use, and odd ones that leave ragged edges on both axes.
BLOCK_SIZES = (16, 32, 48, 64, 80, 128)
PARTS = ("softcap", "alibi", "sink")
# The largest ALiBi slope of a draw: flash-attn's slopes 2^(-8 h / nheads) lie in (0, 1].
SLOPE_SCALES = (0.01, 0.1, 1.0)

small_case = attention_case(dtypes=FLOAT64, max_seqlen=12, max_cost=20_000, max_headdim=40)
tiny_case = attention_case(dtypes=FLOAT64, max_seqlen=5, max_cost=300, max_headdim=4)
twin_case = attention_case(dtypes=TWIN_DTYPES, max_cost=6e6)
windows = st.one_of(st.just((-1, -1)), window_size())


@st.composite
def variants(draw, case, parts=PARTS):
    """A Variant for ``case`` with float32 arrays (flash-attn's type): every part of ``parts`` on
    when ``parts`` is a tuple, a nonempty subset of PARTS when it is None; the values drawn from
    a seed."""
    on = set(parts) if parts is not None else draw(st.sets(st.sampled_from(PARTS), min_size=1), label="parts")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="variant_seed"))
    softcap = draw(st.floats(0.5, 30.0), label="softcap") if "softcap" in on else 0.0
    slopes = None
    if "alibi" in on:
        shape = draw(st.sampled_from([(case.nheads,), (case.batch, case.nheads)]), label="slopes_shape")
        slopes = rng.uniform(0.0, draw(st.sampled_from(SLOPE_SCALES)), shape).astype(np.float32)
    sink = None
    if "sink" in on:
        # sinks from far below the rows' scores (no effect) to far above (they take the weight)
        center = draw(st.floats(-8.0, 8.0), label="sink_center")
        sink = (center + 2.0 * rng.standard_normal(case.nheads)).astype(np.float32)
    return Variant(softcap, slopes, sink)


def variant_options(variant: Variant, dtype=np.float32) -> dict:
    """The keywords of cupyflash.reference's functions for ``variant``, arrays as ``dtype``."""
    def cast(a):
        return None if a is None else np.asarray(a).astype(dtype)
    return dict(softcap=variant.softcap, alibi_slopes=cast(variant.alibi_slopes), sink=cast(variant.sink))


def with_window(case, window):
    return replace(case, window_size=window)


# --- the reference from its definition ---------------------------------------------------------

@given(small_case, windows, st.data())
def test_reference_forward_matches_brute_force(case, window, data):
    case = with_window(case, window)
    variant = data.draw(variants(case, parts=None), label="variant")
    q, k, v, _ = make_inputs(case)
    o, lse = reference.attention(q, k, v, **case.kwargs, **variant_options(variant))
    o_bf, lse_bf = brute_force_attention(q, k, v, case, variant)
    assert o.dtype == lse.dtype == np.float64
    assert o.shape == q.shape and lse.shape == case.lse_shape
    np.testing.assert_allclose(o, o_bf, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_bf))
    finite = np.isfinite(lse_bf)
    np.testing.assert_allclose(lse[finite], lse_bf[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("parts", [("softcap",), ("alibi",), ("sink",), PARTS], ids="+".join)
@given(case=tiny_case, window=windows, data=st.data())
def test_reference_backward_matches_finite_differences(parts, case, window, data):
    case = with_window(case, window)
    variant = data.draw(variants(case, parts=parts), label="variant")
    options = dict(case.kwargs, **variant_options(variant, np.float64))  # float64: perturbable sink
    q, k, v, do = make_inputs(case)

    def loss():
        return float(np.sum(do * reference.attention(q, k, v, **options)[0]))

    grads = reference.attention_backward(do, q, k, v, **options)
    inputs = [("dq", q), ("dk", k), ("dv", v)]
    if variant.sink is not None:
        inputs.append(("dsink", options["sink"]))
    assert len(grads) == len(inputs)
    for (name, x), grad in zip(inputs, grads):
        assert grad.shape == x.shape and grad.dtype == np.float64, name
        # Central differences are exact to step^2 * f''' + eps * |loss| / step ~ 1e-9 here.
        np.testing.assert_allclose(grad, numerical_gradient(loss, x), rtol=1e-5, atol=1e-7, err_msg=name)


@given(small_case, windows, st.data())
def test_standard_attention_in_float64_is_the_reference(case, window, data):
    case = with_window(case, window)
    variant = data.draw(variants(case, parts=None), label="variant")
    options = dict(case.kwargs, **variant_options(variant))
    q, k, v, do = make_inputs(case)
    o, lse = reference.attention(q, k, v, **options)
    o_std, lse_std = reference.standard_attention(q, k, v, dtype=np.float64, **options)
    np.testing.assert_allclose(o_std, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse_std), np.isneginf(lse))
    np.testing.assert_allclose(lse_std[np.isfinite(lse)], lse[np.isfinite(lse)], rtol=1e-12, atol=1e-12)
    grads = reference.attention_backward(do, q, k, v, **options)
    grads_std = reference.standard_attention_backward(do, q, k, v, dtype=np.float64, **options)
    assert len(grads_std) == len(grads) == (3 if variant.sink is None else 4)
    for name, std, ref in zip(("dq", "dk", "dv", "dsink"), grads_std, grads):
        np.testing.assert_allclose(std, ref, rtol=1e-12, atol=1e-12, err_msg=name)


# --- rows that see no key ------------------------------------------------------------------------

def hide_first_rows(case, hide_by):
    """``case`` with more queries than keys and a mask that hides the first seqlen_q - seqlen_k
    queries from every key: causal, or the window (0, 0) (the others then see one key each)."""
    longer, shorter = max(case.seqlen_q, case.seqlen_k), min(case.seqlen_q, case.seqlen_k)
    causal, window = (True, (-1, -1)) if hide_by == "causal" else (False, (0, 0))
    return replace(case, causal=causal, window_size=window, seqlen_q=longer + 1, seqlen_k=shorter)


def expected_hidden_lse(variant, case, masked):
    """lse of the hidden rows: the sink of each query head, or -inf without one."""
    shape = (case.batch, case.nheads, masked)
    if variant.sink is None:
        return np.full(shape, -np.inf)
    return np.broadcast_to(variant.sink.astype(np.float64)[None, :, None], shape)


@pytest.mark.parametrize("hide_by", ["causal", "window"])
@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
@given(case=small_case, data=st.data())
def test_reference_hidden_rows(hide_by, with_sink, case, data):
    case = hide_first_rows(case, hide_by)
    parts = data.draw(st.sampled_from([("softcap",), ("alibi",), ("softcap", "alibi")]), label="parts")
    variant = data.draw(variants(case, parts=parts + (("sink",) if with_sink else ())), label="variant")
    options = dict(case.kwargs, **variant_options(variant))
    q, k, v, do = make_inputs(case)
    masked = case.seqlen_q - case.seqlen_k
    o, lse = reference.attention(q, k, v, **options)
    grads = reference.attention_backward(do, q, k, v, **options)
    assert (o[:, :masked] == 0).all()
    np.testing.assert_array_equal(lse[:, :, :masked], expected_hidden_lse(variant, case, masked))
    assert np.isfinite(lse[:, :, masked:]).all()
    assert (grads[0][:, :masked] == 0).all()
    assert all(np.isfinite(x).all() for x in (o, *grads))
    # The hidden queries contribute nothing to dk, dv (and dsink): dropping them changes nothing.
    grads_rest = reference.attention_backward(do[:, masked:], q[:, masked:], k, v, **options)
    np.testing.assert_allclose(grads[0][:, masked:], grads_rest[0], rtol=1e-13, atol=1e-13)
    for name, grad, rest in zip(("dk", "dv", "dsink"), grads[1:], grads_rest[1:]):
        np.testing.assert_allclose(grad, rest, rtol=1e-13, atol=1e-13, err_msg=name)


# --- the NumPy twin against the reference --------------------------------------------------------

def twin_forward(case, variant, q, k, v, **blocks):
    return numpy_backend.forward(q, k, v, softmax_scale=case.scale, causal=case.causal,
                                 window_size=case.window_size, variant=variant, **blocks)


def twin_backward(case, variant, do, q, k, v, o, lse, **blocks):
    return numpy_backend.backward(do, q, k, v, o, lse, softmax_scale=case.scale, causal=case.causal,
                                  window_size=case.window_size, variant=variant, **blocks)


def rounding_allowances(case, options, do, q, k, v, o, o_ref, lse_ref, sink):
    """Bounds on how far (dq, dk, dv, dsink) move because the backward forms D = rowsum(do * o)
    from the o it is handed rather than from the exact o_ref (tolerance.output_rounding_allowance
    for the plain softmax, which standard attention's baseline does not show either).

    An error e_i of D_i moves dS_ij by -P_ij e_i t_ij, t_ij = dz'/dz in [0, 1], so |d dq_i| <=
    scale |e_i| sum_j P_ij |k_j| and |d dk_j| <= scale sum_i P_ij |e_i| |q_i|, both attention
    outputs of the reference (P^T x is the dv of do = x), and |d dsink_h| <= sum_{b, i}
    exp(sink_h - lse_i) |e_i|; dv does not depend on D."""
    q, k, v, do, o, o_ref = (np.asarray(x).astype(np.float64) for x in (q, k, v, do, o, o_ref))
    abs_e = np.abs(np.sum(do * (o - o_ref), axis=-1, keepdims=True))  # (batch, seqlen_q, nheads, 1)
    dq = case.scale * max_abs(abs_e * reference.attention(q, k, np.abs(k), **options)[0])
    dk = case.scale * max_abs(reference.attention_backward(abs_e * np.abs(q), q, k, v, **options)[2])
    dsink = 0.0
    if sink is not None:
        sink_weight = np.exp(sink.astype(np.float64)[None, :, None] - lse_ref)
        dsink = float((sink_weight * np.moveaxis(abs_e[..., 0], 1, 2)).sum(axis=(0, 2)).max(initial=0.0))
    return dq, dk, 0.0, dsink


def check_twin_against_reference(case, variant, q, k, v, do, **blocks):
    """Forward and backward of the twin (and sink_grad from its o and lse) against float64, with
    the tolerance rule of the plain case: for 16-bit dtypes relative to standard attention with
    the same variant in the same dtype."""
    options = dict(case.kwargs, **variant_options(variant))
    o, lse = twin_forward(case, variant, q, k, v, **blocks)
    grads = twin_backward(case, variant, do, q, k, v, o, lse, **blocks)
    (o_ref, lse_ref, grads_ref), (o_std, lse_std, grads_std) = references_and_baselines(
        do, q, k, v, dtype=case.dtype, **options)

    acc = np.float64 if case.dtype == np.float64 else np.float32
    assert o.dtype == case.dtype and o.shape == q.shape
    assert lse.dtype == acc and lse.shape == case.lse_shape
    assert len(grads) == 3
    for grad, x in zip(grads, (q, k, v)):
        assert grad.dtype == case.dtype and grad.shape == x.shape
    assert all(np.isfinite(x.astype(np.float64)).all() for x in (o, *grads))
    assert_close("o", o, o_ref, o_std, dtype=case.dtype)
    assert_close("lse", lse, lse_ref, lse_std, dtype=case.dtype)
    # One scale for the three gradients: dq and dk may cancel to 0 while their terms do not.
    grad_scale = max(max_abs(g) for g in grads_ref[:3])
    allowances = rounding_allowances(case, options, do, q, k, v, o, o_ref, lse_ref, variant.sink)
    for name, grad, ref, std, atol in zip(("dq", "dk", "dv"), grads, grads_ref, grads_std, allowances):
        # flash-attn allows gradients 3x the baseline's error.
        assert_close(name, grad, ref, std, dtype=case.dtype, factor=3.0, scale=grad_scale, atol=atol)
    if variant.sink is not None:
        dsink = sink_grad(variant.sink, do, o, lse)
        assert dsink.dtype == np.float32 and dsink.shape == (case.nheads,)
        # dsink sums exp(sink - lse) D over every row: its terms, not its sum, set the noise.
        d_ref = np.moveaxis(np.sum(do.astype(np.float64) * o_ref, axis=-1), 1, 2)
        terms = np.abs(np.exp(variant.sink.astype(np.float64)[None, :, None] - lse_ref) * d_ref)
        dsink_std = grads_std[3] if case.dtype in SIXTEEN_BIT else None
        # dsink is float32 whatever the inputs: its own rounding is allowed for
        atol = allowances[3] + np.finfo(np.float32).eps / 2 * max_abs(grads_ref[3])
        assert_close("dsink", dsink, grads_ref[3], dsink_std, dtype=case.dtype, factor=3.0,
                     scale=float(terms.sum(axis=(0, 2)).max()), atol=atol)


@pytest.mark.parametrize("parts", [("softcap",), ("alibi",), ("sink",), PARTS, None],
                         ids=lambda parts: "any" if parts is None else "+".join(parts))
@given(case=twin_case, window=windows, block_m=st.sampled_from(BLOCK_SIZES),
       block_n=st.sampled_from(BLOCK_SIZES), data=st.data())
def test_twin_matches_reference(parts, case, window, block_m, block_n, data):
    case = with_window(case, window)
    variant = data.draw(variants(case, parts=parts), label="variant")
    check_twin_against_reference(case, variant, *make_inputs(case), block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("hide_by", ["causal", "window"])
@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
@given(case=attention_case(dtypes=TWIN_DTYPES, max_cost=2e6), data=st.data())
def test_twin_hidden_rows(hide_by, with_sink, case, data):
    case = hide_first_rows(case, hide_by)
    parts = data.draw(st.sampled_from([("softcap",), ("alibi",), ("softcap", "alibi")]), label="parts")
    variant = data.draw(variants(case, parts=parts + (("sink",) if with_sink else ())), label="variant")
    q, k, v, do = make_inputs(case)
    masked = case.seqlen_q - case.seqlen_k
    o, lse = twin_forward(case, variant, q, k, v)
    dq, dk, dv = twin_backward(case, variant, do, q, k, v, o, lse)
    assert (o[:, :masked] == 0).all() and (dq[:, :masked] == 0).all()
    expected = expected_hidden_lse(variant, case, masked)
    np.testing.assert_array_equal(np.isneginf(lse[:, :, :masked]), np.isneginf(expected))
    np.testing.assert_allclose(lse[:, :, :masked][np.isfinite(expected)], expected[np.isfinite(expected)],
                               rtol=4 * np.finfo(lse.dtype).eps)
    check_twin_against_reference(case, variant, q, k, v, do)


# --- sink_grad -----------------------------------------------------------------------------------

@given(small_case, windows, st.data())
def test_sink_grad_matches_reference_dsink(case, window, data):
    """From the reference's o and lse, sink_grad's D formula gives the reference's dsink (which
    comes from the softmax Jacobian) to float32 rounding."""
    case = with_window(case, window)
    variant = data.draw(variants(case, parts=data.draw(st.sampled_from([("sink",), PARTS]))), label="variant")
    options = dict(case.kwargs, **variant_options(variant))
    q, k, v, do = make_inputs(case)
    o, lse = reference.attention(q, k, v, **options)
    dsink_ref = reference.attention_backward(do, q, k, v, **options)[3]
    dsink = sink_grad(variant.sink, do, o, lse)
    assert dsink.dtype == np.float32 and dsink.shape == (case.nheads,)
    terms = np.abs(np.exp(variant.sink.astype(np.float64)[None, :, None] - lse) * np.moveaxis(np.sum(do * o, -1), 1, 2))
    np.testing.assert_allclose(dsink, dsink_ref, rtol=2**-23, atol=1e-12 * (1 + terms.sum()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16], ids=["fp32", "fp64", "bf16"])
@given(seed=st.integers(0, 2**32 - 1), shape=st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 4),
                                                       st.integers(1, 64)))
def test_sink_grad_formula_and_rows_without_lse(dtype, seed, shape):
    """-sum exp(sink - lse) rowsum(do * o) over batch and rows, with rows of lse = -inf adding 0
    whatever their do and o; D in float32 for 16-bit inputs, float64 for float64 ones."""
    batch, seqlen, nheads, headdim = shape
    rng = np.random.default_rng(seed)
    do, o = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    sink = rng.standard_normal(nheads).astype(np.float32)
    acc = np.float64 if dtype == np.float64 else np.float32
    lse = (rng.standard_normal((batch, nheads, seqlen)) + 2.0).astype(acc)
    dead = rng.random(lse.shape) < 0.3
    lse[dead] = -np.inf
    dsink = sink_grad(sink, do, o, lse)
    assert dsink.dtype == np.float32 and dsink.shape == (nheads,)
    terms = np.where(dead, 0.0, np.exp(sink.astype(np.float64)[None, :, None] - np.where(dead, 0.0, lse))
                     * np.moveaxis(np.sum(do.astype(np.float64) * o.astype(np.float64), -1), 1, 2))
    expected = -terms.sum(axis=(0, 2))
    # float32 products and sums of up to 64 and 120 terms; float64 rounds only the result
    rtol = 2**-23 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(dsink, expected, rtol=rtol, atol=rtol * (1 + np.abs(terms).sum(axis=(0, 2)).max()))
