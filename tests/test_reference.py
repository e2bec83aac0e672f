"""The float64 reference against brute force, finite differences and its own invariants."""
from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupyflash import reference
from strategies import attention_case, make_inputs
from tolerance import rel_fro_error
from brute_force import brute_force_attention, numerical_gradient

FLOAT64 = (np.dtype(np.float64),)
# Small enough for Python loops over rows and keys.
small_case = attention_case(dtypes=FLOAT64, max_seqlen=12, max_cost=20_000, max_headdim=40)
# Small enough for one forward pass per perturbed input entry.
tiny_case = attention_case(dtypes=FLOAT64, max_seqlen=5, max_cost=300, max_headdim=4)


def assert_allclose_with_inf(actual, expected, rtol, atol):
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=rtol, atol=atol)


@given(small_case)
def test_forward_matches_brute_force(case):
    q, k, v, _ = make_inputs(case)
    o, lse = reference.attention(q, k, v, softmax_scale=case.softmax_scale, causal=case.causal)
    o_bf, lse_bf = brute_force_attention(q, k, v, case)
    assert o.dtype == lse.dtype == np.float64
    assert o.shape == q.shape and lse.shape == (case.batch, case.nheads, case.seqlen_q)
    np.testing.assert_allclose(o, o_bf, rtol=1e-12, atol=1e-12)
    assert_allclose_with_inf(lse, lse_bf, rtol=1e-12, atol=1e-12)


@given(tiny_case)
def test_backward_matches_finite_differences(case):
    q, k, v, do = make_inputs(case)
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal)

    def loss():
        return float(np.sum(do * reference.attention(q, k, v, **kwargs)[0]))

    grads = reference.attention_backward(do, q, k, v, **kwargs)
    for name, x, grad in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert grad.shape == x.shape and grad.dtype == np.float64, name
        # Central differences are exact to step^2 * f''' + eps * |loss| / step ~ 1e-9 here.
        np.testing.assert_allclose(
            grad, numerical_gradient(loss, x), rtol=1e-5, atol=1e-7, err_msg=name
        )


def test_causal_alignment_is_bottom_right():
    # seqlen_q < seqlen_k: the last query sees every key, each earlier one a key less.
    np.testing.assert_array_equal(
        reference.visible_keys(3, 5, causal=True),
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
    )
    # seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries see nothing.
    np.testing.assert_array_equal(
        reference.visible_keys(5, 2, causal=True),
        [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]],
    )
    assert reference.visible_keys(2, 3, causal=False).all()


