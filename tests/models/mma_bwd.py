"""The helpers of kernels_cu/mma_bwd.cuh that the mma.sync backward kernels build on: the tile
swizzle of any row width (tile_offset, tile_step), the ldmatrix lane patterns X and Y, the warp
products (mma_ABt, mma_AB_regs, mma_AtB and their row-group forms), the fragment stores, the
accumulator staging and the tile store of the epilogue. pack_a_frags is fragments.py's."""
from __future__ import annotations

import numpy as np

from .fragments import pack_a_frags  # noqa: F401  (mma_bwd.cuh's pack_a_frags, re-exported)
from .mma import GROUP, LANES, THREAD_IN_GROUP, ldmatrix_x4, mma_16816, swizzled_offset

LDM_ROW_X, LDM_CHUNK_X = LANES & 15, LANES >> 4
LDM_ROW_Y, LDM_CHUNK_Y = (LANES & 7) + ((LANES >> 4) << 3), (LANES >> 3) & 1


def tile_offset(cols: int, row, chunk):
    """tile_offset<COLS>: mma.cuh's swizzle for rows >= 128 bytes, (row / 2) % 4 for 64-byte rows."""
    if cols >= 64:
        return swizzled_offset(cols, row, chunk)
    assert cols == 32
    return (row * 4 + (chunk ^ ((row >> 1) & 3))) * 16


def tile_step(cols: int, lane_off, rows: int, chunks: int):
    if cols >= 64:
        return (lane_off ^ ((chunks & 7) * 16)) + rows * cols * 2 + (chunks >> 3) * 128
    assert chunks == 0
    return lane_off + rows * cols * 2


