"""The NumPy twin of the tiled algorithm against the float64 reference."""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupyflash import numpy_backend
from strategies import attention_case, make_inputs
from tolerance import (
    assert_close,
    bound,
    max_abs,
    output_rounding_allowance,
    references_and_baselines,
)

# Block sizes the kernels use, and odd ones that leave ragged edges on both axes.
BLOCK_SIZES = (16, 32, 48, 64, 80, 128)


def twin_forward(case, q, k, v, **blocks):
    return numpy_backend.forward(q, k, v, softmax_scale=case.scale, causal=case.causal, **blocks)


def twin_backward(case, do, q, k, v, o, lse, **blocks):
    return numpy_backend.backward(
        do, q, k, v, o, lse, softmax_scale=case.scale, causal=case.causal, **blocks
    )


def check_against_reference(case, q, k, v, do):
    """Forward and backward of the twin against float64, with the dtype's tolerance rule."""
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal)
    o, lse = twin_forward(case, q, k, v)
    grads = twin_backward(case, do, q, k, v, o, lse)
    (o_ref, lse_ref, grads_ref), (o_std, lse_std, grads_std) = references_and_baselines(
        do, q, k, v, dtype=case.dtype, **kwargs)

    acc = np.float64 if case.dtype == np.float64 else np.float32
    assert o.dtype == case.dtype and o.shape == q.shape
    assert lse.dtype == acc and lse.shape == (case.batch, case.nheads, case.seqlen_q)
    for grad, x in zip(grads, (q, k, v)):
        assert grad.dtype == case.dtype and grad.shape == x.shape
    assert_close("o", o, o_ref, o_std, dtype=case.dtype)
    assert_close("lse", lse, lse_ref, lse_std, dtype=case.dtype)
    # One scale for the three gradients: dq and dk may cancel to 0 while their terms do not.
    grad_scale = max(max_abs(g) for g in grads_ref)
    allowances = output_rounding_allowance(do, q, k, v, o, o_ref, **kwargs)
    for name, grad, ref, std, atol in zip(
        ("dq", "dk", "dv"), grads, grads_ref, grads_std, allowances
    ):
        # flash-attn allows gradients 3x the baseline's error.
        assert_close(
            name, grad, ref, std, dtype=case.dtype, factor=3.0, scale=grad_scale, atol=atol
        )


@given(attention_case())
def test_matches_reference(case):
    check_against_reference(case, *make_inputs(case))


