"""flash_bwd_wgmma (models/flash_bwd_wgmma.py): its mirrors are the kernel's statements, the
dS^T stores and the dQ staging are conflict-free and complete, every operand is the intended
slice, and one key block emulated product by product gives dK, dV and dQ of plain matmuls."""
from __future__ import annotations

import numpy as np
import pytest
from launch_fakes import FakeArray
from models.blocks import assert_float64_close, bwd_inputs, bwd_reference, seeded_rng
from models.flash_bwd_wgmma import (BWD, BWD_CONFIGS, DQ_STAGE_ROW, WGMMA_BWD, bwd_dkdv_steps, bwd_dq_panel_stage,
                                    bwd_dq_panels, bwd_dq_stage_stores, bwd_dq_steps, bwd_ds_t_stores, bwd_emulated,
                                    bwd_grad_stash, bwd_smem, bwd_st_steps, bwd_tiles)
from models.mirrors import missing_statements, unmirrored_statements
from models.smem import RAW_SMEM, aligned_base, new_smem, store_panels
from models.wgmma import WARP_IN_WG, assert_operand, bank_conflict_free, cp_async_panels


@pytest.mark.parametrize("source", [BWD, WGMMA_BWD])  # WGMMA_BWD: its copies and epilogue, shared with _dsplit
def test_mirrors_match_the_kernel_sources(source):
    """Every C++ statement a mirror names is in the source (whitespace aside), and every layout
    statement of the kernel is mirrored: an edit there fails here until the mirror follows."""
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    unmirrored = unmirrored_statements(source)
    assert not unmirrored, f"layout statements of {source} without a mirror here: {unmirrored}"


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_ds_t_stores_are_bank_conflict_free_and_fill_the_tile(d_tile, block_m, block_n):
    L = bwd_smem(d_tile, block_m, block_n)
    tiles = bwd_tiles(L, 0)
    written = []
    for wg in range(L.NWG):
        for addr, _, _ in bwd_ds_t_stores(L, tiles, wg):
            for warp in range(4):
                assert bank_conflict_free(addr[32 * warp: 32 * warp + 32], 4)
            written.extend(addr.tolist())
    # the warpgroups' stores cover the BLOCK_N x BLOCK_M dS^T tile, each 4-byte word once
    assert sorted(written) == list(range(tiles.dst, tiles.dst + block_n * block_m * 2, 4))


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_fixed_dq_staging_rows_are_the_panel_rows_in_order(d_tile, block_m, block_n):
    """Fixed-point dQ staging: every accumulator element (row, col) of the 64 x 64 panel lands at
    column col of staging row row, so the 512 bytes each bulk reduction reads are one dQ row in
    column order; a row is written only by the warp that issues its reduction (the kernel syncs
    warps with themselves only); the tiles sit inside the layout, past the other tiles, 16-byte
    aligned (the bulk copy's requirement); each quarter-warp's 16-byte stores hit every bank once
    (4 wavefronts per warp store, the minimum for 512 bytes)."""
    from cupyflash.kernels import mma_bwd

    L = bwd_smem(d_tile, block_m, block_n, "fixed")
    assert L.BYTES + 1024 == mma_bwd.wgmma_smem_bytes(d_tile, block_m, block_n, "fixed") <= 227 * 1024
    assert mma_bwd.DQ_STAGE_ROW == DQ_STAGE_ROW
    base = aligned_base(RAW_SMEM)
    for wg in range(L.NWG):
        stores, sources = bwd_dq_stage_stores(L, wg)
        cell, writer = {}, {}
        for at, rows, cols in stores:
            for warp in range(4):
                for phase in range(4):
                    lanes = slice(32 * warp + 8 * phase, 32 * warp + 8 * phase + 8)
                    assert bank_conflict_free(at[lanes], 16)
            for a, r, c, warp in zip(at, rows, cols, WARP_IN_WG):
                cell[int(a)], cell[int(a) + 8] = (int(r), int(c)), (int(r), int(c) + 1)
                writer.setdefault(int(r), set()).add(int(warp))
        assert len(cell) == 64 * 64 and sorted(sources) == list(range(64))
        for r, (warp, src) in sources.items():
            assert writer[r] == {warp}
            assert src % 16 == 0 and base + L.DQ_STAGE <= src and src + 512 <= base + L.BYTES
            assert [cell[int(src) + 8 * c] for c in range(64)] == [(r, c) for c in range(64)]
    assert L.DQ_STAGE >= L.DELTA + 2 * block_m * 4 and L.DQ_STAGE % 16 == 0  # past D; bulk-copy aligned


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_panel_major_dq_staging_is_the_global_panel_byte_for_byte(d_tile, block_m, block_n):
    """fixed_panels: each warp's bulk reduction reads 8 KiB of staging that holds, in order, the
    int64 values of dq_accum's panel-major rows it adds to: staging byte 8 c + 512 r of warp w is
    accumulator element (16 w + r, c) of the panel, and the destination is that element's place in
    a (batch, nheads * d_tile / 64, rows, 64) array (the layout of cupyflash.kernels.dq_fixed.
    accum_panels, whose strides panel_strides and panel_stride turn into BwdParams'); each cell is written once,
    by the issuing warp; quarter-warp stores are conflict-free; the sources are 16-byte aligned and
    inside the layout; in every query block, the last one cut short by seqlen_q included, each row
    below seqlen_q is added by exactly one reduction and every destination lies inside the buffer
    (whole query blocks of rows)."""
    from cupyflash.kernels import dq_fixed, mma_bwd

    L = bwd_smem(d_tile, block_m, block_n, "fixed_panels")
    assert L.BYTES + 1024 == mma_bwd.wgmma_smem_bytes(d_tile, block_m, block_n, "fixed_panels") <= 227 * 1024
    batch, nheads, seqlen_q = 2, 3, 3 * block_m - 5

    rows = -(-seqlen_q // block_m) * block_m
    accum = FakeArray((batch, nheads * (d_tile // 64), rows, 64), np.int64)  # accum_panels' layout
    # BwdParams' dq_accum strides and panel stride, as mma_bwd.backward sets them for accum_panels
    strides = (*(int(x) for x in dq_fixed.panel_strides(accum, nheads)), int(dq_fixed.panel_stride(accum)))
    base = aligned_base(RAW_SMEM)
    b, h = 1, 2
    added = {}  # (panel dp, row) -> number of reductions that add it
    for m0, wg in ((m0, wg) for m0 in range(0, seqlen_q, block_m) for wg in range(L.NWG)):
        panel = wg  # one panel per warpgroup per iteration
        qp, dp = panel // (d_tile // 64), panel % (d_tile // 64)
        stores, bulks = bwd_dq_panel_stage(L, wg, qp, dp, m0, b, h, strides, seqlen_q)
        cell = {}
        for at, rows, cols in stores:
            for warp in range(4):
                for phase in range(4):
                    lanes = slice(32 * warp + 8 * phase, 32 * warp + 8 * phase + 8)
                    assert bank_conflict_free(at[lanes], 16)
            for a, r, c, w in zip(at, rows, cols, WARP_IN_WG):
                for k in (0, 1):
                    assert int(a) + 8 * k not in cell
                    cell[int(a) + 8 * k] = (int(r), int(c) + k, int(w))
        assert len(cell) == 64 * 64
        for w, (src, nbytes, dst) in bulks.items():
            assert src % 16 == 0 and base + L.DQ_STAGE <= src and src + nbytes <= base + L.BYTES
            assert dst + nbytes // 8 <= int(np.prod(accum.shape))  # padding rows, not past the buffer
            for r in range(16):
                key = (dp, m0 + 64 * qp + 16 * w + r)
                added[key] = added.get(key, 0) + 1
            for r in range(16):
                for c in range(64):
                    row, col, writer = cell[src + 512 * r + 8 * c]
                    assert (row, col, writer) == (16 * w + r, c, w)
                    # destination of element (m, 64 dp + c) of head h, batch b, panel-major
                    m = m0 + 64 * qp + row
                    want = np.ravel_multi_index((b, h * (d_tile // 64) + dp, m, c), accum.shape)
                    assert dst + 64 * r + c == want
    for dp in range(d_tile // 64):
        assert all(added.get((dp, m)) == 1 for m in range(seqlen_q))


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_operands_are_the_intended_slices(d_tile, block_m, block_n):
    L = bwd_smem(d_tile, block_m, block_n)
    rng = seeded_rng(4, d_tile)
    smem = new_smem()
    tiles0 = bwd_tiles(L, 0)
    k, v = rng.standard_normal((2, block_n, d_tile))
    cp_async_panels(smem, tiles0.k, block_n, d_tile, L.NTHREADS, k, block_n, d_tile)
    cp_async_panels(smem, tiles0.v, block_n, d_tile, L.NTHREADS, v, block_n, d_tile)
    ds_t = rng.standard_normal((block_n, block_m))  # [key][query]
    store_panels(smem, tiles0.dst, ds_t)
    for stage in (0, 1):
        tiles = bwd_tiles(L, stage)
        q, do = rng.standard_normal((2, block_m, d_tile))
        cp_async_panels(smem, tiles.q, block_m, d_tile, L.NTHREADS, q, block_m, d_tile)
        cp_async_panels(smem, tiles.do, block_m, d_tile, L.NTHREADS, do, block_m, d_tile)
        for wg in range(L.NWG):
            keys = slice(64 * wg, 64 * wg + 64)
            # S^T = K_g Q^T and dP^T = V_g dO^T: A = key rows of the warpgroup, B = the queries
            for key_side, query_side, tk, tq in ((k, q, tiles.k, tiles.q), (v, do, tiles.v, tiles.do)):
                for kk, step in enumerate(bwd_st_steps(L, tk, tq, wg)):
                    cols = slice(16 * kk, 16 * kk + 16)
                    assert_operand(smem, step.a, step.trans_a, 64, key_side[keys, cols])
                    assert_operand(smem, step.b, step.trans_b, block_m, query_side[:, cols])
        # dV += P^T dO and dK += dS^T Q: B[query][d] = dO or Q
        for query_side, tile in ((do, tiles.do), (q, tiles.q)):
            for kk, step in enumerate(bwd_dkdv_steps(L, tile)):
                assert_operand(smem, step.b, step.trans_b, d_tile, query_side[16 * kk: 16 * kk + 16].T)
    # dQ panel (qp, dp) += dS K: A[query][key] = dS = (dS^T)^T, B[key][d] = K, both MN-major
    covered = []
    for wg in range(L.NWG):
        for qp, dp in bwd_dq_panels(L, wg):
            covered.append((qp, dp))
            for kk, step in enumerate(bwd_dq_steps(L, tiles0, qp, dp)):
                assert_operand(smem, step.a, step.trans_a, 64, ds_t[16 * kk: 16 * kk + 16, 64 * qp: 64 * qp + 64].T)
                assert_operand(smem, step.b, step.trans_b, 64, k[16 * kk: 16 * kk + 16, 64 * dp: 64 * dp + 64].T)
    assert sorted(covered) == [(qp, dp) for qp in range(block_m // 64) for dp in range(d_tile // 64)]


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_block_emulation_matches_numpy(d_tile, block_m, block_n):
    """flash_bwd_wgmma, one key block over two query blocks (both stages): S^T, dP^T, P^T, dS^T
    through registers and shared memory, dV, dK, dQ and the epilogue's rows and columns."""
    L = bwd_smem(d_tile, block_m, block_n)
    headdim = d_tile - 8
    q, k, v, do, lse, delta = bwd_inputs(seeded_rng(8, d_tile), 2 * block_m, block_n, headdim)
    scale = headdim ** -0.5
    dk, dv, dq = bwd_emulated(q, k, v, do, lse, delta, L, headdim, scale)
    for got, want in zip((dk, dv, dq), bwd_reference(q, k, v, do, lse, delta, scale)):
        assert_float64_close(got, want)



@pytest.mark.parametrize("d_tile, block_m, block_n", [(64, 128, 128), (64, 64, 128), (128, 64, 128)])
def test_the_softcap_derivative_is_stashed_at_the_threads_own_ds_t_words(d_tile, block_m, block_n):
    """Every thread's stash words are exactly its dS^T words of step 5: no other thread reads or
    writes them before that thread overwrites them with dS^T."""
    L = bwd_smem(d_tile, block_m, block_n)
    tiles = bwd_tiles(L, 0)
    for wg in range(block_n // 64):
        stash = np.stack(bwd_grad_stash(L, tiles, wg), axis=1)  # (threads, words)
        stores = np.stack([addr for addr, _, _ in bwd_ds_t_stores(L, tiles, wg)], axis=1)
        assert (np.sort(stash, axis=1) == np.sort(stores, axis=1)).all()


from hypothesis import given, strategies as st  # noqa: E402

from cupyflash import masks  # noqa: E402
from models.mma_bwd_walks import wgmma_walk  # noqa: E402


@given(st.integers(1, 700), st.integers(1, 700), st.sampled_from([64, 128]), st.sampled_from([64, 128]),
       st.integers(1, 3), st.booleans())
def test_the_ordered_walk_visits_the_ascending_walks_blocks(seqlen_q, seqlen_k, block_m, block_n, group, causal):
    """The ordered dQ adds walk each head's query blocks from the sequence's last one down; with no
    left bound (which those kernels refuse) that is the ascending walk's set of blocks, reversed:
    every key block visits the same (head, query block) pairs either way."""
    mask = masks.Causal() if causal else masks.NoMask()
    for n0 in range(0, seqlen_k, block_n):
        up = wgmma_walk(mask, n0, block_n, block_m, seqlen_q, seqlen_k, group, 1, ordered=False)
        down = wgmma_walk(mask, n0, block_n, block_m, seqlen_q, seqlen_k, group, 1, ordered=True)
        assert sorted(up) == sorted(down)
        for head in range(group, 2 * group):
            blocks = [m for h, m in down if h == head]
            assert blocks == sorted(blocks, reverse=True)
