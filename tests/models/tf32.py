"""Model of the float32 tensor-core forward's tile steps (kernels_cu/tf32.cuh,
kernels_cu/tf32_fwd_steps.cuh): the PTX semantics of mma.sync.m16n8k8 .tf32 (ground truth, from
the PTX ISA's "Matrix Fragments for mma.m16n8k8"), the operand split, and one warp's S = Q K^T and
O += P V from swizzled float32 tiles.

A float32 tile is modelled as mma.py's shared memory of 16-bit slots at twice the width, each
value written into both slots of its 32-bit word: ldmatrix (mma.py's ground truth) then hands each
lane whole words, which ``words`` checks and unpacks. Values are float64; the tensor core's
reading of a tf32 operand (its 13 low mantissa bits ignored) is modelled on float32 bits.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .mma import GROUP, LANES, THREAD_IN_GROUP, c_from_matrix, cp_async_tile, ldmatrix_x4, swizzled_offset

# ---------------------------------------------------------------------------------------------
# PTX semantics (ground truth)
# ---------------------------------------------------------------------------------------------


def tensor_core_reads(bits: np.ndarray) -> np.ndarray:
    """The value a .tf32 operand register holding float32 ``bits`` (uint32) has for the tensor
    core: its 13 low mantissa bits ignored."""
    return (np.asarray(bits, np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def a_matrix(a: np.ndarray) -> np.ndarray:
    """The 16 x 8 A operand held by per-lane registers a[lane, 4] (values)."""
    m = np.full((16, 8), np.nan)
    g, t = GROUP, THREAD_IN_GROUP
    m[g, t], m[g + 8, t], m[g, t + 4], m[g + 8, t + 4] = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    assert not np.isnan(m).any()
    return m


def b_matrix(b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """The 8 x 8 (k x n) B operand held by per-lane registers b0[lane], b1[lane] (values)."""
    m = np.full((8, 8), np.nan)
    m[THREAD_IN_GROUP, GROUP], m[THREAD_IN_GROUP + 4, GROUP] = b0, b1
    assert not np.isnan(m).any()
    return m


def mma_1688_tf32(acc: np.ndarray, a_bits: np.ndarray, b0_bits: np.ndarray, b1_bits: np.ndarray) -> None:
    """acc[lane, 4] += A B for mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 on registers
    of float32 bits (exact products, float64 sums)."""
    acc += c_from_matrix(a_matrix(tensor_core_reads(a_bits)) @ b_matrix(tensor_core_reads(b0_bits),
                                                                         tensor_core_reads(b1_bits)))


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/tf32.cuh
# ---------------------------------------------------------------------------------------------

def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


@mirrors("tf32.cuh", 'asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));')
def tf32_rounded(x) -> np.ndarray:
    """cvt.rna.tf32.f32 (PTX ISA: round to nearest, ties away from zero; NaN and Inf as they are),
    the 13 low bits cleared."""
    bits = _bits(x)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    rounded = ((bits.astype(np.uint64) + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return np.where(finite, rounded, bits)


@mirrors("tf32.cuh", "__device__ __forceinline__ u32 tf32_rounded_finite(float x) { return __float_as_uint(x) + 0x1000u; }")
def tf32_rounded_finite(x) -> np.ndarray:
    return (_bits(x).astype(np.uint64) + 0x1000).astype(np.uint32)


@mirrors("tf32.cuh", "hi = tf32_rounded_finite(x) & 0xffffe000u;", "const float rest = x - __uint_as_float(hi);",
         "lo = tf32_rounded(rest);", "hi = LO == Tf32Lo::FINITE ? tf32_rounded_finite(x) : tf32_rounded(x);",
         "lo = 0u;")
def split_tf32(products: int, x) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) as float32 bits of float32 values ``x`` (Tf32Lo::ROUNDED, the default)."""
    x = np.asarray(x, np.float32)
    if products == 3:
        hi = tf32_rounded_finite(x) & np.uint32(0xFFFFE000)
        with np.errstate(invalid="ignore"):
            lo = tf32_rounded(x - hi.view(np.float32))
    else:
        hi, lo = tf32_rounded(x), np.zeros(x.shape, np.uint32)
    return hi, lo


