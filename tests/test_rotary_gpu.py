"""Rotary embeddings in flash_attn_with_kvcache on the GPU. The rotation is kernels_cu/flash_rotary.cu,
whose arithmetic is cupyflash.rotary's array code operation for operation (no contraction into an
FMA): the cache's rotated keys equal the host rotation (the array code on NumPy) bitwise; the output
equals the call without rotary on host-rotated q and k bitwise (the same attention kernel on the
same inputs), on the KV-cache kernel (16-bit) and the per-sequence path (float32, float64),
contiguous and paged; the unread path (no_host_sync, device cache_seqlens) equals the checked one.
CPU reference checks: tests/test_rotary.py.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash.rotary import Rotary
from cupyflash.testing import poisoned_outputs
from kvcache_checks import assert_same_bytes

pytestmark = pytest.mark.gpu


def _inputs(dtype, paged, seed=0, batch=4, capacity=256, new=1, nheads=8, nheads_kv=2, headdim=128, half=32):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, capacity - new, batch).astype(np.int32)
    if paged:
        pages = batch * capacity // 16
        k_cache = rng.standard_normal((pages, 16, nheads_kv, headdim)).astype(dtype)
        v_cache = rng.standard_normal((pages, 16, nheads_kv, headdim)).astype(dtype)
        table = rng.permutation(pages).reshape(batch, capacity // 16).astype(np.int32)
    else:
        k_cache = rng.standard_normal((batch, capacity, nheads_kv, headdim)).astype(dtype)
        v_cache = rng.standard_normal((batch, capacity, nheads_kv, headdim)).astype(dtype)
        table = None
    q = rng.standard_normal((batch, new, nheads, headdim)).astype(dtype)
    k = rng.standard_normal((batch, new, nheads_kv, headdim)).astype(dtype)
    v = rng.standard_normal((batch, new, nheads_kv, headdim)).astype(dtype)
    theta = rng.uniform(0, 2 * np.pi, (capacity, half))
    return q, k_cache, v_cache, k, v, lengths, table, np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_is_the_host_rotation_then_the_plain_call(dtype, paged, interleaved):
    import cupy

    q, k_cache, v_cache, k, v, lengths, table, cos, sin = _inputs(dtype, paged)
    rotary = Rotary(cos, sin, interleaved)
    q_ro = rotary.apply(q, rotary.positions(lengths.astype(np.int64), 1, True))
    k_ro = rotary.apply(k, rotary.positions(lengths.astype(np.int64), 1, True))
    device = lambda x: None if x is None else cupy.asarray(x)  # noqa: E731
    caches = [device(k_cache), device(v_cache)]
    plain_caches = [device(k_cache), device(v_cache)]
    with poisoned_outputs():
        o = cupyflash.flash_attn_with_kvcache(device(q), *caches, device(k), device(v), cache_seqlens=lengths,
                                              block_table=device(table), rotary_cos=device(cos),
                                              rotary_sin=device(sin), rotary_interleaved=interleaved, causal=True)
        o_plain = cupyflash.flash_attn_with_kvcache(device(q_ro), *plain_caches, device(k_ro), device(v),
                                                    cache_seqlens=lengths, block_table=device(table), causal=True)
    assert np.isfinite(cupy.asnumpy(o).astype(np.float64)).all()
    assert_same_bytes("o", cupy.asnumpy(o), cupy.asnumpy(o_plain))
    assert_same_bytes("k_cache", caches[0].get(), plain_caches[0].get())
    assert_same_bytes("v_cache", caches[1].get(), plain_caches[1].get())


@pytest.mark.parametrize("paged", [False, True])
def test_unread_lengths_give_the_checked_result(paged):
    import cupy

    q, k_cache, v_cache, k, v, lengths, table, cos, sin = _inputs(ml_dtypes.bfloat16, paged, seed=1)
    device = lambda x: None if x is None else cupy.asarray(x)  # noqa: E731
    checked_caches = [device(k_cache), device(v_cache)]
    unread_caches = [device(k_cache), device(v_cache)]
    # one split: the unread call's grid is the capacity's, the checked call's the longest sequence's,
    # and with the split count left to the heuristic the two may split the keys differently
    arguments = dict(block_table=device(table), rotary_cos=device(cos), rotary_sin=device(sin), causal=True,
                     num_splits=1)
    with poisoned_outputs():
        o_checked = cupyflash.flash_attn_with_kvcache(device(q), *checked_caches, device(k), device(v),
                                                      cache_seqlens=lengths, **arguments)
        with cupyflash.no_host_sync():
            o_unread = cupyflash.flash_attn_with_kvcache(device(q), *unread_caches, device(k), device(v),
                                                         cache_seqlens=device(lengths), **arguments)
    assert_same_bytes("o", cupy.asnumpy(o_unread), cupy.asnumpy(o_checked))
    assert_same_bytes("k_cache", unread_caches[0].get(), checked_caches[0].get())


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_subnormals_survive_the_kernel_as_in_numpy(dtype):
    """The library compiles with -ftz=true; the rotation's explicit PTX keeps subnormals, so rows of
    subnormal values turn as NumPy turns them (not flushed to 0)."""
    import cupy

    from cupyflash.rotary import Rotary

    rng = np.random.default_rng(3)
    tiny = float(np.finfo(np.float32).tiny)
    x = (rng.uniform(-1, 1, (2, 3, 4, 16)) * tiny * 0.5).astype(dtype)  # float32 subnormals
    theta = rng.uniform(0, 2 * np.pi, (40, 8))
    cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
    starts = np.array([5, 17], np.int64)
    for interleaved in (True, False):
        rotary = Rotary(cos, sin, interleaved)
        want = rotary.apply(x, rotary.positions(starts, 3, True))
        got = Rotary(cupy.asarray(cos), cupy.asarray(sin), interleaved).turn(cupy.asarray(x), cupy.asarray(
            starts.astype(np.int32)), per_token=True)
        assert np.count_nonzero(want.astype(np.float32)) > 0
        assert_same_bytes("rotated", cupy.asnumpy(got), want)
