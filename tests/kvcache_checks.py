"""Checks of a KV cache after flash_attn_with_kvcache, shared by tests/test_kvcache.py (CPU) and
tests/test_kvcache_gpu.py."""
from __future__ import annotations

import numpy as np

from cupyflash import reference


def expected_caches(before):
    """The caches after the call: copies of ``before`` (a problem's inputs()) with the appended
    slots written."""
    if before["k"] is None:
        return before["k_cache"], before["v_cache"]
    where = dict(cache_seqlens=before["cache_seqlens"], cache_batch_idx=before["cache_batch_idx"],
                 block_table=before["block_table"])
    return (reference.kvcache_appended(before["k_cache"], before["k"], **where),
            reference.kvcache_appended(before["v_cache"], before["v"], **where))


def assert_same_bytes(name, actual, expected):
    """Byte for byte: NaN payloads and signed zeros included, every slot of the cache."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name

    def as_bytes(x):
        return np.ascontiguousarray(x).view(np.uint8).reshape(x.shape + (x.itemsize,))

    same = (as_bytes(actual) == as_bytes(expected)).all(axis=-1)
    if not same.all():
        where = [int(i) for i in np.argwhere(~same)[0]]
        raise AssertionError(f"{name}: {int((~same).sum())} entries differ, first at {where}")


def assert_call_result(problem, before, after, o, lse):
    """A device flash_attn_with_kvcache call on a problem: (o, lse) CuPy arrays within the tolerance
    of the reference on the inputs ``before`` it, and the caches of its inputs ``after`` it byte for
    byte where the reference appends."""
    import cupy

    from cupyflash.testing import assert_kvcache_close

    assert isinstance(o, cupy.ndarray)
    assert_kvcache_close(problem, o, lse, inputs=before)
    k_expected, v_expected = expected_caches(before)
    assert_same_bytes("k_cache", after["k_cache"].get(), k_expected)
    assert_same_bytes("v_cache", after["v_cache"].get(), v_expected)

