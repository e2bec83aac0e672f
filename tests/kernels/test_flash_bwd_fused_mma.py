"""flash_bwd_fused_mma (models/flash_bwd_fused_mma.py): its mask mirrors are the kernel's
statements; the row-group products give the matmuls; every FUSED_CONFIG and FUSED_CANDIDATES
entry satisfies the kernel's static asserts, tiles its blocks once and fits, and each warp geometry
is emulated against the float64 gradients (ordered or not, windows with unordered adds); NaN in a
value row stays out of the queries that do not see it; the ordered dQ protocol is complete and
cannot deadlock."""
from __future__ import annotations

import math

import numpy as np
import pytest
from models import mma
from models.flash_bwd_fused_mma import (FUSED, bwd_fused_layout, bwd_fused_tiles, bwd_fused_warp_origins,
                                        fused_emulated, fused_iterations, simulate_dq_order)
from models.flash_bwd_mma import check_bwd_emulation
from models.mirrors import MIRRORED, missing_statements
from models.mma_bwd import (LDM_CHUNK_X, LDM_CHUNK_Y, LDM_ROW_X, LDM_ROW_Y, c_fragments_as_matrix, mma_AB_groups,
                            mma_AtB_groups, store_swizzled, tile_offset, tile_step)
from models.mma_bwd_walks import assert_walks_skip_blocks

from cupyflash import masks
from cupyflash.bench.tune import load_dev_backward

DEV_BWD = load_dev_backward()  # the backward's versions and candidates: dev/mma_bwd.py


@pytest.mark.parametrize("source", [FUSED])
def test_mirrors_match_the_kernel_sources(source):
    """Every mask statement the models of the fused kernel name is still in its kernel (found by name) or
    header, whitespace aside: an edit of a walk or an element test there fails here until its model
    follows."""
    assert any(m.source == source for m in MIRRORED)
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"



@pytest.fixture
def nan_is_data(monkeypatch):
    """a_matrix and b_matrix take NaN for an unwritten fragment; under this fixture NaN is data."""
    mma.nan_is_data(monkeypatch)

# (dim_a, dim_b, G, N, row origin of A (AB), column origin of A^T (AtB), column origin of B): the
# fused kernel's operand shapes (P^T, dS^T 64 or 128 wide; Q, dO, K 64, 128, 256 wide) and warp
# origins (key_row0, dq_row0: multiples of KN, QM; d_col0, dq_col0: multiples of DW, DQW).
@pytest.mark.parametrize("dim_a, dim_b, groups, n, a_row0, a_col0, b_col0", [
    (64, 64, 2, 32, 32, 32, 32), (64, 128, 2, 64, 96, 0, 64), (128, 64, 2, 16, 64, 96, 48),
    (64, 256, 2, 64, 0, 32, 192), (64, 256, 1, 128, 112, 48, 128), (128, 128, 2, 32, 32, 64, 96)])
