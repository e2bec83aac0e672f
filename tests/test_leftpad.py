"""cache_leftpad in flash_attn_with_kvcache (flash-attn's: each sequence's first position in a
contiguous cache) on the NumPy twin, against reference.kvcache_attention(cache_leftpad=...) read
position by position: with and without an append, cache_batch_idx, causal / window / ALiBi, rotary
(positions stay the cache's); the append lands at cache_seqlens and nothing else changes; the
result equals the unpadded call on a cache with each row shifted; the errors. How the kernels reach
a left-padded sequence (a table counting rows, the caches' batch strides replaced by their row
strides) emulated on the CPU: every key's element offset is its cache element; the launch's
struct. GPU: tests/test_leftpad_gpu.py.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given

import cupyflash
from cupyflash import reference
from cupyflash.kvcache import row_page_ratio, row_page_table
from cupyflash.testing import assert_kvcache_close, poisoned_outputs
from cupyflash.testing.strategies import kvcache_problems
from kvcache_checks import assert_same_bytes, expected_caches


def _problem(seed=0, batch=3, capacity=20, new=2, seqlen_q=2, nheads=4, nheads_kv=2, headdim=8, dtype=np.float64):
    rng = np.random.default_rng(seed)
    k_cache = rng.standard_normal((batch + 1, capacity, nheads_kv, headdim)).astype(dtype)
    v_cache = rng.standard_normal((batch + 1, capacity, nheads_kv, headdim)).astype(dtype)
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    k = rng.standard_normal((batch, new, nheads_kv, headdim)).astype(dtype)
    v = rng.standard_normal((batch, new, nheads_kv, headdim)).astype(dtype)
    ends = np.array([7, 12, 3][:batch], np.int32)      # cache_seqlens: where the cached tokens end
    leftpad = np.array([2, 0, 3][:batch], np.int32)    # the last sequence has no cached token
    return q, k_cache, v_cache, k, v, ends, leftpad


@pytest.mark.parametrize("appending", [True, False])
@pytest.mark.parametrize("options", [dict(causal=True), dict(), dict(window_size=(3, 0)),
                                     dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.1, 1.0], np.float32))],
                         ids=["causal", "full", "window", "alibi"])
@pytest.mark.parametrize("rows", [None, np.array([3, 0, 1], np.int32)], ids=["own_rows", "batch_idx"])
def test_matches_the_reference(appending, options, rows):
    q, k_cache, v_cache, k, v, ends, leftpad = _problem(seed=1)
    if not appending:
        k = v = None
    before = k_cache.copy(), v_cache.copy()
    o, lse = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=ends, cache_batch_idx=rows,
                                               cache_leftpad=leftpad, return_lse=True, backend="numpy", **options)
    o_ref, lse_ref = reference.kvcache_attention(q, *before, k, v, cache_seqlens=ends, cache_batch_idx=rows,
                                                 cache_leftpad=leftpad, **options)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    if appending:
        where = dict(cache_seqlens=ends, cache_batch_idx=rows)
        assert_same_bytes("k_cache", k_cache, reference.kvcache_appended(before[0], k, **where))
        assert_same_bytes("v_cache", v_cache, reference.kvcache_appended(before[1], v, **where))
    else:
        assert_same_bytes("k_cache", k_cache, before[0])


@given(kvcache_problems(page_sizes=[None], windows=True, max_cost=2e6, leftpad=True))
def test_property_against_the_reference(problem):
    """Drawn problems, half of them left-padded; the slots before each sequence's first token are
    NaN (KVCacheProblem), so reading one fails."""
    inputs, before = problem.inputs(), problem.inputs()
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_softmax_lse=True, backend="numpy",
                                                   **problem.kwargs)
    assert_kvcache_close(problem, o, lse, inputs=before)
    k_expected, v_expected = expected_caches(before)
    assert_same_bytes("k_cache", inputs["k_cache"], k_expected)
    assert_same_bytes("v_cache", inputs["v_cache"], v_expected)


def test_equals_the_unpadded_call_on_shifted_rows():
    q, k_cache, v_cache, k, v, ends, leftpad = _problem(seed=2)
    shifted = [np.zeros_like(c) for c in (k_cache, v_cache)]
    for b, (start, end) in enumerate(zip(leftpad, ends)):
        for c, s in zip((k_cache, v_cache), shifted):
            s[b, : end - start] = c[b, start:end]
    padded = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=ends, cache_leftpad=leftpad,
                                               causal=True, backend="numpy")
    plain = cupyflash.flash_attn_with_kvcache(q, *shifted, k, v, cache_seqlens=ends - leftpad, causal=True,
                                              backend="numpy")
    np.testing.assert_array_equal(padded, plain)


def test_rotary_positions_are_the_caches():
    """flash-attn turns a left-padded sequence's new key at its cache position cache_seqlens[b] + t."""
    q, k_cache, v_cache, k, v, ends, leftpad = _problem(seed=3)
    theta = np.random.default_rng(4).uniform(0, 2 * np.pi, (20, 4))
    cos, sin = np.cos(theta), np.sin(theta)
    before = k_cache.copy(), v_cache.copy()
    o = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=ends, cache_leftpad=leftpad,
                                          rotary_cos=cos, rotary_sin=sin, causal=True, backend="numpy")
    positions = ends[:, None].astype(np.int64) + np.arange(2)[None, :]
    k_ro = reference.rotary(k, cos, sin, positions, interleaved=True)
    q_ro = reference.rotary(q, cos, sin, positions, interleaved=True)
    o_ref, _ = reference.kvcache_attention(q_ro, *before, k_ro, v, cache_seqlens=ends, cache_leftpad=leftpad,
                                           causal=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("changes, message", [
    (dict(cache_leftpad=np.array([8, 0, 0], np.int32)), r"cache_leftpad\[0\] = 8 must be in 0 .. cache_seqlens\[0\] = 7"),
    (dict(cache_leftpad=np.array([-1, 0, 0], np.int32)), r"cache_leftpad\[0\] = -1"),
    (dict(cache_leftpad=np.array([0, 0], np.int32)), r"cache_leftpad must have shape \(batch,\) = \(3,\)"),
    (dict(block_table=np.zeros((3, 1), np.int32)), "cache_leftpad and block_table cannot be combined"),
])
def test_errors_before_anything_is_written(changes, message):
    q, k_cache, v_cache, k, v, ends, leftpad = _problem(seed=5)
    before = k_cache.copy()
    arguments = dict(dict(cache_seqlens=ends, cache_leftpad=leftpad, backend="numpy"), **changes)
    with pytest.raises(ValueError, match=message):
        cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **arguments)
    assert_same_bytes("k_cache", k_cache, before)


