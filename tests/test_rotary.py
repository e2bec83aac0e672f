"""Rotary embeddings in flash_attn_with_kvcache (rotary_cos, rotary_sin, rotary_interleaved;
cupyflash.rotary) on the NumPy twin, against reference.rotary (float64, the rotation as complex
multiplication) composed with reference.kvcache_attention: both pair layouts, causal / windowed
(a position per query) and not (one position per sequence), contiguous and paged caches, GQA,
rotary_dim below headdim, 16-bit rounding; the cache holds the rotated keys and nothing else
changes; the errors. The torch front end on CPU tensors. GPU: tests/test_rotary_gpu.py.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from kvcache_checks import assert_same_bytes


def _angles(rows, half, seed, dtype=np.float64):
    theta = np.random.default_rng(seed).uniform(0, 2 * np.pi, (rows, half))
    return np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)


def _problem(seed=0, dtype=np.float64, batch=3, capacity=24, new=3, seqlen_q=3, nheads=4, nheads_kv=2, headdim=16,
             paged=False):
    rng = np.random.default_rng(seed)
    lengths = np.array([0, 5, capacity - new][:batch], np.int32)
    k_cache = rng.standard_normal((batch, capacity, nheads_kv, headdim)).astype(dtype)
    v_cache = rng.standard_normal((batch, capacity, nheads_kv, headdim)).astype(dtype)
    table = None
    if paged:  # pages of 4 in a scrambled order
        page = 4
        order = rng.permutation(batch * capacity // page)
        table = order.reshape(batch, capacity // page).astype(np.int32)
        k_pages = np.empty((batch * capacity // page, page, nheads_kv, headdim), dtype)
        v_pages = np.empty_like(k_pages)
        for b in range(batch):
            for j in range(capacity // page):
                k_pages[table[b, j]] = k_cache[b, j * page:(j + 1) * page]
                v_pages[table[b, j]] = v_cache[b, j * page:(j + 1) * page]
        k_cache, v_cache = k_pages, v_pages
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    k = rng.standard_normal((batch, new, nheads_kv, headdim)).astype(dtype)
    v = rng.standard_normal((batch, new, nheads_kv, headdim)).astype(dtype)
    return q, k_cache, v_cache, k, v, lengths, table


def _positions(lengths, tokens, per_token):
    return lengths[:, None].astype(np.int64) + (np.arange(tokens)[None, :] if per_token else 0)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal, window_size", [(True, (-1, -1)), (False, (-1, -1)), (False, (4, 1))])
@pytest.mark.parametrize("paged", [False, True])
def test_matches_the_reference_and_the_cache_holds_rotated_keys(interleaved, causal, window_size, paged):
    q, k_cache, v_cache, k, v, lengths, table = _problem(seed=1, paged=paged)
    cos, sin = _angles(24, 6, seed=2)  # rotary_dim 12 < headdim 16
    before = k_cache.copy(), v_cache.copy()
    o, lse = cupyflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, rotary_cos=cos, rotary_sin=sin,
        rotary_interleaved=interleaved, causal=causal, window_size=window_size, return_lse=True, backend="numpy")
    per_token = causal or window_size != (-1, -1)
    k_ro = reference.rotary(k, cos, sin, _positions(lengths, 3, True), interleaved=interleaved)
    q_ro = reference.rotary(q, cos, sin, _positions(lengths, 3, per_token), interleaved=interleaved)
    o_ref, lse_ref = reference.kvcache_attention(q_ro, before[0], before[1], k_ro, v, cache_seqlens=lengths,
                                                 block_table=table, causal=causal, window_size=window_size)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    where = dict(cache_seqlens=lengths, block_table=table)
    np.testing.assert_allclose(k_cache, reference.kvcache_appended(before[0], k_ro, **where), rtol=1e-14, atol=1e-14)
    assert_same_bytes("v_cache", v_cache, reference.kvcache_appended(before[1], v, **where))


def test_rotation_leaves_the_callers_arrays_and_the_unrotated_tail():
    q, k_cache, v_cache, k, v, lengths, _ = _problem(seed=3)
    q0, k0 = q.copy(), k.copy()
    cos, sin = _angles(24, 4, seed=4)
    cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, rotary_cos=cos,
                                      rotary_sin=sin, backend="numpy")
    assert_same_bytes("q", q, q0)
    assert_same_bytes("k", k, k0)
    for b, length in enumerate(lengths):  # entries past rotary_dim (8) are the new keys' own
        assert_same_bytes("tail", k_cache[b, length:length + 3, :, 8:], k0[b, :, :, 8:])


def test_zero_angles_change_nothing():
    q, k_cache, v_cache, k, v, lengths, _ = _problem(seed=5)
    cos, sin = np.ones((24, 8)), np.zeros((24, 8))
    plain = cupyflash.flash_attn_with_kvcache(q, k_cache.copy(), v_cache.copy(), k, v, cache_seqlens=lengths,
                                              causal=True, backend="numpy")
    turned = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                               rotary_cos=cos, rotary_sin=sin, backend="numpy")
    np.testing.assert_array_equal(plain, turned)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_lower_precisions_round_the_rotation_once(dtype):
    q, k_cache, v_cache, k, v, lengths, _ = _problem(seed=6, dtype=dtype, headdim=32)
    cos, sin = _angles(24, 16, seed=7, dtype=dtype)
    before = k_cache.copy()
    cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, rotary_cos=cos,
                                      rotary_sin=sin, rotary_interleaved=False, backend="numpy")
    k_ro = reference.rotary(k, cos, sin, _positions(lengths, 3, True), interleaved=False)
    want = reference.kvcache_appended(before.astype(np.float64), k_ro, cache_seqlens=lengths)
    eps = float(np.finfo(dtype).eps)
    # one rounding of a float32 (float64) result: half an ulp of the dtype, plus float32's error
    np.testing.assert_allclose(k_cache.astype(np.float64), want, rtol=eps, atol=4 * eps * np.abs(k).max())


def test_the_tables_must_cover_the_capacity_and_every_position_turned():
    """seqlen_ro >= the cache's capacity (flash-attn's check); with the lengths on the host, the
    positions the call turns decide beyond that (causal queries past the new keys reach further);
    fewer rows is an error before anything is written."""
    q, k_cache, v_cache, k, v, lengths, _ = _problem(seed=8, seqlen_q=5, new=3)  # lengths 0, 5, 21 of 24
    before = k_cache.copy()
    arguments = dict(cache_seqlens=lengths, causal=True, backend="numpy")
    with pytest.raises(ValueError, match="must cover the cache's capacity, 24 positions"):
        cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=np.ones((23, 4)),
                                          rotary_sin=np.zeros((23, 4)), **arguments)
    with pytest.raises(ValueError, match=r"turns position 25 \(sequence 2: its cached tokens end at 21\), so it "
                                         "needs 26"):
        cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=np.ones((25, 4)),
                                          rotary_sin=np.zeros((25, 4)), **arguments)
    assert_same_bytes("k_cache", k_cache, before)
    # flash-attn's own test shape: as many rows as the capacity, queries past the new keys, room left
    short = np.array([0, 5, 19], np.int32)
    cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=np.ones((24, 4)),
                                      rotary_sin=np.zeros((24, 4)), **dict(arguments, cache_seqlens=short))
    cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=np.ones((24, 4)),
                                      rotary_sin=np.zeros((24, 4)), **dict(arguments, causal=False))


def test_queries_at_a_full_caches_end_need_that_row():
    """No new keys, not causal: every query turns at cache_seqlens[b]; with a full cache that is
    position capacity, one past flash-attn's rule of capacity rows, so the tables must hold it."""
    q, k_cache, v_cache, _, _, _, _ = _problem(seed=16)
    empty = np.zeros((3, 0) + k_cache.shape[2:])
    full = np.array([24, 3, 10], np.int32)
    with pytest.raises(ValueError, match=r"turns position 24 \(sequence 0: its cached tokens end at 24\)"):
        cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, empty, empty, cache_seqlens=full,
                                          rotary_cos=np.ones((24, 4)), rotary_sin=np.zeros((24, 4)), backend="numpy")
    cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, empty, empty, cache_seqlens=full,
                                      rotary_cos=np.ones((25, 4)), rotary_sin=np.zeros((25, 4)), backend="numpy")


