"""The packed layouts (cupyflash.packed: flash-attn's qkvpacked / kvpacked functions and their varlen
forms) on the NumPy twin: each equals the unpacked call bitwise (the same computation on views),
matches the float64 reference, its vjp stacks the unpacked call's gradients into one array shaped
like the packed input; the shape errors. GPU: tests/test_packed_gpu.py (the kernels on the strided
views).
"""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import reference

LENGTHS = [5, 0, 3, 7]  # one empty sequence
LENGTHS_K = [4, 2, 0, 6]  # one sequence with queries and no keys


def _random(shape, seed, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal, window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_qkvpacked_is_the_unpacked_call(dtype, causal, window_size):
    qkv = _random((2, 9, 3, 4, 16), 1, dtype)
    options = dict(causal=causal, window_size=window_size, softcap=3.0, backend="numpy", return_lse=True)
    o, lse = cupyflash.flash_attn_qkvpacked_func(qkv, **options)
    q, k, v = (np.ascontiguousarray(qkv[:, :, i]) for i in range(3))
    o_want, lse_want = cupyflash.flash_attn_func(q, k, v, **options)
    np.testing.assert_array_equal(o, o_want)
    np.testing.assert_array_equal(lse, lse_want)
    if dtype == np.float64:
        o_ref, lse_ref = reference.attention(q, k, v, causal=causal, window_size=window_size, softcap=3.0)
        np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_vjp_stacks_the_gradients(causal):
    qkv = _random((2, 7, 3, 2, 8), 2)
    do = _random((2, 7, 2, 8), 3)
    o, vjp = cupyflash.flash_attn_qkvpacked_vjp(qkv, causal=causal, backend="numpy")
    dqkv = vjp(do)
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype
    q, k, v = (qkv[:, :, i] for i in range(3))
    o_want, vjp_want = cupyflash.flash_attn_vjp(q, k, v, causal=causal, backend="numpy")
    np.testing.assert_array_equal(o, o_want)
    for i, want in enumerate(vjp_want(do)):
        np.testing.assert_array_equal(dqkv[:, :, i], want)
    for i, want in enumerate(reference.attention_backward(do, q, k, v, causal=causal)):
        np.testing.assert_allclose(dqkv[:, :, i], want, rtol=1e-10, atol=1e-10)


def test_kvpacked_with_gqa_and_a_sink():
    q = _random((2, 5, 4, 8), 4)
    kv = _random((2, 6, 2, 2, 8), 5)  # 4 query heads over 2 kv heads
    sink = _random((4,), 6).astype(np.float32)
    do = _random(q.shape, 7)
    o, vjp = cupyflash.flash_attn_kvpacked_vjp(q, kv, causal=True, sink=sink, backend="numpy")
    dq, dkv, dsink = vjp(do)
    assert dkv.shape == kv.shape and dq.shape == q.shape and dsink.shape == sink.shape
    o_want, vjp_want = cupyflash.flash_attn_vjp(q, kv[:, :, 0], kv[:, :, 1], causal=True, sink=sink, backend="numpy")
    np.testing.assert_array_equal(o, o_want)
    np.testing.assert_array_equal(cupyflash.flash_attn_kvpacked_func(q, kv, causal=True, sink=sink, backend="numpy"),
                                  o_want)
    dq_want, dk_want, dv_want, dsink_want = vjp_want(do)
    np.testing.assert_array_equal(dq, dq_want)
    np.testing.assert_array_equal(dkv[:, :, 0], dk_want)
    np.testing.assert_array_equal(dkv[:, :, 1], dv_want)
    np.testing.assert_array_equal(dsink, dsink_want)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_qkvpacked(causal):
    cu = _cu(LENGTHS)
    qkv = _random((int(cu[-1]), 3, 2, 8), 8)
    do = _random((int(cu[-1]), 2, 8), 9)
    o = cupyflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(LENGTHS), causal=causal, backend="numpy")
    o_vjp, vjp = cupyflash.flash_attn_varlen_qkvpacked_vjp(qkv, cu, max(LENGTHS), causal=causal, backend="numpy")
    dqkv = vjp(do)
    q, k, v = (qkv[:, i] for i in range(3))
    o_ref, _ = reference.varlen_attention(q, k, v, cu, cu, causal=causal)
    np.testing.assert_array_equal(o, o_vjp)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    assert dqkv.shape == qkv.shape
    for i, want in enumerate(reference.varlen_attention_backward(do, q, k, v, cu, cu, causal=causal)):
        np.testing.assert_allclose(dqkv[:, i], want, rtol=1e-10, atol=1e-10)


def test_varlen_kvpacked_with_gqa():
    cu_q, cu_k = _cu(LENGTHS), _cu(LENGTHS_K)
    q = _random((int(cu_q[-1]), 4, 8), 10)
    kv = _random((int(cu_k[-1]), 2, 1, 8), 11)
    do = _random(q.shape, 12)
    args = (cu_q, cu_k, max(LENGTHS), max(LENGTHS_K))
    o, vjp = cupyflash.flash_attn_varlen_kvpacked_vjp(q, kv, *args, backend="numpy")
    dq, dkv = vjp(do)
    o_want, vjp_want = cupyflash.flash_attn_varlen_vjp(q, kv[:, 0], kv[:, 1], *args, backend="numpy")
    np.testing.assert_array_equal(cupyflash.flash_attn_varlen_kvpacked_func(q, kv, *args, backend="numpy"), o_want)
    np.testing.assert_array_equal(o, o_want)
    dq_want, dk_want, dv_want = vjp_want(do)
    np.testing.assert_array_equal(dq, dq_want)
    np.testing.assert_array_equal(dkv[:, 0], dk_want)
    np.testing.assert_array_equal(dkv[:, 1], dv_want)


@pytest.mark.parametrize("call, shape, message", [
    (lambda x: cupyflash.flash_attn_qkvpacked_func(x, backend="numpy"), (2, 4, 2, 2, 8), r"qkv must be \(batch, seqlen, 3"),
    (lambda x: cupyflash.flash_attn_qkvpacked_func(x, backend="numpy"), (4, 3, 2, 8), r"got shape \(4, 3, 2, 8\)"),
    (lambda x: cupyflash.flash_attn_kvpacked_func(np.zeros((2, 4, 2, 8)), x, backend="numpy"), (2, 4, 3, 2, 8),
     r"kv must be \(batch, seqlen_k, 2"),
    (lambda x: cupyflash.flash_attn_varlen_qkvpacked_func(x, _cu([4]), 4, backend="numpy"), (4, 2, 2, 8),
     r"qkv must be \(total, 3"),
    (lambda x: cupyflash.flash_attn_varlen_kvpacked_func(np.zeros((4, 2, 8)), x, _cu([4]), _cu([4]), 4, 4,
                                                         backend="numpy"), (2, 4, 2, 8), r"kv must be \(total_k, 2"),
])
def test_wrong_packed_shapes_are_refused(call, shape, message):
    with pytest.raises(ValueError, match=message):
        call(np.ones(shape))


def test_a_non_array_is_refused():
    with pytest.raises(TypeError, match="qkv must be an array"):
        cupyflash.flash_attn_qkvpacked_func([[1.0]], backend="numpy")