def assert_same_up_to_rounding(name, a, b, dtype, scale=None):
    """a and b agree within the accuracy bound of ``dtype`` (tolerance.bound; blockings round
    differently, as much as either differs from float64), plus one unit in the last place of
    ``dtype`` (two accumulator results straddling a rounding boundary of the output dtype)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=name)
    finite = np.isfinite(b)
    if not finite.any():
        return
    ulp = float(ml_dtypes.finfo(dtype).eps) * max_abs(b)
    err = np.abs(a[finite] - b[finite]).max()
    allowed = bound(b, dtype=dtype, scale=scale) + ulp
    assert err <= allowed, f"{name}: blockings differ by {err:.3e} > {allowed:.3e}"


@given(attention_case(), st.sampled_from(BLOCK_SIZES), st.sampled_from(BLOCK_SIZES))
def test_independent_of_block_sizes(case, block_m, block_n):
    q, k, v, do = make_inputs(case)
    o, lse = twin_forward(case, q, k, v)
    o_b, lse_b = twin_forward(case, q, k, v, block_m=block_m, block_n=block_n)
    assert_same_up_to_rounding("o", o_b, o, case.dtype)
    assert_same_up_to_rounding("lse", lse_b, lse, lse.dtype)
    grads = twin_backward(case, do, q, k, v, o, lse)
    grads_b = twin_backward(case, do, q, k, v, o, lse, block_m=block_m, block_n=block_n)
    grad_scale = max(max_abs(g) for g in grads)
    for name, g_b, g in zip(("dq", "dk", "dv"), grads_b, grads):
        assert_same_up_to_rounding(name, g_b, g, case.dtype, scale=grad_scale)


@given(attention_case(), st.sampled_from(["q", "k", "both"]))
def test_empty_sequences(case, empty):
    case = replace(
        case,
        seqlen_q=0 if empty in ("q", "both") else case.seqlen_q,
        seqlen_k=0 if empty in ("k", "both") else case.seqlen_k,
    )
    q, k, v, do = make_inputs(case)
    o, lse = twin_forward(case, q, k, v)
    dq, dk, dv = twin_backward(case, do, q, k, v, o, lse)
    assert o.shape == q.shape and lse.shape == (case.batch, case.nheads, case.seqlen_q)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert (o == 0).all() and (lse == -np.inf).all()
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@given(attention_case())
def test_fully_masked_rows(case):
    # Causal with more queries than keys: the first seqlen_q - seqlen_k queries see no key.
    longer, shorter = max(case.seqlen_q, case.seqlen_k), min(case.seqlen_q, case.seqlen_k)
    case = replace(case, causal=True, seqlen_q=longer + 1, seqlen_k=shorter)
    q, k, v, do = make_inputs(case)
    masked = case.seqlen_q - case.seqlen_k
    o, lse = twin_forward(case, q, k, v)
    dq, dk, dv = twin_backward(case, do, q, k, v, o, lse)
    assert (o[:, :masked] == 0).all() and (lse[:, :, :masked] == -np.inf).all()
    assert (dq[:, :masked] == 0).all()
    assert all(np.isfinite(x.astype(np.float64)).all() for x in (o, dq, dk, dv))
    check_against_reference(case, q, k, v, do)


# --- batch and heads beyond one launch: the API's chunks ----------------------------------------

def test_chunks_cover_every_batch_and_head_once_with_whole_groups():
    from cupyflash.api import _chunks

    for batch, nheads, nheads_kv, limit in [(7, 6, 2, 3), (5, 12, 4, 7), (3, 8, 1, 3), (4, 9, 3, 2),
                                            (1, 4, 4, 65535), (130, 1, 1, 64)]:
        group = nheads // nheads_kv
        seen = np.zeros((batch, nheads), int)
        for b, h, kv in _chunks(batch, nheads, nheads_kv, limit):
            assert 0 < b.stop - b.start <= limit and 0 < h.stop - h.start <= limit
            seen[b, h] += 1
            # the chunk's kv heads are exactly those its query heads read
            assert (kv.start, kv.stop) == (h.start // group, (h.stop - 1) // group + 1)
            if group <= limit:
                assert h.start % group == 0 and h.stop % group == 0  # whole GQA groups
        assert (seen == 1).all()


CHUNKED_CASES = [  # (batch, nheads, nheads_kv, limit)
    (7, 2, 2, 3),  # batch in chunks
    (2, 6, 2, 3),  # heads in chunks of whole groups
    (5, 12, 4, 7),  # both, the last chunks short
    (3, 8, 1, 3),  # one GQA group larger than a launch: dk, dv added over its parts
]


@pytest.mark.parametrize("batch,nheads,nheads_kv,limit", CHUNKED_CASES)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float64], ids=["bf16", "fp64"])
def test_chunked_calls_equal_one_launch(monkeypatch, batch, nheads, nheads_kv, limit, dtype):
    """The API's chunking runs on every backend; here on the NumPy twin, where one launch of the
    whole problem is the reference. Chunked outputs start NaN (poisoned), so a missed chunk fails."""
    import cupyflash
    from cupyflash import api
    from cupyflash.testing import poisoned_outputs

    rng = np.random.default_rng(batch * 100 + nheads)
    q = rng.standard_normal((batch, 9, nheads, 8)).astype(dtype)
    k, v = (rng.standard_normal((batch, 11, nheads_kv, 8)).astype(dtype) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(dtype)

    def run():
        o, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True, backend="numpy")
        return (o, lse, *cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=True, backend="numpy"))

    whole = run()
    calls = []
    real_forward = numpy_backend.forward
    monkeypatch.setattr(numpy_backend, "forward", lambda q, *a, **kw: calls.append(q.shape) or real_forward(q, *a, **kw))
    monkeypatch.setattr(api, "MAX_GRID_YZ", limit)
    with poisoned_outputs():
        chunked = run()
    assert len(calls) == len(api._chunks(batch, nheads, nheads_kv, limit)) > 1
    assert all(shape[0] <= limit and shape[2] <= limit for shape in calls)
    group_split = nheads // nheads_kv > limit
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), chunked, whole):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if group_split and name in ("dk", "dv"):
            # each part rounded to the dtype, then added in the accumulator: one rounding per part
            eps = float(ml_dtypes.finfo(dtype).eps)
            np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64),
                                       rtol=4 * eps, atol=4 * eps * max_abs(b), err_msg=name)
        else:
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
