"""The mask policy's Python twin (cupyflash/masks.py, twin of kernels_cu/mask.cuh) against a
brute-force element mask, and the NumPy twin with sliding windows against the float64 reference."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupyflash import masks, numpy_backend, reference
from strategies import attention_case, make_inputs
from tolerance import assert_close, max_abs, output_rounding_allowance, references_and_baselines
from windows import window_size

TILES = (16, 32, 48, 64, 80, 128)


def brute_force(seqlen_q, seqlen_k, causal, window, rows=None):
    """Visibility from the definition: i + sk - sq - left <= j <= i + sk - sq + right, for the
    queries ``rows`` (default: all; rows past seqlen_q follow the same band, as the kernels'
    rows past the end of a last query block do) and every key."""
    left, right = window
    if causal:
        right = 0
    rows = range(seqlen_q) if rows is None else rows
    out = np.zeros((len(rows), seqlen_k), dtype=bool)
    for r, i in enumerate(rows):
        for j in range(seqlen_k):
            diagonal = i + seqlen_k - seqlen_q
            out[r, j] = (left < 0 or j >= diagonal - left) and (right < 0 or j <= diagonal + right)
    return out


@given(st.integers(0, 300), st.integers(0, 300), st.booleans(), window_size(),
       st.sampled_from(TILES), st.sampled_from(TILES))
def test_policy_matches_brute_force(seqlen_q, seqlen_k, causal, window, block_m, block_n):
    mask = masks.mask_for(causal, window)
    truth = brute_force(seqlen_q, seqlen_k, causal, window)
    np.testing.assert_array_equal(mask.visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k), truth)
    q_blocks, k_blocks = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    # The kernels' blocks run past seqlen_q (rows never stored, on the same band) and past
    # seqlen_k (keys always hidden).
    band = np.zeros((q_blocks * block_m, k_blocks * block_n), dtype=bool)
    band[:, :seqlen_k] = brute_force(seqlen_q, seqlen_k, causal, window, rows=range(q_blocks * block_m))
    grid = band.copy()
    grid[seqlen_q:] = False
    for qb in range(q_blocks):
        m0 = qb * block_m
        visited = mask.key_blocks(m0, block_m, block_n, seqlen_q, seqlen_k)
        rows_band = band[m0:m0 + block_m].reshape(block_m, k_blocks, block_n)
        # Exactly the key blocks with a pair of the block's band: every needed block is visited
        # (none skipped by mistake), and no block outside the window is loaded.
        np.testing.assert_array_equal(list(visited), np.flatnonzero(rows_band.any(axis=(0, 2))))
        for nb in visited:
            n0 = nb * block_n
            assert mask.keys_partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k) == (not rows_band[:, nb].all())
            tile = grid[m0:m0 + block_m, n0:n0 + block_n]
            assert mask.partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k) == (not tile.all())
    for kb in range(k_blocks):
        n0 = kb * block_n
        cols = grid[:, n0:n0 + block_n].reshape(q_blocks, block_m, block_n)
        visited = mask.query_blocks(n0, block_n, block_m, seqlen_q, seqlen_k)
        np.testing.assert_array_equal(list(visited), np.flatnonzero(cols.any(axis=(1, 2))))
        # The query range itself is tight: its first and last queries see a key of the block.
        begin, end = mask.query_begin(n0, seqlen_q, seqlen_k), mask.query_end(n0, block_n, seqlen_q, seqlen_k)
        if begin < end:
            assert grid[begin, n0:n0 + block_n].any() and grid[end - 1, n0:n0 + block_n].any()
    # The key range of one row is its visible keys, first to last.
    for i in range(seqlen_q):
        begin, end = mask.key_begin(i, seqlen_q, seqlen_k), mask.key_end(i, 1, seqlen_q, seqlen_k)
        visible_keys = np.flatnonzero(truth[i])
        if visible_keys.size:
            assert (begin, end) == (visible_keys[0], visible_keys[-1] + 1)
        else:
            assert begin >= end
    # Heaviest query blocks first where a right bound makes later blocks see more keys.
    order = [mask.query_block(b, q_blocks) for b in range(q_blocks)]
    assert sorted(order) == list(range(q_blocks))
    if mask.HAS_RIGHT and q_blocks:
        assert order[0] == q_blocks - 1


@given(st.integers(0, 200), st.integers(0, 200), st.booleans(), window_size())
def test_per_row_bounds_and_hidden_left_give_the_element_mask(seqlen_q, seqlen_k, causal, window):
    """The form the mma.sync backward kernels test elements in: a per-row bound for the right side
    (row_key_end per query row of S, row_query_begin per key row of S^T) and the left bound alone
    (hidden_left) give the brute-force mask, also on the band's rows past seqlen_q and on keys
    past seqlen_k; row_key_begin is the left bound as a per-row range."""
    mask = masks.mask_for(causal, window)
    rows, cols = np.arange(seqlen_q + 20), np.arange(seqlen_k + 20)
    truth = np.zeros((rows.size, cols.size), dtype=bool)
    truth[:, :seqlen_k] = brute_force(seqlen_q, seqlen_k, causal, window, rows=rows)
    i, j = rows[:, None], cols[None, :]
    left_ok = ~mask.hidden_left(i, j, seqlen_q, seqlen_k)
    np.testing.assert_array_equal(left_ok, j >= mask.row_key_begin(rows, seqlen_q, seqlen_k)[:, None])
    by_query_rows = (j < mask.row_key_end(rows, seqlen_q, seqlen_k)[:, None]) & left_ok
    np.testing.assert_array_equal(by_query_rows, truth)
    by_key_rows = (j < seqlen_k) & (i >= mask.row_query_begin(cols, seqlen_q, seqlen_k)[None, :]) & left_ok
    np.testing.assert_array_equal(by_key_rows, truth)
    in_range = (i < seqlen_q) & truth
    np.testing.assert_array_equal(mask.visible(rows, cols, seqlen_q, seqlen_k), in_range)


@given(st.integers(1, 300), st.integers(1, 300), window_size())
def test_causal_is_the_window_left_unbounded_right_zero(seqlen_q, seqlen_k, window):
    left = window[0]
    a = masks.mask_for(True, (left, -1)).visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k)
    b = masks.mask_for(False, (left, 0)).visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k)
    np.testing.assert_array_equal(a, b)
    assert masks.mask_for(True, (-1, -1)) == masks.mask_for(False, (-1, 0)) == masks.Causal()
    assert masks.mask_for(False, (-1, -1)) == masks.NoMask()


@pytest.mark.parametrize("bad", [(1,), (1, 2, 3), (-2, 0), (0, -5), (1.0, 2), (True, 0), "ab", None, 3])
def test_window_validation_names_the_argument(bad):
    with pytest.raises(ValueError, match="window_size"):
        masks.check_window(bad)


def test_reference_window_matches_definition():
    # A small case worked by hand: sq = 3, sk = 5 (diag 2), window (1, 1).
    expected = np.array([[0, 1, 1, 1, 0],
                         [0, 0, 1, 1, 1],
                         [0, 0, 0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(reference.visible_keys(3, 5, False, (1, 1)), expected)
    np.testing.assert_array_equal(reference.visible_keys(3, 5, True, (1, 1)), expected & np.tri(3, 5, 2, dtype=bool))


def check_twin_against_reference(case, window, q, k, v, do, **blocks):
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=window)
    o, lse = numpy_backend.forward(q, k, v, softmax_scale=case.scale, causal=case.causal, window_size=window,
                                   **blocks)
    grads = numpy_backend.backward(do, q, k, v, o, lse, softmax_scale=case.scale, causal=case.causal,
                                   window_size=window, **blocks)
    (o_ref, lse_ref, grads_ref), (o_std, lse_std, grads_std) = references_and_baselines(
        do, q, k, v, dtype=case.dtype, **kwargs)
    assert all(np.isfinite(x.astype(np.float64)).all() for x in (o, *grads))
    # Rows that see no key: o = 0, lse = -inf, dq = 0 (lse_ref is -inf exactly there).
    hidden_rows = np.isneginf(lse_ref)
    assert (np.isneginf(lse) == hidden_rows).all()
    assert (np.moveaxis(o, 2, 1)[hidden_rows] == 0).all() and (np.moveaxis(grads[0], 2, 1)[hidden_rows] == 0).all()
    assert_close("o", o, o_ref, o_std, dtype=case.dtype)
    assert_close("lse", lse, lse_ref, lse_std, dtype=case.dtype)
    grad_scale = max(max_abs(g) for g in grads_ref)
    for name, grad, ref, std, atol in zip(("dq", "dk", "dv"), grads, grads_ref, grads_std,
                                          output_rounding_allowance(do, q, k, v, o, o_ref, **kwargs)):
        assert_close(name, grad, ref, std, dtype=case.dtype, factor=3.0, scale=grad_scale, atol=atol)


@given(attention_case(max_cost=6e6), window_size(), st.sampled_from(TILES), st.sampled_from(TILES))
def test_numpy_twin_with_window_matches_reference(case, window, block_m, block_n):
    check_twin_against_reference(case, window, *make_inputs(case), block_m=block_m, block_n=block_n)


@given(attention_case(max_cost=6e6), st.integers(0, 3))
def test_numpy_twin_window_smaller_than_a_tile(case, left):
    # Narrow windows leave most keys of a visited block hidden, and many rows of the block seeing
    # none of its keys (the -inf - -inf case of the online softmax).
    case = replace(case, seqlen_q=max(case.seqlen_q, 70), seqlen_k=max(case.seqlen_k, 70))
    check_twin_against_reference(case, (left, 0), *make_inputs(case), block_m=64, block_n=64)


@pytest.mark.parametrize("causal, window", [(False, (3, 2)), (True, (5, -1)), (False, (0, 0)), (False, (-1, 1))])
def test_public_api_takes_window_size(causal, window, monkeypatch):
    """flash_attn_func, flash_attn_backward and flash_attn_vjp pass the window to the backend, and
    through the chunked path (batch and heads split above api.MAX_GRID_YZ) unchanged."""
    import cupyflash
    from cupyflash import api

    rng = np.random.default_rng(5)
    q, do = rng.standard_normal((2, 9, 4, 8)), rng.standard_normal((2, 9, 4, 8))
    k, v = rng.standard_normal((2, 12, 2, 8)), rng.standard_normal((2, 12, 2, 8))
    kwargs = dict(causal=causal, window_size=window)
    o_ref, lse_ref = reference.attention(q, k, v, **kwargs)
    grads_ref = reference.attention_backward(do, q, k, v, **kwargs)
    for limit in (api.MAX_GRID_YZ, 2):  # one launch; chunks of 2 heads and 1 batch entry
        monkeypatch.setattr(api, "MAX_GRID_YZ", limit)
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy", **kwargs)
        np.testing.assert_allclose(o, o_ref, atol=1e-12)
        np.testing.assert_allclose(lse, lse_ref, atol=1e-12)
        # the vjp's statistics (recomputed for float64: its o and lse are its own)
        grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend="numpy", statistics="recomputed", **kwargs)
        o_vjp, vjp = cupyflash.flash_attn_vjp(q, k, v, backend="numpy", **kwargs)
        np.testing.assert_array_equal(o_vjp, o)
        for g, g_vjp, ref in zip(grads, vjp(do), grads_ref):
            np.testing.assert_allclose(g, ref, atol=1e-12)
            np.testing.assert_array_equal(g_vjp, g)


@pytest.mark.parametrize("bad", [(4,), (-2, 0), (1.5, 2), (True, 0), "ab", None])
def test_window_size_errors_name_the_argument(bad):
    import cupyflash

    q = np.zeros((1, 4, 1, 8))
    with pytest.raises(ValueError, match="window_size"):
        cupyflash.flash_attn_func(q, q, q, window_size=bad, backend="numpy")
    with pytest.raises(ValueError, match="window_size"):
        cupyflash.flash_attn_backward(q, q, q, q, q, np.zeros((1, 1, 4)), window_size=bad, backend="numpy")


@given(st.integers(1, 300), st.integers(1, 300), window_size(), st.booleans(),
       st.sampled_from([(64, 64), (128, 32), (32, 128)]))
def test_io_model_counts_the_blocks_that_hold_visible_pairs(seqlen_q, seqlen_k, window, causal, tiles):
    """bench.io_complexity's rows per block (from the policy) against blocks that hold a visible
    pair of reference.visible_keys: a block is loaded iff some pair in it is visible."""
    from cupyflash.bench import io_complexity as io

    block_m, block_n = tiles
    mask = masks.mask_for(causal, window)
    visible = reference.visible_keys(seqlen_q, seqlen_k, causal, window)
    for m0 in range(0, seqlen_q, block_m):
        cols = visible[m0:m0 + block_m].any(axis=0)
        blocks = [j for j in range(0, seqlen_k, block_n) if cols[j:j + block_n].any()]
        expected = (min(seqlen_k, blocks[-1] + block_n) - blocks[0]) if blocks else 0
        assert io._key_rows_fwd(seqlen_q, seqlen_k, m0, block_m, block_n, mask) == expected
        assert io._key_rows_dq("mma", seqlen_q, seqlen_k, m0, block_m, block_n, mask) == expected
    for n0 in range(0, seqlen_k, block_n):
        rows = visible[:, n0:n0 + block_n].any(axis=1)
        blocks = [i for i in range(0, seqlen_q, block_m) if rows[i:i + block_m].any()]
        expected = (min(seqlen_q, blocks[-1] + block_m) - blocks[0]) if blocks else 0
        assert io._query_rows_dkdv(seqlen_q, seqlen_k, n0, block_m, mask, block_n) == expected
