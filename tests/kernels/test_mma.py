"""The mma.sync kernels' shared helpers against the PTX semantics (models/mma.py, models/mma_bwd.py):
mma.cuh's swizzle is a bijection within rows and its ldmatrix phases are conflict-free, the
fragment addresses are the swizzle's, cp_async_tile fills each slot once; mma_bwd.cuh's tile
offsets for every row width, their steps, the conflict-free fragment stores, and the warp
products against NumPy matmuls."""
from __future__ import annotations

import numpy as np
import pytest
from models.mma import (GROUP, LANES, THREAD_IN_GROUP, FragmentAddress, a_operand_address, c_from_matrix,
                        cp_async_tile, k_operand_address, swizzled_offset)
from models.mma_bwd import (LDM_CHUNK_X, LDM_CHUNK_Y, LDM_ROW_X, LDM_ROW_Y, mma_AB_regs, mma_ABt, mma_AtB,
                            pack_a_frags, tile_offset, tile_step)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_fwd_swizzle_is_a_bijection_within_rows(dim):
    rows = np.arange(64)[:, None]
    chunks = np.arange(dim // 8)[None, :]
    off = swizzled_offset(dim, rows, chunks)
    assert sorted(off.ravel().tolist()) == list(range(0, 64 * dim * 2, 16))
    assert np.all(off // (2 * dim) == rows)  # a chunk never leaves its row


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_fwd_ldmatrix_phases_are_bank_conflict_free(dim):
    # ldmatrix serves 8 lanes' 16-byte rows per phase: their 8 chunks must cover all 32 banks.
    for fa in (a_operand_address(dim), k_operand_address(dim)):
        for r in range(2):
            for c in range(dim // 16):
                addr = fa(0, r, c)
                for phase in range(4):
                    banks = {(a // 4 + w) % 32 for a in addr[8 * phase: 8 * phase + 8] for w in range(4)}
                    assert len(banks) == 32


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_fwd_fragment_address_matches_swizzle(dim):
    for lane_row, lane_chunk in ((LANES & 15, LANES >> 4), (((LANES >> 4) << 3) + (LANES & 7), (LANES >> 3) & 1)):
        for strip in (0, 16, 48):
            fa = FragmentAddress(dim, strip + lane_row, lane_chunk)
            for r in range(4):
                for c in range(dim // 16):
                    want = swizzled_offset(dim, strip + 16 * r + lane_row, 2 * c + lane_chunk)
                    assert np.array_equal(fa(1024, r, c), 1024 + want)


@pytest.mark.parametrize("rows, dim, nthreads", [(64, 64, 128), (32, 128, 128), (128, 128, 128),
                                                 (32, 256, 256), (128, 256, 256), (64, 256, 128)])
def test_fwd_cp_async_tile_writes_each_slot_once(rows, dim, nthreads):
    rng = np.random.default_rng(0)
    for rows_valid, headdim in ((rows, dim), (rows - 5, dim - 8), (3, 8)):
        g = rng.standard_normal((rows, dim))
        smem = np.full(rows * dim, np.nan)
        written = np.zeros(rows * dim // 8, dtype=int)
        cp_async_tile(smem, 0, rows, dim, nthreads, g, 0, rows_valid, headdim, written)
        assert np.all(written == 1)
        want = np.where((np.arange(rows)[:, None] < rows_valid) & (np.arange(dim)[None, :] < headdim), g, 0)
        got = np.empty((rows, dim))
        for r in range(rows):
            for c in range(dim // 8):
                o = swizzled_offset(dim, r, c) // 2
                got[r, 8 * c: 8 * c + 8] = smem[o: o + 8]
        assert np.array_equal(got, want)


@pytest.mark.parametrize("cols", [32, 64, 128, 256])
def test_bwd_tile_offset_is_a_bijection_within_rows(cols):
    rows = np.arange(64)[:, None]
    chunks = np.arange(cols // 8)[None, :]
    off = tile_offset(cols, rows, chunks)
    assert sorted(off.ravel().tolist()) == list(range(0, 64 * cols * 2, 16))
    assert np.all(off // (2 * cols) == rows)


def _conflict_free(byte_addrs, width):
    """Whether accesses of `width` bytes per lane hit each 4-byte bank at most once per wavefront
    (one wavefront = 128 bytes: 8 lanes of ldmatrix rows or 32 lanes of b32 stores)."""
    banks = [(a // 4 + w) % 32 for a in byte_addrs for w in range(width // 4)]
    return len(set(banks)) == len(banks)


@pytest.mark.parametrize("cols", [32, 64, 128, 256])
def test_bwd_ldmatrix_and_fragment_stores_are_bank_conflict_free(cols):
    for row0 in (0, 16, 48):
        for chunk0 in range(0, cols // 8, 2):
            for lane_row, lane_chunk in ((LDM_ROW_X, LDM_CHUNK_X), (LDM_ROW_Y, LDM_CHUNK_Y)):
                addr = tile_offset(cols, row0 + lane_row, chunk0 + lane_chunk)
                for phase in range(4):
                    assert _conflict_free(addr[8 * phase: 8 * phase + 8], 16)
            for r in (row0, row0 + 8):  # st.shared.b32 of a C fragment pair (dS^T, epilogue)
                assert _conflict_free(tile_offset(cols, r + GROUP, chunk0) + 4 * THREAD_IN_GROUP, 4)


def test_bwd_tile_step_matches_tile_offset():
    # Every (origin, step) combination the kernels use: origins are multiples of 16 rows and of
    # 64 columns (k0) or of the product width N (column origins of B operands).
    for cols in (32, 64, 128, 256):
        for lane_row, lane_chunk in ((LDM_ROW_X, LDM_CHUNK_X), (LDM_ROW_Y, LDM_CHUNK_Y)):
            for row0 in (0, 16, 32, 112):
                col_origins = [0] if cols == 32 else sorted({0, 32, 64, cols // 2} - {cols})
                for col0 in col_origins:
                    n = min(col0 & -col0 if col0 else cols, cols - col0)  # widest N with col0 % N == 0
                    lane_off = tile_offset(cols, row0 + lane_row, col0 // 8 + lane_chunk)
                    for rows in (0, 16, 48):
                        for chunks in (range(0, n // 8, 2) if cols >= 64 else [0]):
                            want = tile_offset(cols, row0 + rows + lane_row, col0 // 8 + chunks + lane_chunk)
                            assert np.array_equal(tile_step(cols, lane_off, rows, chunks), want)


@pytest.mark.parametrize("dims", [(64, 64), (32, 128), (64, 256)])
def test_bwd_warp_products_match_numpy(dims):
    """mma_ABt, mma_AB_regs, mma_AtB against A @ B on random tiles (one warp)."""
    cols_m, dim = dims
    rng = np.random.default_rng(dim + cols_m)
    rows = 64
    x, y = rng.standard_normal((rows, dim)), rng.standard_normal((rows, dim))
    t = rng.standard_normal((rows, cols_m))
    smem = np.full((2 * rows * dim * 2 + rows * cols_m * 2) // 2, np.nan)
    tile_x, tile_y, tile_t = 0, rows * dim * 2, 2 * rows * dim * 2
    cp_async_tile(smem, tile_x, rows, dim, 128 if dim < 256 else 256, x, 0, rows, dim)
    cp_async_tile(smem, tile_y, rows, dim, 128 if dim < 256 else 256, y, 0, rows, dim)
    for r in range(rows):
        for c in range(cols_m // 8):
            o = (tile_t + tile_offset(cols_m, r, c)) // 2
            smem[o: o + 8] = t[r, 8 * c: 8 * c + 8]

    def frags(acc, n):
        return np.concatenate([a_rows(acc[:, j]) for j in range(n // 8)], axis=1)

    def a_rows(c):  # C fragment (32, 4) -> the 16 x 8 block
        blk = np.empty((16, 8))
        blk[GROUP, 2 * THREAD_IN_GROUP], blk[GROUP, 2 * THREAD_IN_GROUP + 1] = c[:, 0], c[:, 1]
        blk[GROUP + 8, 2 * THREAD_IN_GROUP], blk[GROUP + 8, 2 * THREAD_IN_GROUP + 1] = c[:, 2], c[:, 3]
        return blk

    k0 = dim // 2 if dim >= 128 else 0
    acc = np.zeros((32, 2, 4))  # rows 16..31 of x times rows 32..47 of y, over columns k0..k0+64
    mma_ABt(acc, smem, 16, 64, dim, dim, tile_x, 16, tile_y + 32 * dim * 2, k0)
    np.testing.assert_allclose(frags(acc, 16), x[16:32, k0:k0 + 64] @ y[32:48, k0:k0 + 64].T, atol=1e-12)

    a_val = rng.standard_normal((16, 32))
    a = pack_a_frags(np.stack([c_from_matrix(a_val[:, 8 * j: 8 * j + 8]) for j in range(4)], axis=1))
    acc = np.zeros((32, 4, 4))  # a (16 x 32) times rows 0..31 of x, columns 32..63
    mma_AB_regs(acc, a, smem, 32, 32, dim, tile_x, 32)
    np.testing.assert_allclose(frags(acc, 32), a_val @ x[:32, 32:64], atol=1e-12)

    acc = np.zeros((32, 2, 4))  # t^T rows 16..31 (columns of t) times rows of y, columns 16..31
    mma_AtB(acc, smem, 16, rows, cols_m, dim, tile_t, 16, tile_y, 16)
    np.testing.assert_allclose(frags(acc, 16), t[:, 16:32].T @ y[:, 16:32], atol=1e-12)
