"""flash_bwd_wgmma_dsplit (models/flash_bwd_wgmma_dsplit.py): its mirrors are the kernel's
statements, the P^T / dS^T pair stores are conflict-free and fill the tile, every operand is the
intended slice, and one key block emulated product by product gives dK, dV and dQ."""
from __future__ import annotations

import pytest
from models.blocks import assert_float64_close, bwd_inputs, bwd_reference, seeded_rng
from models.flash_bwd_wgmma_dsplit import (DSPLIT, DSPLIT_CONFIG, dsplit_dkdv_steps, dsplit_dq_steps,
                                           dsplit_emulated, dsplit_pair_addr, dsplit_smem, dsplit_step1,
                                           dsplit_tiles)
from models.mirrors import missing_statements, unmirrored_statements
from models.smem import new_smem, store_panels
from models.wgmma import assert_operand, bank_conflict_free, cp_async_panels


@pytest.mark.parametrize("source", [DSPLIT])
def test_mirrors_match_the_kernel_sources(source):
    """Every C++ statement a mirror names is in the source (whitespace aside), and every layout
    statement of the kernel is mirrored: an edit there fails here until the mirror follows."""
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    unmirrored = unmirrored_statements(source)
    assert not unmirrored, f"layout statements of {source} without a mirror here: {unmirrored}"


def test_dsplit_pair_stores_are_bank_conflict_free_and_fill_the_tile():
    L = dsplit_smem(*DSPLIT_CONFIG)
    tiles = dsplit_tiles(L, 0)
    for tile in (tiles.pt, tiles.dst):
        written = []
        for j in range(L.BLOCK_M // 8):
            for h in range(2):
                addr = dsplit_pair_addr(L, tile, j, h)
                for warp in range(4):
                    assert bank_conflict_free(addr[32 * warp: 32 * warp + 32], 4)
                written.extend(addr.tolist())
        assert sorted(written) == list(range(tile, tile + L.BLOCK_N * L.BLOCK_M * 2, 4))


def test_dsplit_operands_are_the_intended_slices():
    L = dsplit_smem(*DSPLIT_CONFIG)
    rng = seeded_rng(5)
    smem = new_smem()
    tiles0 = dsplit_tiles(L, 0)
    k, v = rng.standard_normal((2, L.BLOCK_N, L.D_TILE))
    cp_async_panels(smem, tiles0.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, k, L.BLOCK_N, L.D_TILE)
    cp_async_panels(smem, tiles0.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, v, L.BLOCK_N, L.D_TILE)
    p_t, ds_t = rng.standard_normal((2, L.BLOCK_N, L.BLOCK_M))  # [key][query]
    store_panels(smem, tiles0.pt, p_t)
    store_panels(smem, tiles0.dst, ds_t)
    for stage in (0, 1):
        tiles = dsplit_tiles(L, stage)
        q, do = rng.standard_normal((2, L.BLOCK_M, L.D_TILE))
        cp_async_panels(smem, tiles.q, L.BLOCK_M, L.D_TILE, L.NTHREADS, q, L.BLOCK_M, L.D_TILE)
        cp_async_panels(smem, tiles.do, L.BLOCK_M, L.D_TILE, L.NTHREADS, do, L.BLOCK_M, L.D_TILE)
        for wg, (key_side, query_side) in enumerate(((k, q), (v, do))):  # S^T (wg 0), dP^T (wg 1)
            for kk, step in enumerate(dsplit_step1(L, tiles, wg)):
                cols = slice(16 * kk, 16 * kk + 16)
                assert_operand(smem, step.a, step.trans_a, 64, key_side[:, cols])
                assert_operand(smem, step.b, step.trans_b, L.BLOCK_M, query_side[:, cols])
        for wg in range(2):
            half = slice(L.HALF * wg, L.HALF * wg + L.HALF)
            # dV_g += P^T dO_g: A[key][query] = P^T (K-major), B[query][d] = dO half g; dK_g likewise
            for a_side, query_side, a_tile, q_tile in ((p_t, do, tiles.pt, tiles.do), (ds_t, q, tiles.dst, tiles.q)):
                for kk, step in enumerate(dsplit_dkdv_steps(L, a_tile, q_tile, wg)):
                    rows = slice(16 * kk, 16 * kk + 16)
                    assert_operand(smem, step.a, step.trans_a, 64, a_side[:, rows])
                    assert_operand(smem, step.b, step.trans_b, L.HALF, query_side[rows, half].T)
    for wg in range(2):  # dQ_g = dS K_g: A[query][key] = (dS^T)^T, B[key][d] = K half g
        half = slice(L.HALF * wg, L.HALF * wg + L.HALF)
        for kk, step in enumerate(dsplit_dq_steps(L, tiles0, wg)):
            rows = slice(16 * kk, 16 * kk + 16)
            assert_operand(smem, step.a, step.trans_a, 64, ds_t[rows].T)
            assert_operand(smem, step.b, step.trans_b, L.HALF, k[rows, half].T)


def test_dsplit_block_emulation_matches_numpy():
    """flash_bwd_wgmma_dsplit, one key block over two query blocks: P^T and dS^T exchanged through
    shared memory, each warpgroup's head-dim half of dV, dK and dQ."""
    L = dsplit_smem(*DSPLIT_CONFIG)
    headdim = L.D_TILE - 8
    q, k, v, do, lse, delta = bwd_inputs(seeded_rng(9), 2 * L.BLOCK_M, L.BLOCK_N, headdim)
    scale = headdim ** -0.5
    dk, dv, dq = dsplit_emulated(q, k, v, do, lse, delta, L, headdim, scale)
    for got, want in zip((dk, dv, dq), bwd_reference(q, k, v, do, lse, delta, scale)):
        assert_float64_close(got, want)