def test_a_float_leftpad_is_refused():
    q, k_cache, v_cache, k, v, ends, _ = _problem(seed=6)
    with pytest.raises(TypeError, match="cache_leftpad"):
        cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=ends,
                                          cache_leftpad=np.zeros(3, np.float32), backend="numpy")


def test_the_append_needs_room_after_the_end():
    q, k_cache, v_cache, k, v, ends, leftpad = _problem(seed=7)
    with pytest.raises(ValueError, match="too small for the append: sequence 0 has 17 cached tokens from position 2"):
        cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([19, 1, 1], np.int32),
                                          cache_leftpad=np.array([2, 0, 0], np.int32), backend="numpy")


# --- how the kernels address a left-padded sequence, emulated ----------------------------------------

@pytest.mark.parametrize("view", ["whole", "row_slice", "head_slice"])
def test_row_pages_address_each_key_of_the_sequence(view):
    """CacheKeys (kernels_cu/cache_rows.cuh) puts key n of a one-page sequence at element offset
    entry * batch_stride + n * row_stride + head * head_stride; with the table of row_page_table and
    the batch stride replaced by the row stride (params.set_cache_rows) that is element (row,
    start + n, head) of the cache, for caches that are views of larger arrays too."""
    base = np.arange(5 * 24 * 3 * 4, dtype=np.float64).reshape(5, 24, 3, 4)
    cache = {"whole": base, "row_slice": base[:, 2:22], "head_slice": base[:, :, 1:]}[view]
    ratio = row_page_ratio(cache, cache)
    assert ratio == base.strides[0] // base.strides[1]
    rows = np.array([[4], [0], [2]])
    starts = np.array([3, 0, 7])
    table = row_page_table(rows, starts, ratio)
    item = cache.itemsize
    row_stride, head_stride = cache.strides[1] // item, cache.strides[2] // item
    flat = np.lib.stride_tricks.as_strided(cache, shape=(base.size,), strides=(item,))  # from cache[0, 0, 0, 0]
    for b in range(3):
        for n in range(cache.shape[1] - starts[b]):
            for head in range(cache.shape[2]):
                offset = int(table[b, 0]) * row_stride + n * row_stride + head * head_stride
                assert flat[offset] == cache[rows[b, 0], starts[b] + n, head, 0]