@mirrors("tf32.cuh", "mma_1688_tf32(acc, a_lo, b_hi0, b_hi1);", "mma_1688_tf32(acc, a_hi, b_lo0, b_lo1);",
         "mma_1688_tf32(acc, a_hi, b_hi0, b_hi1);")
def mma_tf32(products: int, acc, a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1) -> None:
    if products == 3:
        mma_1688_tf32(acc, a_lo, b_hi0, b_hi1)
        mma_1688_tf32(acc, a_hi, b_lo0, b_lo1)
    mma_1688_tf32(acc, a_hi, b_hi0, b_hi1)


def swizzled_offset_f32(dim: int, row, col):
    return swizzled_offset(2 * dim, row, col >> 2) + 4 * (col & 3)


# ---------------------------------------------------------------------------------------------
# Float32 tiles in 16-bit slots
# ---------------------------------------------------------------------------------------------

def float32_tile(rows: int, dim: int, values: np.ndarray, nthreads: int = 256) -> np.ndarray:
    """The shared tile cp_async_tile_f32 fills with ``values`` (rows x headdim float32): mma.py's
    cp_async_tile at twice the width, each value in both slots of its word."""
    headdim = values.shape[1]
    doubled = np.repeat(np.asarray(values, np.float32).astype(np.float64), 2, axis=1)
    smem = np.full(rows * 2 * dim, np.nan)
    cp_async_tile(smem, 0, rows, 2 * dim, nthreads, doubled, 0, values.shape[0], 2 * headdim)
    return smem


def words(regs: np.ndarray) -> np.ndarray:
    """ldmatrix registers [lane, i, half] of a float32 tile -> float32 bits [lane, i]."""
    assert np.array_equal(regs[..., 0], regs[..., 1], equal_nan=True), "a register split across two values"
    return _bits(regs[..., 0])


