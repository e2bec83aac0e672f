"""The packed layouts on the GPU: the kernels read the strided views of a packed qkv / kv as they are,
so each packed call equals the call on contiguous copies of its parts bitwise, forward and vjp, in
every dtype (tensor cores for 16-bit, float32 and float64), dense and varlen, outputs NaN-poisoned.
The CPU twin of these checks: tests/test_packed.py.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash.testing import poisoned_outputs

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
LENGTHS = [70, 0, 129, 33]


def _device(shape, seed, dtype):
    import cupy

    return cupy.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _same(got, want):
    import cupy

    got, want = cupy.asnumpy(got), cupy.asnumpy(want)
    assert np.isfinite(got.astype(np.float64)).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_equals_contiguous_parts(dtype, causal):
    import cupy

    qkv = _device((2, 200, 3, 4, 64), 1, dtype)
    do = _device((2, 200, 4, 64), 2, dtype)
    with poisoned_outputs():
        o, vjp = cupyflash.flash_attn_qkvpacked_vjp(qkv, causal=causal)
        dqkv = vjp(do)
        parts = [cupy.ascontiguousarray(qkv[:, :, i]) for i in range(3)]
        o_want, vjp_want = cupyflash.flash_attn_vjp(*parts, causal=causal)
        grads_want = vjp_want(do)
    _same(o, o_want)
    for i in range(3):
        _same(dqkv[:, :, i], grads_want[i])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_kvpacked_with_gqa_equals_contiguous_parts(dtype):
    import cupy

    q = _device((2, 150, 8, 128), 3, dtype)
    kv = _device((2, 300, 2, 2, 128), 4, dtype)
    do = _device(q.shape, 5, dtype)
    with poisoned_outputs():
        o, vjp = cupyflash.flash_attn_kvpacked_vjp(q, kv, causal=True, window_size=(64, 0))
        dq, dkv = vjp(do)
        k, v = (cupy.ascontiguousarray(kv[:, :, i]) for i in range(2))
        o_want, vjp_want = cupyflash.flash_attn_vjp(q, k, v, causal=True, window_size=(64, 0))
        dq_want, dk_want, dv_want = vjp_want(do)
    _same(o, o_want)
    _same(dq, dq_want)
    _same(dkv[:, :, 0], dk_want)
    _same(dkv[:, :, 1], dv_want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_varlen_qkvpacked_equals_contiguous_parts(dtype):
    import cupy

    cu = cupy.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32))
    total = int(sum(LENGTHS))
    qkv = _device((total, 3, 4, 64), 6, dtype)
    do = _device((total, 4, 64), 7, dtype)
    with poisoned_outputs():
        o, vjp = cupyflash.flash_attn_varlen_qkvpacked_vjp(qkv, cu, max(LENGTHS), causal=True)
        dqkv = vjp(do)
        parts = [cupy.ascontiguousarray(qkv[:, i]) for i in range(3)]
        o_want, vjp_want = cupyflash.flash_attn_varlen_vjp(*parts, cu, cu, max(LENGTHS), max(LENGTHS), causal=True)
        grads_want = vjp_want(do)
    _same(o, o_want)
    for i in range(3):
        _same(dqkv[:, i], grads_want[i])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_varlen_kvpacked_with_gqa_equals_contiguous_parts(dtype):
    import cupy

    lengths_k = [90, 3, 0, 129]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32))
    q = _device((int(sum(LENGTHS)), 8, 128), 8, dtype)
    kv = _device((int(sum(lengths_k)), 2, 2, 128), 9, dtype)
    do = _device(q.shape, 10, dtype)
    args = (cu_q, cu_k, max(LENGTHS), max(lengths_k))
    with poisoned_outputs():
        o, vjp = cupyflash.flash_attn_varlen_kvpacked_vjp(q, kv, *args, causal=True)
        dq, dkv = vjp(do)
        k, v = (cupy.ascontiguousarray(kv[:, i]) for i in range(2))
        o_want, vjp_want = cupyflash.flash_attn_varlen_vjp(q, k, v, *args, causal=True)
        dq_want, dk_want, dv_want = vjp_want(do)
    _same(o, o_want)
    _same(dq, dq_want)
    _same(dkv[:, 0], dk_want)
    _same(dkv[:, 1], dv_want)