@pytest.mark.parametrize("window_size, per_token", [((24, -1), False), ((-1, 30), False), ((23, -1), True),
                                                    ((-1, 0), True)])
def test_a_window_side_past_the_capacity_is_no_window(window_size, per_token):
    """flash-attn sets a window side >= the cache's capacity to -1 before it asks whether the call is
    local: such a call turns all of a sequence's queries at one position."""
    q, k_cache, v_cache, k, v, lengths, _ = _problem(seed=14)
    cos, sin = _angles(24, 8, seed=15)
    before = k_cache.copy(), v_cache.copy()
    o = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, rotary_cos=cos,
                                          rotary_sin=sin, window_size=window_size, backend="numpy")
    k_ro = reference.rotary(k, cos, sin, _positions(lengths, 3, True), interleaved=True)
    q_ro = reference.rotary(q, cos, sin, _positions(lengths, 3, per_token), interleaved=True)
    o_ref, _ = reference.kvcache_attention(q_ro, *before, k_ro, v, cache_seqlens=lengths, window_size=window_size)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)


def _call(**changes):
    q, k_cache, v_cache, k, v, lengths, _ = _problem(seed=10)
    cos, sin = _angles(24, 4, seed=11)
    arguments = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=lengths, rotary_cos=cos,
                     rotary_sin=sin, backend="numpy")
    arguments.update(changes)
    return cupyflash.flash_attn_with_kvcache(**arguments)


