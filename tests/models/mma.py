"""The PTX semantics of ldmatrix and mma.sync.m16n8k16 (ground truth) and the helpers of
kernels_cu/mma.cuh, for the mma.sync kernels' models.

The PTX semantics are written down once, from the PTX ISA ("Warp-level matrix load instruction:
ldmatrix", "Matrix Fragments for mma.m16n8k16"): ldmatrix_x4, a_matrix / b_matrix / c_from_matrix
and mma_16816, the quad shuffles of quad_reduce. swizzled_offset, FragmentAddress and
cp_async_tile mirror mma.cuh. Registers are arrays with a leading lane axis; the models compute in
float64 (no 16-bit rounding), and a_matrix / b_matrix reject a fragment that holds NaN (a slot
never written) unless ``nan_is_data`` says the NaN is the data.
"""
from __future__ import annotations

import sys

import numpy as np

LANES = np.arange(32)
GROUP = LANES // 4  # g: row (A, C) or column (B) of a lane's fragment elements
THREAD_IN_GROUP = LANES % 4  # t


# ---------------------------------------------------------------------------------------------
# PTX semantics (ground truth)
# ---------------------------------------------------------------------------------------------

def ldmatrix_x4(smem: np.ndarray, addr: np.ndarray, trans: bool = False) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 on a shared memory of 16-bit slots.

    ``addr``: byte address supplied by each of the 32 lanes (lanes 8i..8i+7 give the rows of
    matrix i). Returns regs[lane, i, half]: half 0 is the low 16 bits of register i."""
    assert addr.shape == (32,) and np.all(addr % 16 == 0)
    regs = np.empty((32, 4, 2), dtype=smem.dtype)
    for i in range(4):
        row_start = addr[8 * i: 8 * i + 8] // 2  # element index of each matrix row
        for half in range(2):
            if not trans:  # lane l: row l/4, columns 2(l%4), 2(l%4)+1
                regs[:, i, half] = smem[row_start[GROUP] + 2 * THREAD_IN_GROUP + half]
            else:  # lane l: rows 2(l%4), 2(l%4)+1, column l/4
                regs[:, i, half] = smem[row_start[2 * THREAD_IN_GROUP + half] + GROUP]
    return regs


def a_matrix(a: np.ndarray) -> np.ndarray:
    """The 16 x 16 A operand held by per-lane fragments a[lane, reg, half]."""
    m = np.full((16, 16), np.nan)
    g, t = GROUP, THREAD_IN_GROUP
    for half in range(2):
        m[g, 2 * t + half] = a[:, 0, half]
        m[g + 8, 2 * t + half] = a[:, 1, half]
        m[g, 2 * t + 8 + half] = a[:, 2, half]
        m[g + 8, 2 * t + 8 + half] = a[:, 3, half]
    assert not np.isnan(m).any()
    return m


def b_matrix(b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """The 16 x 8 (k x n) B operand held by per-lane fragments b0[lane, half], b1[lane, half]."""
    m = np.full((16, 8), np.nan)
    g, t = GROUP, THREAD_IN_GROUP
    for half in range(2):
        m[2 * t + half, g] = b0[:, half]
        m[2 * t + 8 + half, g] = b1[:, half]
    assert not np.isnan(m).any()
    return m


def c_from_matrix(d: np.ndarray) -> np.ndarray:
    """Per-lane accumulator fragments c[lane, 4] of a 16 x 8 matrix."""
    g, t = GROUP, THREAD_IN_GROUP
    return np.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]], axis=1)


def mma_16816(acc: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> None:
    """acc[lane, 4] += A B for mma.sync.aligned.m16n8k16.row.col (fp32 accumulate)."""
    acc += c_from_matrix(a_matrix(a) @ b_matrix(b0, b1))


def quad_reduce(x: np.ndarray, op) -> np.ndarray:
    """shfl_xor over offsets 2 and 1 (cf::group_max<4> / group_sum<4>) on per-lane values."""
    for offset in (2, 1):
        x = op(x, x[LANES ^ offset])
    return x


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/mma.cuh
# ---------------------------------------------------------------------------------------------

def swizzled_offset(dim: int, row, chunk):
    assert dim % 64 == 0
    return (row * (dim // 8) + (chunk ^ (row & 7))) * 16


class FragmentAddress:
    def __init__(self, dim: int, lane_row, lane_chunk):
        self.row_bytes = 2 * dim
        self.row_offset = lane_row * self.row_bytes
        self.chunk_xor = (lane_chunk ^ (lane_row & 7)) * 16

    def __call__(self, tile: int, r: int, c: int):
        return (tile + self.row_offset + (self.chunk_xor ^ ((2 * c & 7) * 16))
                + r * 16 * self.row_bytes + (c >> 2) * 128)


def a_operand_address(dim: int, strip_row0: int = 0) -> FragmentAddress:
    """A from a row-major tile (Q), and B = V read with .trans: lane_row = lane % 16, chunk = lane / 16."""
    return FragmentAddress(dim, strip_row0 + (LANES & 15), LANES >> 4)


def k_operand_address(dim: int) -> FragmentAddress:
    """B = K^T from a row-major [key][dim] tile."""
    return FragmentAddress(dim, ((LANES >> 4) << 3) + (LANES & 7), (LANES >> 3) & 1)


def cp_async_tile(smem, smem_tile: int, rows: int, dim: int, nthreads: int, gmem: np.ndarray,
                  row_start: int, rows_valid: int, headdim: int, written=None) -> None:
    """Every thread's copies of cf::cp_async_tile; gmem is the (seqlen, headdim) slice and the
    tile starts at its row row_start. ``written`` (optional) counts writes per 16-byte slot."""
    chunks = dim // 8
    row_step = nthreads // chunks
    assert nthreads % chunks == 0 and rows % row_step == 0
    for thread in range(nthreads):
        row0, chunk = thread // chunks, thread % chunks
        rows_left = rows_valid - row0 if chunk * 8 < headdim else 0
        for i in range(rows // row_step):
            valid = i * row_step < rows_left
            if row_step % 8 == 0:
                dst = smem_tile + swizzled_offset(dim, row0, chunk) + i * row_step * dim * 2
            else:
                dst = smem_tile + swizzled_offset(dim, row0 + i * row_step, chunk)
            row = row_start + row0 + i * row_step
            smem[dst // 2: dst // 2 + 8] = gmem[row, chunk * 8: chunk * 8 + 8] if valid else 0
            if written is not None:
                written[dst // 16] += 1


def nan_is_data(monkeypatch) -> None:
    """From here on (a test's monkeypatch) a_matrix and b_matrix take NaN as data: the tests of
    NaN inputs, where an unwritten fragment cannot be told from a NaN one."""

    def a_matrix_with_nan_data(a):
        m = np.empty((16, 16))
        g, t = GROUP, THREAD_IN_GROUP
        for half in range(2):
            m[g, 2 * t + half], m[g + 8, 2 * t + half] = a[:, 0, half], a[:, 1, half]
            m[g, 2 * t + 8 + half], m[g + 8, 2 * t + 8 + half] = a[:, 2, half], a[:, 3, half]
        return m

    def b_matrix_with_nan_data(b0, b1):
        m = np.empty((16, 8))
        for half in range(2):
            m[2 * THREAD_IN_GROUP + half, GROUP], m[2 * THREAD_IN_GROUP + 8 + half, GROUP] = b0[:, half], b1[:, half]
        return m

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "a_matrix", a_matrix_with_nan_data)
    monkeypatch.setattr(module, "b_matrix", b_matrix_with_nan_data)