def test_bwd_fused_warp_products_match_numpy(dim_a, dim_b, groups, n, a_row0, a_col0, b_col0):
    """mma_AB_groups and mma_AtB_groups against A @ B on random tiles (one warp)."""
    rng = np.random.default_rng(dim_a + dim_b + n)
    rows = 128  # rows of the A tile of mma_AB_groups (key rows); the reduction length K of both
    t, b = rng.standard_normal((rows, dim_a)), rng.standard_normal((rows, dim_b))
    smem = np.full((rows * dim_a + rows * dim_b), np.nan)
    tile_t, tile_b = 0, rows * dim_a * 2
    store_swizzled(smem, tile_t, dim_a, t)
    store_swizzled(smem, tile_b, dim_b, b)

    # mma_AB_groups: rows a_row0 + 16 g of t (K = dim_a columns) times rows 0..dim_a of b
    acc = np.zeros((groups, 32, n // 8, 4))
    mma_AB_groups(acc, smem, n, dim_a, dim_a, dim_b, tile_t, a_row0, tile_b, b_col0)
    for g in range(groups):
        rows_g = slice(a_row0 + 16 * g, a_row0 + 16 * g + 16)
        np.testing.assert_allclose(c_fragments_as_matrix(acc[g]), t[rows_g] @ b[:dim_a, b_col0:b_col0 + n],
                                   atol=1e-12)

    # mma_AtB_groups: columns a_col0 + 16 g of t (transposed) times b, reduced over all rows
    acc = np.zeros((groups, 32, n // 8, 4))
    mma_AtB_groups(acc, smem, n, rows, dim_a, dim_b, tile_t, a_col0, tile_b, b_col0)
    for g in range(groups):
        cols_g = slice(a_col0 + 16 * g, a_col0 + 16 * g + 16)
        np.testing.assert_allclose(c_fragments_as_matrix(acc[g]), t[:, cols_g].T @ b[:, b_col0:b_col0 + n],
                                   atol=1e-12)


def _fused_configs():
    from cupyflash.kernels import mma_bwd

    return [(dt, c) for dt, c in mma_bwd.FUSED_CONFIG.items()] + [
        (dt, c) for dt, configs in DEV_BWD.FUSED_CANDIDATES.items() for c in configs]


# The FUSED_CONFIG entries and some FUSED_CANDIDATES on a few blocks each: uneven lengths, head
# dims below the tile (zero-filled columns), GQA, causal with seqlen_q above and below seqlen_k.
_BWD_FUSED_CASES = [
    # config, ordered, headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal
    ((64, 128, 4, 2, 2, 4), True, 40, 1, 70, 150, 2, 1, False),
    ((64, 128, 4, 2, 2, 4), True, 64, 1, 150, 70, 1, 1, True),  # empty query rows, one key block
    ((64, 128, 4, 2, 2, 4), False, 56, 2, 133, 198, 1, 1, True),  # key 128: first seen by query 63 (block 0)
    ((64, 128, 4, 2, 2, 4), True, 64, 1, 1, 150, 2, 1, True),  # one query: one block, two key blocks
    ((64, 128, 4, 2, 2, 4), True, 64, 1, 200, 200, 1, 1, True),  # the diagonal meets block boundaries
    ((64, 128, 4, 2, 2, 1), True, 24, 1, 100, 257, 3, 1, True),  # three key blocks for the last query block
    ((128, 128, 4, 2, 4, 1), True, 48, 1, 150, 200, 1, 1, True),
    ((64, 128, 4, 2, 2, 1), True, 96, 1, 100, 130, 1, 1, True),
    ((64, 128, 4, 2, 2, 1), False, 128, 1, 90, 90, 2, 2, False),
    ((64, 64, 2, 4, 2, 1), True, 200, 1, 70, 90, 2, 1, True),
    ((64, 64, 2, 4, 2, 1), False, 256, 1, 45, 33, 1, 1, False),
    ((64, 64, 4, 2, 2, 1), True, 136, 1, 100, 40, 1, 1, True),  # query blocks no key block visits
]


def _fused_case_id(c):
    return "bm{}_bn{}_wn{}_wd{}_dqm{}_u{}".format(*c[0]) + ("_ordered" if c[1] else "_unordered") + \
        "_hd{}_b{}_sq{}_sk{}_h{}_{}".format(*c[2:8]) + ("_causal" if c[8] else "")


@pytest.mark.parametrize("case", _BWD_FUSED_CASES, ids=_fused_case_id)
def test_bwd_fused_emulation_matches_reference(case):
    config, ordered, headdim, batch, sq, sk, nheads, nheads_kv, causal = case
    check_bwd_emulation(lambda q, k, v, do, scale: fused_emulated(q, k, v, do, causal, scale, config, ordered),
                        headdim, batch, sq, sk, nheads, nheads_kv, causal)


# The fused kernel with a window: unordered dQ adds only (ordered ones refuse a left bound).
_BWD_FUSED_WINDOW_CASES = [
    # config, ordered, headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal, window_size
    ((64, 128, 4, 2, 2, 4), False, 56, 1, 200, 230, 2, 1, False, (50, 10)),
    ((64, 128, 4, 2, 2, 1), False, 64, 1, 150, 200, 1, 1, True, (30, -1)),
]


@pytest.mark.parametrize("case", _BWD_FUSED_WINDOW_CASES,
                         ids=lambda c: _fused_case_id(c[:9]) + "_window{}_{}".format(*c[9]))
def test_bwd_fused_emulation_with_window_matches_reference(case):
    config, ordered, headdim, batch, sq, sk, nheads, nheads_kv, causal, window = case
    mask = masks.mask_for(causal, window)
    assert mask.HAS_LEFT and not ordered
    assert_walks_skip_blocks(mask, sq, sk, config[0], config[1])
    check_bwd_emulation(lambda q, k, v, do, scale: fused_emulated(q, k, v, do, causal, scale, config, ordered,
                                                                    window_size=window),
                         headdim, batch, sq, sk, nheads, nheads_kv, causal, window_size=window)


def test_bwd_fused_nan_in_a_value_row_stays_out_of_queries_that_do_not_see_it(nan_is_data):
    # dS^T is set to 0 by selection where P^T is 0, so the NaN of dP^T = V dO^T in a hidden key's
    # row cannot reach dQ of the queries that do not see that key.
    from cupyflash.reference import attention_backward


    rng = np.random.default_rng(8)
    q, do = rng.standard_normal((1, 90, 1, 64)), rng.standard_normal((1, 90, 1, 64))
    k, v = rng.standard_normal((1, 90, 1, 64)), rng.standard_normal((1, 90, 1, 64))
    v[0, 40, 0, 3] = np.nan
    with np.errstate(invalid="ignore"):
        dq, dk, dv = fused_emulated(q, k, v, do, True, 0.125, (64, 128, 4, 2, 2, 4))
        dq_ref, dk_ref, dv_ref = attention_backward(do, q, k, v, softmax_scale=0.125, causal=True)
    assert np.isfinite(dq[0, :40]).all() and np.isnan(dq[0, 40:]).all()
    np.testing.assert_allclose(dq, dq_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dk, dk_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dv, dv_ref, rtol=1e-9, atol=1e-9)


def _conforms_to_tile_step(cols, lane_row, lane_chunk, row0, chunk0, steps):
    """Whether tile_step from the lane offset of (row0, chunk0) gives tile_offset of every
    (row0 + rows, chunk0 + chunks) in `steps`, for all lanes."""
    lane_off = tile_offset(cols, row0 + lane_row, chunk0 + lane_chunk)
    return all(np.array_equal(tile_step(cols, lane_off, rows, chunks),
                              tile_offset(cols, row0 + rows + lane_row, chunk0 + chunks + lane_chunk))
               for rows, chunks in steps)


def test_bwd_fused_configs_satisfy_the_kernel_static_asserts_and_fit():
    """Every FUSED_CONFIG and FUSED_CANDIDATES entry: the static_asserts of flash_bwd_fused_mma and
    of the tile copies, warp tiles that cover each block exactly once, fragment addresses that
    tile_step may step (origins and steps as in the kernel), FusedSmem == fused_smem_bytes."""
    from cupyflash.kernels import mma_bwd

    for dt, config in _fused_configs():
        t = bwd_fused_tiles(dt, config)
        bm, bn, nwarps, nthreads = t["BLOCK_M"], t["BLOCK_N"], t["NWARPS"], t["NTHREADS"]
        what = (dt, config)
        # static_asserts of the kernel
        assert all(t[x] % 16 == 0 and t[x] > 0 for x in ("KN", "SQ", "DW", "QM", "DQW")), what
        assert nwarps % t["DQ_WARPS_M"] == 0 and bm % 64 == 0, what
        lay = bwd_fused_layout(dt, bm, bn)
        assert lay["BYTES"] <= 227 * 1024, what
        # cp_async_tile (Q, dO: BLOCK_M rows; K, V: BLOCK_N rows) and store_tile (dK, dV)
        chunks = dt // 8
        assert nthreads % chunks == 0 and bm % (nthreads // chunks) == 0 and bn % (nthreads // chunks) == 0, what
        assert (bn * chunks) % nthreads == 0, what
        assert 1 <= t["S_UNROLL"] <= dt // 16, what
        assert t["DQW"] % t["DQ_PASS"] == 0, what  # the dQ passes end at the warp's last column
        # the warp tiles of S^T / dP^T, dK / dV and dQ partition their blocks
        cover_s, cover_kv, cover_q = np.zeros((bn, bm), int), np.zeros((bn, dt), int), np.zeros((bm, dt), int)
        for w in range(nwarps):
            o = bwd_fused_warp_origins(t, w)
            cover_s[o["key_row0"]: o["key_row0"] + t["KN"], o["q_col0"]: o["q_col0"] + t["SQ"]] += 1
            cover_kv[o["key_row0"]: o["key_row0"] + t["KN"], o["d_col0"]: o["d_col0"] + t["DW"]] += 1
            cover_q[o["dq_row0"]: o["dq_row0"] + t["QM"], o["dq_col0"]: o["dq_col0"] + t["DQW"]] += 1
        assert np.all(cover_s == 1) and np.all(cover_kv == 1) and np.all(cover_q == 1), what
        # fragment addresses: one lane offset per product, then tile_step (XOR + add) per fragment
        for w in range(nwarps):
            o = bwd_fused_warp_origins(t, w)
            assert o["q_col0"] % 8 == 0  # s_q + q_col0 rows keeps the swizzle phase (row % 8)
            s_steps = [(16 * g, 2 * kk) for g in range(t["KG"]) for kk in range(dt // 16)]
            assert _conforms_to_tile_step(dt, LDM_ROW_X, LDM_CHUNK_X, o["key_row0"], 0, s_steps), (what, w, "K, V")
            q_steps = [(16 * nn, 2 * kk) for nn in range(t["SQ"] // 16) for kk in range(dt // 16)]
            assert _conforms_to_tile_step(dt, LDM_ROW_Y, LDM_CHUNK_Y, 0, 0, q_steps), (what, w, "Q, dO")
            pt_steps = [(16 * g, 2 * kk) for g in range(t["KG"]) for kk in range(bm // 16)]
            assert _conforms_to_tile_step(bm, LDM_ROW_X, LDM_CHUNK_X, o["key_row0"], 0, pt_steps), (what, w, "P^T")
            do_steps = [(16 * kk, 2 * nn) for kk in range(bm // 16) for nn in range(t["DW"] // 16)]
            assert _conforms_to_tile_step(dt, LDM_ROW_X, LDM_CHUNK_X, 0, o["d_col0"] // 8, do_steps), (what, w, "dO")
            ds_steps = [(16 * kk, 2 * g) for kk in range(bn // 16) for g in range(t["QG"])]
            assert _conforms_to_tile_step(bm, LDM_ROW_Y, LDM_CHUNK_Y, 0, o["dq_row0"] // 8, ds_steps), (what, w, "dS^T")
            k_steps = [(16 * kk, 2 * nn) for kk in range(bn // 16) for nn in range(t["DQ_PASS"] // 16)]
            for pass_col0 in range(o["dq_col0"], o["dq_col0"] + t["DQW"], t["DQ_PASS"]):
                assert _conforms_to_tile_step(dt, LDM_ROW_X, LDM_CHUNK_X, 0, pass_col0 // 8, k_steps), (what, w, "K")
        # the layout and its Python mirror; regions 128-byte aligned (lse, D read as float2)
        assert lay["BYTES"] == mma_bwd.fused_smem_bytes(dt, bm, bn), what
        assert all(lay[r] % 128 == 0 for r in ("K", "V", "Q", "DO", "PT", "DST", "LSE", "DELTA")), what
        spec = mma_bwd.fused_spec(np.float16, dt, True, "ordered", config)
        assert spec.smem_bytes == lay["BYTES"] and spec.threads == nthreads, what
    # fused_config: the table's entry where it fits the device's shared memory per block
    for dt in mma_bwd.D_TILES:
        config = mma_bwd.FUSED_CONFIG.get(dt)
        assert DEV_BWD.fused_config(dt, 227 * 1024) == DEV_BWD.fused_config(dt, None) == config
        fits_sm80 = config is not None and mma_bwd.fused_smem_bytes(dt, *config[:2]) <= 163 * 1024
        assert DEV_BWD.fused_config(dt, 163 * 1024) == (config if fits_sm80 else None)


def test_bwd_fused_every_table_geometry_is_emulated():
    """Each warp geometry (head-dim tile, BLOCK_M, BLOCK_N, WARPS_N, WARPS_D, DQ_WARPS_M) of
    FUSED_CONFIG and FUSED_CANDIDATES runs in test_bwd_fused_emulation_matches_reference
    (S_UNROLL changes no index)."""
    from cupyflash.kernels.mma_bwd import d_tile

    emulated = {(d_tile(case[2]), case[0][:5]) for case in _BWD_FUSED_CASES}
    for dt, config in _fused_configs():
        assert (dt, config[:5]) in emulated, (dt, config)


def test_bwd_fused_dq_order_is_complete_and_cannot_deadlock():
    """DQ_ORDERED: the key blocks that visit a query block (the kernel's loop bounds) are exactly
    0..last, so waiting for n_block * NWARPS releases waits for all earlier visitors and their turns
    are a permutation of 0..count-1; and the schedule of waits and releases completes with 1 or 3
    resident CTAs, the adds to every query block landing in ascending key-block order. Counter
    check: with the turns descending (key block last first) one resident CTA deadlocks whenever
    two key blocks share a query block."""
    rng = np.random.default_rng(2024)
    cases = [(1, 1, 64, 64, True), (1, 150, 64, 128, True), (150, 1, 64, 128, True), (150, 70, 64, 128, True),
             (70, 150, 64, 128, True), (128, 128, 128, 64, True), (200, 137, 64, 64, False), (1, 300, 128, 64, False),
             # the diagonal on block boundaries (seqlen_k - seqlen_q a multiple of 64)
             (200, 200, 64, 64, True), (300, 300, 128, 64, True), (256, 320, 64, 128, True), (320, 192, 64, 64, True),
             # the last query of a block is the first to see a key block
             (133, 70, 64, 128, True), (133, 198, 64, 128, True), (300, 235, 128, 64, True)]
    for _ in range(150):
        sq, sk = (int(rng.choice([1, rng.integers(2, 64), rng.integers(64, 700)])) for _ in range(2))
        cases.append((sq, sk, int(rng.choice([64, 128])), int(rng.choice([64, 128])), bool(rng.integers(2))))
    for sq, sk, bm, bn, causal in cases:
        what = (sq, sk, bm, bn, causal)
        n_blocks, q_blocks, diag = math.ceil(sk / bn), math.ceil(sq / bm), sk - sq
        visits = [{m for _, m in fused_iterations(sq, sk, bm, bn, causal, j, 0, 1, True)} for j in range(n_blocks)]
        assert visits == [{m for _, m in fused_iterations(sq, sk, bm, bn, causal, j, 0, 1, False)}
                          for j in range(n_blocks)], what  # both walks visit the same blocks
        want = {}
        for m_block in range(q_blocks):
            visitors = [j for j in range(n_blocks) if m_block in visits[j]]
            assert visitors == list(range(len(visitors))), what
            # ... and they are the key blocks that some query of the block (existing or not) sees
            reach = (m_block + 1) * bm + diag if causal else sk  # keys 0..reach-1
            assert len(visitors) == min(n_blocks, max(0, math.ceil(reach / bn))), what
            want.update({(h, m_block): visitors for h in range(4) if visitors})
        for resident in (1, 3):
            order = simulate_dq_order(sq, sk, bm, bn, causal, resident=resident, rng=rng)
            assert order is not None, ("deadlock", what, resident)
            assert order == want, what
        shared = any(len(v) > 1 for v in want.values())
        deadlock = simulate_dq_order(sq, sk, bm, bn, causal, resident=1, rng=rng, descending=True) is None
        assert deadlock == shared, what
