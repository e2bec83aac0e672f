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


def _assert_matches_reference(o, q, before, k, v, ends, leftpad, rows, dtype, mask_mod=None, **options):
    """o against reference.kvcache_attention under the tolerance rule (16-bit: standard attention in
    the dtype, sequence by sequence, as the baseline)."""
    import cupy

    from cupyflash.testing.tolerance import OUTPUT_FACTOR, assert_close

    where = dict(cache_seqlens=ends, cache_batch_idx=rows, cache_leftpad=leftpad)
    sequences = reference.kvcache_sequences(len(ends), *before, k, v, **where)
    o_ref, o_std = np.zeros(o.shape), np.zeros(o.shape)
    for b, (keys, values) in enumerate(sequences):
        extra = {} if mask_mod is None else dict(mask_mod=lambda b_, h, i, j: mask_mod(b, h, i, j))
        o_ref[b] = reference.attention(q[b:b + 1], keys[None], values[None], **options, **extra)[0][0]
        o_std[b] = reference.standard_attention(q[b:b + 1], keys[None], values[None], dtype=dtype, **options,
                                                **extra)[0][0]
    assert_close("o", cupy.asnumpy(o), o_ref, o_std, dtype=dtype, factor=OUTPUT_FACTOR)


def test_caches_the_rows_cannot_express_take_the_per_sequence_path():
    """k and v rows a different number of rows apart (views of larger caches): no one table of rows
    reaches both, so the call runs sequence by sequence; the result is still the reference's."""
    import cupy

    dtype = ml_dtypes.bfloat16
    q, k_cache, v_cache, k, v, ends, leftpad, rows = _inputs(dtype, seed=2)
    capacity = k_cache.shape[1]
    k_big = cupy.zeros((k_cache.shape[0], 2 * capacity) + k_cache.shape[2:], dtype)
    v_big = cupy.zeros((v_cache.shape[0], 3 * capacity) + v_cache.shape[2:], dtype)
    k_big[:, :capacity], v_big[:, :capacity] = cupy.asarray(k_cache), cupy.asarray(v_cache)
    with poisoned_outputs():
        o = cupyflash.flash_attn_with_kvcache(cupy.asarray(q), k_big[:, :capacity], v_big[:, :capacity],
                                              cupy.asarray(k), cupy.asarray(v), cache_seqlens=ends,
                                              cache_batch_idx=rows, cache_leftpad=leftpad, causal=True)
    _assert_matches_reference(o, q, (k_cache, v_cache), k, v, ends, leftpad, rows, dtype, causal=True)
    where = dict(cache_seqlens=ends, cache_batch_idx=rows)
    assert_same_bytes("k_cache", k_big[:, :capacity].get(), reference.kvcache_appended(k_cache, k, **where))


def test_mask_mod_kv_idx_counts_from_the_first_token():
    import cupy

    dtype = ml_dtypes.bfloat16
    q, k_cache, v_cache, k, v, ends, leftpad, rows = _inputs(dtype, seed=3)

    def early_keys(b, h, q_idx, kv_idx):
        return kv_idx < 40

    with poisoned_outputs():
        o = cupyflash.flash_attn_with_kvcache(cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache),
                                              cupy.asarray(k), cupy.asarray(v), cache_seqlens=ends,
                                              cache_batch_idx=rows, cache_leftpad=leftpad, mask_mod=early_keys)
    _assert_matches_reference(o, q, (k_cache, v_cache), k, v, ends, leftpad, rows, dtype, mask_mod=early_keys)


def test_rotary_with_leftpad_turns_at_cache_positions():
    """Rotary and cache_leftpad together, checked and unread: the keys and queries turn at their cache
    positions (cache_seqlens[b] + t), bitwise as the host rotation followed by the plain left-padded
    call."""
    import cupy

    from cupyflash.rotary import Rotary

    dtype = ml_dtypes.bfloat16
    q, k_cache, v_cache, k, v, ends, leftpad, rows = _inputs(dtype, seed=4)
    theta = np.random.default_rng(5).uniform(0, 2 * np.pi, (k_cache.shape[1], 32))
    cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
    rotary = Rotary(cos, sin, False)
    k_ro = rotary.apply(k, rotary.positions(ends.astype(np.int64), k.shape[1], True))
    q_ro = rotary.apply(q, rotary.positions(ends.astype(np.int64), q.shape[1], True))
    results = {}
    for form in ("plain", "checked", "unread"):
        caches = [cupy.asarray(c) for c in (k_cache, v_cache)]
        index = dict(cache_seqlens=ends, cache_batch_idx=rows, cache_leftpad=leftpad)
        turn = {} if form == "plain" else dict(rotary_cos=cupy.asarray(cos), rotary_sin=cupy.asarray(sin),
                                               rotary_interleaved=False)
        new_q, new_k = (q_ro, k_ro) if form == "plain" else (q, k)
        with poisoned_outputs():
            if form == "unread":
                index = {name: cupy.asarray(x) for name, x in index.items()}
                with cupyflash.no_host_sync():
                    o = cupyflash.flash_attn_with_kvcache(cupy.asarray(new_q), *caches, cupy.asarray(new_k),
                                                          cupy.asarray(v), causal=True, num_splits=1, **index, **turn)
            else:
                o = cupyflash.flash_attn_with_kvcache(cupy.asarray(new_q), *caches, cupy.asarray(new_k),
                                                      cupy.asarray(v), causal=True, num_splits=1, **index, **turn)
        results[form] = cupy.asnumpy(o), caches[0].get()
    for form in ("checked", "unread"):
        assert_same_bytes(f"o {form}", results[form][0], results["plain"][0])
        assert_same_bytes(f"k_cache {form}", results[form][1], results["plain"][1])