@given(small_case)
def test_causal_row_is_full_attention_over_its_visible_prefix(case):
    case = replace(case, causal=True)
    q, k, v, _ = make_inputs(case)
    o, lse = reference.attention(q, k, v, softmax_scale=case.softmax_scale, causal=True)
    for i in range(case.seqlen_q):
        n = min(max(i + 1 + case.seqlen_k - case.seqlen_q, 0), case.seqlen_k)
        if n == 0:
            assert (o[:, i] == 0).all() and (lse[:, :, i] == -np.inf).all()
            continue
        o_i, lse_i = reference.attention(
            q[:, i : i + 1], k[:, :n], v[:, :n], softmax_scale=case.softmax_scale
        )
        np.testing.assert_allclose(o[:, i : i + 1], o_i, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(lse[:, :, i : i + 1], lse_i, rtol=1e-13, atol=1e-13)


@given(small_case)
def test_fully_masked_rows_give_zero_output_and_gradient(case):
    # Causal with more queries than keys: the first seqlen_q - seqlen_k queries see no key.
    longer, shorter = max(case.seqlen_q, case.seqlen_k), min(case.seqlen_q, case.seqlen_k)
    case = replace(case, causal=True, seqlen_q=longer + 1, seqlen_k=shorter)
    q, k, v, do = make_inputs(case)
    masked = case.seqlen_q - case.seqlen_k
    kwargs = dict(softmax_scale=case.softmax_scale, causal=True)
    o, lse = reference.attention(q, k, v, **kwargs)
    dq, dk, dv = reference.attention_backward(do, q, k, v, **kwargs)
    assert (o[:, :masked] == 0).all() and (lse[:, :, :masked] == -np.inf).all()
    assert (dq[:, :masked] == 0).all()
    assert all(np.isfinite(x).all() for x in (o, dq, dk, dv))
    # The masked queries contribute nothing to dk, dv: dropping them changes nothing.
    dq_rest, dk_rest, dv_rest = reference.attention_backward(
        do[:, masked:], q[:, masked:], k, v, **kwargs
    )
    np.testing.assert_allclose(dq[:, masked:], dq_rest, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(dk, dk_rest, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(dv, dv_rest, rtol=1e-13, atol=1e-13)


@given(small_case, st.data())
def test_non_finite_masked_keys_do_not_leak(case, data):
    case = replace(case, causal=True)
    q, k, v, do = make_inputs(case)
    first_bad = data.draw(st.integers(0, case.seqlen_k - 1), label="first_bad_key")
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[:, first_bad:] = np.nan
    v_bad[:, first_bad:] = np.inf
    kwargs = dict(softmax_scale=case.softmax_scale, causal=True)
    # Queries whose visible keys all lie before first_bad.
    clean = reference.visible_keys(case.seqlen_q, case.seqlen_k, True)[:, first_bad:].sum(1) == 0
    o, lse = reference.attention(q, k, v, **kwargs)
    with np.errstate(invalid="ignore"):
        o_bad, lse_bad = reference.attention(q, k_bad, v_bad, **kwargs)
        dq_bad = reference.attention_backward(do, q, k_bad, v_bad, **kwargs)[0]
    np.testing.assert_array_equal(o_bad[:, clean], o[:, clean])
    np.testing.assert_array_equal(lse_bad[:, :, clean], lse[:, :, clean])
    dq = reference.attention_backward(do, q, k, v, **kwargs)[0]
    np.testing.assert_array_equal(dq_bad[:, clean], dq[:, clean])


@given(small_case)
def test_gqa_equals_repeated_kv_heads(case):
    q, k, v, do = make_inputs(case)
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal)
    k_rep, v_rep = (np.repeat(x, case.group, axis=2) for x in (k, v))
    o, lse = reference.attention(q, k, v, **kwargs)
    o_rep, lse_rep = reference.attention(q, k_rep, v_rep, **kwargs)
    np.testing.assert_allclose(o, o_rep, rtol=1e-13, atol=1e-13)
    assert_allclose_with_inf(lse, lse_rep, rtol=1e-13, atol=1e-13)
    dq, dk, dv = reference.attention_backward(do, q, k, v, **kwargs)
    dq_rep, dk_rep, dv_rep = reference.attention_backward(do, q, k_rep, v_rep, **kwargs)

    def sum_groups(x):
        b, s, h, d = x.shape
        return x.reshape(b, s, h // case.group, case.group, d).sum(axis=3)

    np.testing.assert_allclose(dq, dq_rep, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(dk, sum_groups(dk_rep), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, sum_groups(dv_rep), rtol=1e-12, atol=1e-12)


@given(small_case)
def test_default_scale_is_inverse_sqrt_headdim(case):
    q, k, v, _ = make_inputs(case)
    o, lse = reference.attention(q, k, v, causal=case.causal)
    o_explicit, lse_explicit = reference.attention(
        q, k, v, softmax_scale=1 / math.sqrt(case.headdim), causal=case.causal
    )
    np.testing.assert_array_equal(o, o_explicit)
    np.testing.assert_array_equal(lse, lse_explicit)


@pytest.mark.parametrize("empty", ["q", "k", "both"])
@given(case=small_case)
def test_empty_sequences(case, empty):
    case = replace(
        case,
        seqlen_q=0 if empty in ("q", "both") else case.seqlen_q,
        seqlen_k=0 if empty in ("k", "both") else case.seqlen_k,
    )
    q, k, v, do = make_inputs(case)
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal)
    o, lse = reference.attention(q, k, v, **kwargs)
    dq, dk, dv = reference.attention_backward(do, q, k, v, **kwargs)
    assert o.shape == q.shape and lse.shape == (case.batch, case.nheads, case.seqlen_q)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert (o == 0).all() and (lse == -np.inf).all()
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@given(small_case)
def test_standard_attention_in_float64_is_the_reference(case):
    q, k, v, do = make_inputs(case)
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal)
    o, lse = reference.attention(q, k, v, **kwargs)
    o_std, lse_std = reference.standard_attention(q, k, v, dtype=np.float64, **kwargs)
    np.testing.assert_allclose(o_std, o, rtol=1e-12, atol=1e-12)
    assert_allclose_with_inf(lse_std, lse, rtol=1e-12, atol=1e-12)
    for name, std, ref in zip(
        ("dq", "dk", "dv"),
        reference.standard_attention_backward(do, q, k, v, dtype=np.float64, **kwargs),
        reference.attention_backward(do, q, k, v, **kwargs),
    ):
        np.testing.assert_allclose(std, ref, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@given(seed=st.integers(0, 2**32 - 1))
def test_standard_attention_in_16_bit_is_a_fair_baseline(dtype, causal, seed):
    """Its error is that of a 16-bit computation: above rounding the exact result to the dtype
    (it rounds S and P too), but by a small factor only (on this shape, 1.8-3.1 measured)."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, 128, 2, 64)).astype(dtype) for _ in range(4))
    o, _ = reference.standard_attention(q, k, v, causal=causal, dtype=dtype)
    grads = reference.standard_attention_backward(do, q, k, v, causal=causal, dtype=dtype)
    exact = (
        reference.attention(q, k, v, causal=causal)[0],
        *reference.attention_backward(do, q, k, v, causal=causal),
    )
    for name, std, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), exact):
        assert std.dtype == np.dtype(dtype), name
        ratio = rel_fro_error(std, ref) / rel_fro_error(ref.astype(dtype), ref)
        assert 1.3 < ratio < 6, f"{name}: baseline error / rounding error = {ratio:.2f}"
