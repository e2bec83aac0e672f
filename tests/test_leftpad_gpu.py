"""cache_leftpad on the GPU: the KV-cache kernel reaches a left-padded sequence through a table of
rows (kvcache.row_page_table, params.set_cache_rows), so its result equals bitwise the plain call on
a cache whose rows are shifted to start at each sequence's first token (the same keys in the same
order), for 16-bit (the kernel) and float32 (the per-sequence path), with cache_batch_idx; the
append lands at cache_seqlens; the unread path (no_host_sync, device lengths, the append kernel)
equals the checked one. CPU checks against the reference: tests/test_leftpad.py.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import cupyflash
from cupyflash import reference
from cupyflash.testing import poisoned_outputs
from cupyflash.testing.strategies import kvcache_problems
from kvcache_checks import assert_call_result, assert_same_bytes

pytestmark = pytest.mark.gpu


def _inputs(dtype, seed=0, batch=4, capacity=512, new=2, nheads=8, nheads_kv=2, headdim=128):
    rng = np.random.default_rng(seed)
    ends = rng.integers(1, capacity - new, batch).astype(np.int32)
    leftpad = (rng.integers(0, 2**31, batch) % (ends + 1)).astype(np.int32)
    leftpad[0] = 0  # one sequence without padding
    k_cache = rng.standard_normal((batch + 1, capacity, nheads_kv, headdim)).astype(dtype)
    v_cache = rng.standard_normal((batch + 1, capacity, nheads_kv, headdim)).astype(dtype)
    q = rng.standard_normal((batch, new, nheads, headdim)).astype(dtype)
    k = rng.standard_normal((batch, new, nheads_kv, headdim)).astype(dtype)
    v = rng.standard_normal((batch, new, nheads_kv, headdim)).astype(dtype)
    rows = rng.permutation(batch + 1)[:batch].astype(np.int32)
    return q, k_cache, v_cache, k, v, ends, leftpad, rows


def _shifted(cache, ends, leftpad, rows):
    """Row b of the result: sequence b's cached tokens from position 0 (the unpadded layout)."""
    out = np.zeros((len(rows),) + cache.shape[1:], cache.dtype)
    for b, (start, end, row) in enumerate(zip(leftpad, ends, rows)):
        out[b, : end - start] = cache[row, start:end]
    return out


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("causal", [True, False])
def test_left_padded_equals_the_shifted_cache(dtype, causal):
    import cupy

    q, k_cache, v_cache, k, v, ends, leftpad, rows = _inputs(dtype)
    before = k_cache.copy(), v_cache.copy()
    caches = [cupy.asarray(c) for c in (k_cache, v_cache)]
    shifted = [cupy.asarray(_shifted(c, ends, leftpad, rows)) for c in (k_cache, v_cache)]
    with poisoned_outputs():
        o = cupyflash.flash_attn_with_kvcache(cupy.asarray(q), *caches, cupy.asarray(k), cupy.asarray(v),
                                              cache_seqlens=ends, cache_batch_idx=rows, cache_leftpad=leftpad,
                                              causal=causal, num_splits=2)
        o_plain = cupyflash.flash_attn_with_kvcache(cupy.asarray(q), *shifted, cupy.asarray(k), cupy.asarray(v),
                                                    cache_seqlens=ends - leftpad, causal=causal, num_splits=2)
    assert np.isfinite(cupy.asnumpy(o).astype(np.float64)).all()
    assert_same_bytes("o", cupy.asnumpy(o), cupy.asnumpy(o_plain))
    where = dict(cache_seqlens=ends, cache_batch_idx=rows)
    assert_same_bytes("k_cache", caches[0].get(), reference.kvcache_appended(before[0], k, **where))
    assert_same_bytes("v_cache", caches[1].get(), reference.kvcache_appended(before[1], v, **where))


def test_unread_lengths_give_the_checked_result():
    import cupy

    q, k_cache, v_cache, k, v, ends, leftpad, rows = _inputs(ml_dtypes.bfloat16, seed=1)
    checked = [cupy.asarray(c) for c in (k_cache, v_cache)]
    unread = [cupy.asarray(c) for c in (k_cache, v_cache)]
    device = [cupy.asarray(x) for x in (q, k, v)]
    with poisoned_outputs():
        o_checked = cupyflash.flash_attn_with_kvcache(device[0], *checked, device[1], device[2], cache_seqlens=ends,
                                                      cache_batch_idx=rows, cache_leftpad=leftpad, causal=True,
                                                      num_splits=1)
        with cupyflash.no_host_sync():
            o_unread = cupyflash.flash_attn_with_kvcache(device[0], *unread, device[1], device[2],
                                                         cache_seqlens=cupy.asarray(ends),
                                                         cache_batch_idx=cupy.asarray(rows),
                                                         cache_leftpad=cupy.asarray(leftpad), causal=True,
                                                         num_splits=1)
    assert_same_bytes("o", cupy.asnumpy(o_unread), cupy.asnumpy(o_checked))
    assert_same_bytes("k_cache", unread[0].get(), checked[0].get())
    assert_same_bytes("v_cache", unread[1].get(), checked[1].get())


@settings(max_examples=40)
@given(problem=kvcache_problems(dtypes=[np.float16, ml_dtypes.bfloat16, np.float32], page_sizes=[None], windows=True,
                                max_capacity=1100, max_new=8, max_seqlen_q=8, max_group=8, max_cost=8e6,
                                leftpad=True))
def test_property_on_the_device(problem):
    """Half the drawn problems left-padded, their index arrays on the device for odd seeds (the
    unread path: 16-bit only, so float32 keeps them on the host)."""
    import cupy

    before = problem.inputs()
    unread = problem.seed % 2 == 1 and problem.dtype != np.float32
    inputs = {name: x if x is None or np.ndim(x) == 0 or (name in ("cache_seqlens", "cache_batch_idx",
                                                                    "cache_leftpad") and not unread)
              else cupy.asarray(x) for name, x in problem.inputs().items()}
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_softmax_lse=True, **problem.kwargs)
    assert_call_result(problem, before, inputs, o, lse)