def read_word(smem: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """A float32 read at byte ``offsets`` (per lane) of a float32 tile -> bits [lane]."""
    assert np.all(offsets % 4 == 0)
    lo, hi = smem[offsets // 2], smem[offsets // 2 + 1]
    assert np.array_equal(lo, hi, equal_nan=True)
    return _bits(lo)


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/tf32_fwd_steps.cuh (one warp, one strip of 16 rows)
# ---------------------------------------------------------------------------------------------

@mirrors("tf32_fwd_steps.cuh", "ldmatrix_x4(a, a_addr(q_rows, i, kk));", "ldmatrix_x4(b, k_addr(k_tile, f / 2, kk));",
         "mma_tf32<PRODUCTS, STEP_SUMS>(s[i][f], a_hi[i], a_lo[i], b_hi[0], b_hi[1], b_lo[0], b_lo[1]);",
         "mma_tf32<PRODUCTS, STEP_SUMS>(s[i][f + 1], a_hi[i], a_lo[i], b_hi[2], b_hi[3], b_lo[2], b_lo[3]);")
def mma_qk_tf32(products: int, dim: int, n_frags: int, q_smem, a_addr, k_smem, k_addr) -> np.ndarray:
    """s[lane, fragment, 4] of S = Q K^T for the strip at the A addresses' rows."""
    s = np.zeros((32, n_frags, 4))
    for kk in range(dim // 8):
        a_hi, a_lo = split_tf32(products, words(ldmatrix_x4(q_smem, a_addr(0, 0, kk))).view(np.float32))
        for f in range(0, n_frags, 2):
            b_hi, b_lo = split_tf32(products, words(ldmatrix_x4(k_smem, k_addr(0, f // 2, kk))).view(np.float32))
            mma_tf32(products, s[:, f], a_hi, a_lo, b_hi[:, 0], b_hi[:, 1], b_lo[:, 0], b_lo[:, 1])
            mma_tf32(products, s[:, f + 1], a_hi, a_lo, b_hi[:, 2], b_hi[:, 3], b_lo[:, 2], b_lo[:, 3])
    return s


@mirrors("tf32_fwd_steps.cuh", "row_base[e] = static_cast<u32>(row * ROW_BYTES + 4 * (g & 3));",
         "chunk_x16[e] = static_cast<u32>(((g >> 2) ^ row) * 16);")
def v_lane_offsets(dim: int):
    """(row_base[e], chunk_x16[e]) per lane, e = 0, 1."""
    g, t = GROUP, THREAD_IN_GROUP
    row_bytes = dim * 4
    rows = [2 * t + e for e in range(2)]
    return [row * row_bytes + 4 * (g & 3) for row in rows], [((g >> 2) ^ row) * 16 for row in rows]


@mirrors("tf32_fwd_steps.cuh",
         "const u32 offset = row_base[e] + static_cast<u32>(kk * 8 * ROW_BYTES + (c >> 2) * 128) +",
         "(chunk_x16[e] ^ static_cast<u32>((2 * c & 7) * 16));")
def v_offset(dim: int, row_base, chunk_x16, kk: int, c: int):
    return row_base + (kk * 8 * dim * 4 + (c >> 2) * 128) + (chunk_x16 ^ ((2 * c & 7) * 16))


@mirrors("tf32_fwd_steps.cuh", "const float p[4] = {s[i][kk][0], s[i][kk][2], s[i][kk][1], s[i][kk][3]};",
         "mma_tf32<PRODUCTS, STEP_SUMS>(o[i][c], a_hi[i], a_lo[i], b_hi[0], b_hi[1], b_lo[0], b_lo[1]);")
def mma_pv_tf32(products: int, dim: int, s: np.ndarray, v_smem) -> np.ndarray:
    """o[lane, fragment, 4] += P V for one strip, P the accumulator fragments s[lane, kk, 4]."""
    n_frags = s.shape[1]
    o = np.zeros((32, dim // 8, 4))
    row_base, chunk_x16 = v_lane_offsets(dim)
    for kk in range(n_frags):
        p = np.stack([s[:, kk, 0], s[:, kk, 2], s[:, kk, 1], s[:, kk, 3]], axis=1)
        a_hi, a_lo = split_tf32(products, p.astype(np.float32))
        for c in range(dim // 8):
            b = [split_tf32(products, read_word(v_smem, v_offset(dim, row_base[e], chunk_x16[e], kk, c))
                            .view(np.float32)) for e in range(2)]
            mma_tf32(products, o[:, c], a_hi, a_lo, b[0][0], b[1][0], b[0][1], b[1][1])
    return o


@mirrors("tf32_fwd_steps.cuh", "const u32 offset = swizzled_offset<2 * D_TILE>(row0 + i * ROW_STEP, chunk);",
         "st_shared_v4(tile + offset, hi);", "if constexpr (Tf32Operand<PRODUCTS>::SPLIT) st_shared_v4(lo_tile + offset, lo);")
def split_tile(products: int, tile: np.ndarray, rows: int, dim: int, nthreads: int, touched=None):
    """split_tile on a float32 tile in 16-bit slots (float32_tile's): returns (hi tile, lo tile),
    each value's bits in both slots of its word; ``touched`` (optional) counts each thread's
    16-byte chunks, to show that the threads cover the tile once."""
    chunks = 2 * dim // 8
    row_step = nthreads // chunks
    hi_tile, lo_tile = tile.copy(), np.full(tile.shape, np.nan)
    for thread in range(nthreads):
        row0, chunk = thread // chunks, thread % chunks
        for i in range(rows // row_step):
            offset = swizzled_offset(2 * dim, row0 + i * row_step, chunk)
            if touched is not None:
                touched[offset // 16] += 1
            words = offset // 2 + 2 * np.arange(4)
            hi, lo = split_tf32(products, _bits(tile[words]).view(np.float32))
            for w, h, l_ in zip(words, hi, lo):
                hi_tile[w] = hi_tile[w + 1] = h.view(np.float32)
                lo_tile[w] = lo_tile[w + 1] = l_.view(np.float32)
    return hi_tile, lo_tile


def v_read_banks(dim: int, kk: int, c: int, e: int) -> np.ndarray:
    """The shared-memory bank of each lane's V read (kk, c, e): 4-byte banks, 32 of them."""
    row_base, chunk_x16 = v_lane_offsets(dim)
    return (v_offset(dim, row_base[e], chunk_x16[e], kk, c) // 4) % 32


def lane_row_of_strip():
    """Rows g and g + 8 of the accumulator fragments, per lane."""
    return GROUP, GROUP + 8


__all__ = ["LANES", "a_matrix", "b_matrix", "float32_tile", "mma_1688_tf32", "mma_pv_tf32", "mma_qk_tf32",
           "split_tf32", "swizzled_offset_f32", "tensor_core_reads", "tf32_rounded", "tf32_rounded_finite",
           "v_read_banks"]