def test_row_page_ratio_refuses_what_rows_cannot_express():
    cache = np.zeros((3, 10, 2, 8))
    assert row_page_ratio(cache, cache) == 10
    assert row_page_ratio(cache, np.zeros((3, 10, 2, 16))) == 10  # v's head dim of its own
    assert row_page_ratio(cache, np.zeros((3, 12, 2, 8))[:, :10]) is None  # 12 rows apart in v, 10 in k
    # a batch stride that is not a multiple of the row stride (only shapes and strides are read)
    odd = types.SimpleNamespace(shape=(3, 10, 2, 8), strides=(21 * 16 * 8 + 8, 16 * 8, 64, 8))
    assert row_page_ratio(odd, odd) is None


def test_the_launch_carries_row_strides(monkeypatch):
    from cupyflash.kernels import kvcache_mma
    from cupyflash.masks import mask_for
    from launch_fakes import FakeArray, LaunchRecorder

    recorder = LaunchRecorder(monkeypatch, [kvcache_mma])
    q = FakeArray((2, 1, 8, 128), np.float16)
    k_cache, v_cache = FakeArray((4, 64, 2, 128), np.float16), FakeArray((4, 64, 2, 128), np.float16)
    o, lse = FakeArray((2, 1, 8, 128), np.float16), FakeArray((2, 8, 1), np.float32)
    table, lengths = FakeArray((2, 1), np.int32), FakeArray((2,), np.int32)
    for row_pages in (False, True):
        kvcache_mma.forward(q, k_cache, v_cache, o, lse, seqlens_k=lengths, block_table=table, page_size=64,
                            paged=False, max_seqlen_k=64, softmax_scale=0.1, mask=mask_for(True, (-1, -1)),
                            num_splits=1, row_pages=row_pages)
        [launch] = recorder.take()
        for name in ("k", "v"):
            rows = launch.params[name]
            assert rows["row_stride"] == 2 * 128 and rows["head_stride"] == 128
            assert rows["batch_stride"] == (2 * 128 if row_pages else 64 * 2 * 128)


def test_torch_front_end_passes_cache_leftpad_through():
    torch = pytest.importorskip("torch")
    from cupyflash.torch import flash_attn_with_kvcache

    q, k_cache, v_cache, k, v, ends, leftpad = _problem(seed=8)
    want = cupyflash.flash_attn_with_kvcache(q, k_cache.copy(), v_cache.copy(), k, v, cache_seqlens=ends,
                                             cache_leftpad=leftpad, causal=True, backend="numpy")
    caches = torch.from_numpy(k_cache), torch.from_numpy(v_cache)
    got = flash_attn_with_kvcache(torch.from_numpy(q), *caches, torch.from_numpy(k), torch.from_numpy(v),
                                  cache_seqlens=torch.from_numpy(ends), cache_leftpad=torch.from_numpy(leftpad),
                                  causal=True)
    np.testing.assert_array_equal(got.numpy(), want)


def test_appends_into_another_sequences_padding_but_not_its_tokens():
    """Two sequences in one row: the first's append may land in the second's padding (nothing reads
    it), not on its cached tokens."""
    q, k_cache, v_cache, k, v, _, _ = _problem(seed=9, batch=2, new=1, seqlen_q=1)
    rows, leftpad = np.array([0, 0], np.int32), np.array([0, 5], np.int32)
    before = k_cache.copy()
    cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([3, 8], np.int32),
                                      cache_batch_idx=rows, cache_leftpad=leftpad, backend="numpy")
    assert_same_bytes("slot 3", k_cache[0, 3], k[0, 0])
    assert_same_bytes("slot 8", k_cache[0, 8], k[1, 0])
    k_cache[...] = before
    with pytest.raises(ValueError, match="sequence 0 would append over a cached token"):
        cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([5, 8], np.int32),
                                          cache_batch_idx=rows, cache_leftpad=leftpad, backend="numpy")


def test_modifiers_count_kv_idx_from_the_first_token():
    """A mask_mod's kv_idx is the key's index from the sequence's first token (cache_leftpad), as the
    mask's and ALiBi's distances are."""
    q, k_cache, v_cache, k, v, ends, leftpad = _problem(seed=10)

    def first_four(b, h, q_idx, kv_idx):
        return kv_idx < 4

    got = cupyflash.flash_attn_with_kvcache(q, k_cache.copy(), v_cache.copy(), k, v, cache_seqlens=ends,
                                            cache_leftpad=leftpad, mask_mod=first_four, backend="numpy")
    keys = reference.kvcache_sequences(3, k_cache, v_cache, k, v, cache_seqlens=ends, cache_leftpad=leftpad)
    for b, (keys_b, values_b) in enumerate(keys):
        seen = min(4, keys_b.shape[0])
        o_b, _ = reference.attention(q[b:b + 1], keys_b[None, :seen], values_b[None, :seen])
        np.testing.assert_allclose(got[b], o_b[0], rtol=1e-12, atol=1e-12)