def mma_ABt(acc, smem, n, k, dim_a, dim_b, tile_a, a_row0, tile_b, k0):
    a_lane = tile_offset(dim_a, a_row0 + LDM_ROW_X, k0 // 8 + LDM_CHUNK_X)
    b_lane = tile_offset(dim_b, LDM_ROW_Y, k0 // 8 + LDM_CHUNK_Y)
    for kk in range(k // 16):
        a = ldmatrix_x4(smem, tile_a + tile_step(dim_a, a_lane, 0, 2 * kk))
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + tile_step(dim_b, b_lane, 16 * nn, 2 * kk))
            mma_16816(acc[:, 2 * nn], a, b[:, 0], b[:, 1])
            mma_16816(acc[:, 2 * nn + 1], a, b[:, 2], b[:, 3])


def mma_AB_regs(acc, a, smem, n, k, dim_b, tile_b, b_col0):
    b_lane = tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            mma_16816(acc[:, 2 * nn], a[:, kk], b[:, 0], b[:, 1])
            mma_16816(acc[:, 2 * nn + 1], a[:, kk], b[:, 2], b[:, 3])


def mma_AtB(acc, smem, n, k, dim_a, dim_b, tile_a, a_col0, tile_b, b_col0):
    a_lane = tile_offset(dim_a, LDM_ROW_Y, a_col0 // 8 + LDM_CHUNK_Y)
    b_lane = tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        a = ldmatrix_x4(smem, tile_a + tile_step(dim_a, a_lane, 16 * kk, 0), trans=True)
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            mma_16816(acc[:, 2 * nn], a, b[:, 0], b[:, 1])
            mma_16816(acc[:, 2 * nn + 1], a, b[:, 2], b[:, 3])


def store_fragment_pairs(smem, tile, cols, row0, col0, pairs):
    """st_shared_b32 of {lo, hi} at (row0 + lane/4, col0 + 2 (lane%4)); pairs[lane, 2]."""
    addr = tile + tile_offset(cols, row0 + GROUP, col0 // 8) + 2 * (2 * THREAD_IN_GROUP)
    assert np.all(addr % 4 == 0)
    smem[addr // 2], smem[addr // 2 + 1] = pairs[:, 0], pairs[:, 1]


def stage_acc(smem, tile, dim, row0, col0, acc, mult):
    for j in range(acc.shape[1]):
        store_fragment_pairs(smem, tile, dim, row0, col0 + 8 * j, acc[:, j, 0:2] * mult)
        store_fragment_pairs(smem, tile, dim, row0 + 8, col0 + 8 * j, acc[:, j, 2:4] * mult)


def store_tile(out_rows, smem, tile, rows, dim, nthreads, rows_valid, headdim):
    """store_tile: out_rows[r] (a (rows_valid, headdim) view) from the swizzled tile."""
    chunks = dim // 8
    assert (rows * chunks) % nthreads == 0
    for i in range(rows * chunks // nthreads):
        for thread in range(nthreads):
            idx = thread + i * nthreads
            row, chunk = idx // chunks, idx % chunks
            if row < rows_valid and chunk * 8 < headdim:
                src = (tile + tile_offset(dim, row, chunk)) // 2
                out_rows[row, chunk * 8: chunk * 8 + 8] = smem[src: src + 8]


def mma_ABt_groups(acc, smem, n, k, dim_a, dim_b, tile_a, a_row0, tile_b, k0):
    """mma_ABt_groups: acc[g] += A_g B^T, A_g = rows a_row0 + 16 g; one B fragment for all groups."""
    groups = acc.shape[0]
    a_lane = tile_offset(dim_a, a_row0 + LDM_ROW_X, k0 // 8 + LDM_CHUNK_X)
    b_lane = tile_offset(dim_b, LDM_ROW_Y, k0 // 8 + LDM_CHUNK_Y)
    for kk in range(k // 16):
        a = [ldmatrix_x4(smem, tile_a + tile_step(dim_a, a_lane, 16 * g, 2 * kk)) for g in range(groups)]
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + tile_step(dim_b, b_lane, 16 * nn, 2 * kk))
            for g in range(groups):
                mma_16816(acc[g, :, 2 * nn], a[g], b[:, 0], b[:, 1])
                mma_16816(acc[g, :, 2 * nn + 1], a[g], b[:, 2], b[:, 3])


def mma_AB_regs_groups(acc, a, smem, n, k, dim_b, tile_b, b_col0):
    """mma_AB_regs_groups: acc[g] += A_g B, a[g] = A_g's fragments [lane, K/16, reg, half]."""
    b_lane = tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            for g in range(acc.shape[0]):
                mma_16816(acc[g, :, 2 * nn], a[g][:, kk], b[:, 0], b[:, 1])
                mma_16816(acc[g, :, 2 * nn + 1], a[g][:, kk], b[:, 2], b[:, 3])


def mma_AB_groups(acc, smem, n, k, dim_a, dim_b, tile_a, a_row0, tile_b, b_col0):
    """mma_AB_groups: acc[g] += A_g B, A_g = rows a_row0 + 16 g, columns 0..k of a [.][dim_a] tile
    (pattern X, non-transposed), B = rows 0..k, columns b_col0..+n of a [k][dim_b] tile (pattern X,
    .trans)."""
    groups = acc.shape[0]
    a_lane = tile_offset(dim_a, a_row0 + LDM_ROW_X, LDM_CHUNK_X)
    b_lane = tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        a = [ldmatrix_x4(smem, tile_a + tile_step(dim_a, a_lane, 16 * g, 2 * kk)) for g in range(groups)]
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            for g in range(groups):
                mma_16816(acc[g, :, 2 * nn], a[g], b[:, 0], b[:, 1])
                mma_16816(acc[g, :, 2 * nn + 1], a[g], b[:, 2], b[:, 3])


def mma_AtB_groups(acc, smem, n, k, dim_a, dim_b, tile_a, a_col0, tile_b, b_col0):
    """mma_AtB_groups: acc[g] += A_g^T B, A_g^T = columns a_col0 + 16 g of a [k][dim_a] tile
    (pattern Y, .trans), B = rows 0..k, columns b_col0..+n of a [k][dim_b] tile (pattern X, .trans)."""
    groups = acc.shape[0]
    a_lane = tile_offset(dim_a, LDM_ROW_Y, a_col0 // 8 + LDM_CHUNK_Y)
    b_lane = tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        a = [ldmatrix_x4(smem, tile_a + tile_step(dim_a, a_lane, 16 * kk, 2 * g), trans=True)
             for g in range(groups)]
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            for g in range(groups):
                mma_16816(acc[g, :, 2 * nn], a[g], b[:, 0], b[:, 1])
                mma_16816(acc[g, :, 2 * nn + 1], a[g], b[:, 2], b[:, 3])


# Test helpers: a tile as the kernels store it, and C fragments back to their matrix.

def store_swizzled(smem, tile, cols, values):
    """values (rows x cols) into a swizzled [rows][cols] tile at byte address `tile`."""
    for r in range(values.shape[0]):
        for c in range(cols // 8):
            o = (tile + tile_offset(cols, r, c)) // 2
            smem[o: o + 8] = values[r, 8 * c: 8 * c + 8]


def c_fragments_as_matrix(acc):
    """acc[lane, N/8, 4] (16-row C fragments) -> the 16 x N block."""
    out = np.full((16, 8 * acc.shape[1]), np.nan)
    for j in range(acc.shape[1]):
        cols = 8 * j + 2 * THREAD_IN_GROUP
        out[GROUP, cols], out[GROUP, cols + 1] = acc[:, j, 0], acc[:, j, 1]
        out[GROUP + 8, cols], out[GROUP + 8, cols + 1] = acc[:, j, 2], acc[:, j, 3]
    return out