@pytest.mark.parametrize("changes, error, message", [
    (dict(rotary_sin=None), ValueError, "must be given together"),
    (dict(k=None, v=None), ValueError, "pass k and v with them"),
    (dict(rotary_cos=np.ones((24, 4), np.float32)), TypeError, "it must be q's"),
    (dict(rotary_cos=np.ones(24), rotary_sin=np.ones(24)), ValueError, "must be 2-d"),
    (dict(rotary_cos=np.ones((24, 3))), ValueError, "must have one shape"),
    (dict(rotary_cos=np.ones((24, 9)), rotary_sin=np.ones((24, 9))), ValueError, r"rotary_dim = 2 \* rotary_cos"),
    (dict(rotary_cos=np.ones((10, 4)), rotary_sin=np.ones((10, 4))), ValueError, "have 10 rows"),
    (dict(rotary_interleaved=1), TypeError, "rotary_interleaved must be a bool"),
])
def test_errors(changes, error, message):
    with pytest.raises(error, match=message):
        _call(**changes)


def test_torch_front_end_passes_rotary_through():
    torch = pytest.importorskip("torch")
    from cupyflash.torch import flash_attn_with_kvcache

    q, k_cache, v_cache, k, v, lengths, _ = _problem(seed=12)
    cos, sin = _angles(24, 8, seed=13)
    want = cupyflash.flash_attn_with_kvcache(q, k_cache.copy(), v_cache.copy(), k, v, cache_seqlens=lengths,
                                             rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, causal=True,
                                             backend="numpy")
    caches = torch.from_numpy(k_cache.copy()), torch.from_numpy(v_cache.copy())
    got = flash_attn_with_kvcache(*(torch.from_numpy(x) for x in (q,)), *caches, torch.from_numpy(k),
                                  torch.from_numpy(v), torch.from_numpy(cos), torch.from_numpy(sin),
                                  cache_seqlens=torch.from_numpy(lengths), causal=True, rotary_interleaved=False)
    np.testing.assert_array_equal(got.numpy(), want)


def test_the_device_path_converts_the_tables_and_starts_once_a_call(monkeypatch):
    """flash_attn_with_kvcache turns k and then q with one Rotary: on the GPU the cos / sin tables and
    the positions' starts go to the device form once, not once a turn (array module and kernel
    stubbed: this checks the conversions, tests/test_rotary_gpu.py the results)."""
    import types

    from cupyflash import _arrays, rotary
    from cupyflash.kernels import rotary as rotary_kernel

    conversions = []
    fake_cupy = types.SimpleNamespace(ascontiguousarray=lambda a, dtype=None: a, asarray=lambda a: a)
    monkeypatch.setattr(_arrays, "_cupy", lambda: fake_cupy)
    monkeypatch.setattr(_arrays, "to_cupy", lambda a, name: conversions.append(name) or a)
    monkeypatch.setattr(_arrays, "last_dim_contiguous", lambda a: a)
    launched = []
    monkeypatch.setattr(rotary_kernel, "rotate", lambda x, cos, sin, starts, **kw: launched.append((cos, sin, starts)))

    class DeviceArray:  # anything that is not a NumPy array takes the device path
        shape = (2, 3, 4, 8)

    cos, sin = _angles(16, 4, seed=0, dtype=np.float32)
    turner = rotary.Rotary(cos, sin, interleaved=False)
    ends = np.array([3, 5], np.int32)
    turner.turn(DeviceArray(), ends, per_token=True)
    turner.turn(DeviceArray(), ends, per_token=False)
    assert sorted(conversions) == ["rotary_cos", "rotary_sin"]
    assert launched[0] == launched[1] and launched[0][0] is cos and launched[0][2] is ends
