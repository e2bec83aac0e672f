"""The PTX semantics of wgmma (ground truth) and the layout helpers of kernels_cu/wgmma.cuh.

What the tensor cores read is written down once, from the PTX ISA ("Matrix Descriptor Format" of
wgmma, the canonical 128-byte-swizzle layouts of "Shared Memory Matrix Layout", and the register
fragments of wgmma .m64nNk16): decode_descriptor, swizzle_128b, operand_addresses / operand and
wgmma. panel_offset, smem_desc and cp_async_panels mirror wgmma.cuh.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .mirrors import mirrors

# One warpgroup: thread t of the group is lane t % 32 of its warp t // 32.
THREADS = np.arange(128)
WARP_IN_WG = THREADS // 32
LANE = THREADS % 32
GROUP = LANE // 4  # g: row of a lane's fragment elements within its 8-row half
THREAD_IN_GROUP = LANE % 4  # t: column pair of a lane's fragment elements
ROW_LO = 16 * WARP_IN_WG + GROUP  # rows of a thread's accumulator / A-fragment elements: ROW_LO, ROW_LO + 8

K_MAJOR, MN_MAJOR = "K-major", "MN-major"



# ---------------------------------------------------------------------------------------------
# PTX semantics (ground truth)
# ---------------------------------------------------------------------------------------------

class Descriptor(NamedTuple):
    start: int  # byte address of the matrix's first element (before the swizzle)
    lbo: int  # leading dimension byte offset
    sbo: int  # stride dimension byte offset
    base_offset: int
    swizzle: int  # 0: none, 1: 128-byte, 2: 64-byte, 3: 32-byte


SWIZZLE_128B = 1
_DESCRIPTOR_FIELDS = ((0, 14), (16, 14), (32, 14), (49, 3), (62, 2))  # (lowest bit, width)


def decode_descriptor(desc: int) -> Descriptor:
    """The 64-bit wgmma shared-memory matrix descriptor: start address bits 0-13, LBO bits 16-29,
    SBO bits 32-45 (all three in 16-byte units), base offset bits 49-51, swizzle mode bits 62-63;
    every other bit is reserved (0)."""
    desc = int(desc)
    assert 0 <= desc < 1 << 64
    used = sum(((1 << width) - 1) << lo for lo, width in _DESCRIPTOR_FIELDS)
    assert desc & ~used == 0, f"reserved descriptor bits set: {desc & ~used:#x}"
    start, lbo, sbo, base_offset, swizzle = (desc >> lo & ((1 << width) - 1) for lo, width in _DESCRIPTOR_FIELDS)
    return Descriptor(start << 4, lbo << 4, sbo << 4, base_offset, swizzle)


def swizzle_128b(addr):
    """The 128-byte swizzle on a final byte address: the 16-byte chunk within a 128-byte row
    (bits 4-6) is XORed with the row's index within its 1024-byte pattern (bits 7-9). The
    pattern repeats at 1024-byte boundaries of the address, hence the kernels' aligned base."""
    return addr ^ (((addr >> 7) & 7) << 4)


def operand_addresses(desc: int, major: str, rows: int) -> np.ndarray:
    """Byte address of element (row, k) of a rows x 16 operand (16-bit elements, one k-step)
    described by `desc`, 128-byte swizzle. Rows are M for A and N for B (B[k][n] = element (n, k)).

    K-major (k contiguous): 8-row core groups of 128-byte rows, groups SBO apart; the 16 k of a
    row are 32 contiguous bytes (LBO is unused with this swizzle).
    MN-major (rows contiguous): 64-row atoms of 128 bytes, atoms LBO apart; k rows 128 bytes
    apart within an 8-k group, groups SBO apart."""
    d = decode_descriptor(desc)
    assert d.swizzle == SWIZZLE_128B and d.base_offset == 0
    r = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    if major == K_MAJOR:
        addr = d.start + (r % 8) * 128 + (r // 8) * d.sbo + 2 * k
    else:
        assert major == MN_MAJOR
        addr = d.start + (r % 64) * 2 + (r // 64) * d.lbo + (k % 8) * 128 + (k // 8) * d.sbo
    return swizzle_128b(addr)


def operand(smem: np.ndarray, desc: int, major: str, rows: int) -> np.ndarray:
    """The rows x 16 matrix the tensor cores read through `desc` (smem: one slot per 2 bytes)."""
    return smem[operand_addresses(desc, major, rows) // 2]


def acc_to_matrix(d: np.ndarray) -> np.ndarray:
    """The 64 x N matrix held by a warpgroup's accumulators d[thread, j, e]: warp w holds rows
    16w..16w+15 as the m16n8 C fragments of column blocks j (e: (g, 2t), (g, 2t+1), (g+8, 2t),
    (g+8, 2t+1))."""
    m = np.full((64, 8 * d.shape[1]), np.nan)
    cols = 8 * np.arange(d.shape[1])[None, :] + 2 * THREAD_IN_GROUP[:, None]
    rows = ROW_LO[:, None]
    for e in range(4):
        m[rows + 8 * (e >> 1), cols + (e & 1)] = d[:, :, e]
    assert not np.isnan(m).any()
    return m


def acc_from_matrix(m: np.ndarray) -> np.ndarray:
    cols = 8 * np.arange(m.shape[1] // 8)[None, :] + 2 * THREAD_IN_GROUP[:, None]
    rows = ROW_LO[:, None]
    return np.stack([m[rows + 8 * (e >> 1), cols + (e & 1)] for e in range(4)], axis=2)


def a_fragment_matrix(a: np.ndarray) -> np.ndarray:
    """The 64 x 16 A operand of wgmma held in registers a[thread, reg, half] (half 0: low 16
    bits): warp w's rows 16w.. as the m16n8k16 A fragment, reg 0 (g, 2t), 1 (g+8, 2t),
    2 (g, 2t+8), 3 (g+8, 2t+8), each with columns +0 and +1 in its halves."""
    m = np.full((64, 16), np.nan)
    for reg in range(4):
        for half in range(2):
            m[ROW_LO + 8 * (reg & 1), 2 * THREAD_IN_GROUP + 8 * (reg >> 1) + half] = a[:, reg, half]
    assert not np.isnan(m).any()
    return m


class Step(NamedTuple):
    """One wgmma k-step: descriptors and TRANS flags (1: MN-major) as a kernel passes them;
    a is None where A comes from registers."""
    a: int | None
    trans_a: int | None
    b: int
    trans_b: int


def major(trans: int) -> str:
    return MN_MAJOR if trans else K_MAJOR


def wgmma(d: np.ndarray, smem: np.ndarray, step: Step, accumulate: bool, a_regs=None) -> None:
    """wgmma.mma_async m64nNk16 (N = 8 d.shape[1]): D = A B (+ D where scale-d is set)."""
    n = 8 * d.shape[1]
    a = a_fragment_matrix(a_regs) if step.a is None else operand(smem, step.a, major(step.trans_a), 64)
    b = operand(smem, step.b, major(step.trans_b), n).T  # 16 x N
    d[...] = (d if accumulate else 0.0) + acc_from_matrix(a @ b)


def bank_conflict_free(byte_addrs, width: int) -> bool:
    """Whether one wavefront of accesses of `width` bytes (32 lanes of b32, 8 lanes of 16 bytes)
    touches each of the 32 four-byte banks at most once."""
    banks = [(int(a) // 4 + w) % 32 for a in byte_addrs for w in range(width // 4)]
    return len(set(banks)) == len(banks)


# Mirror of kernels_cu/wgmma.cuh and of the small helpers the kernels use
# ---------------------------------------------------------------------------------------------

@mirrors("wgmma.cuh",
         "return static_cast<u32>((chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));")
def panel_offset(rows: int, row, chunk):
    return (chunk >> 3) * (rows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)


@mirrors("wgmma.cuh",
         "return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(lbo_bytes >> 4) << 16) |"
         " (static_cast<u64>(sbo_bytes >> 4) << 32) | (1ull << 62);")
def smem_desc(addr: int, lbo_bytes: int, sbo_bytes: int) -> int:
    return ((addr & 0x3FFFF) >> 4) | ((lbo_bytes >> 4) << 16) | ((sbo_bytes >> 4) << 32) | (1 << 62)


@mirrors("wgmma.cuh",
         "constexpr int CHUNKS = DIM / 8;",
         "constexpr int ROW_STEP = NTHREADS / CHUNKS;",
         "const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;",
         "const int rows_left = chunk * 8 < headdim ? rows_valid - row0 : 0;",
         "const T* src = gmem + row0 * stride + chunk * 8;",
         "const i64 src_step = ROW_STEP * stride;",
         "const u32 dst0 = smem_tile + panel_offset<ROWS>(row0, chunk);",
         "const bool valid = i * ROW_STEP < rows_left;",
         "cp_async_16(dst0 + i * ROW_STEP * 128, valid ? src : gmem, valid);",
         "const u32 dst1 = smem_tile + panel_offset<ROWS>(row0 + 4, chunk);",
         "cp_async_16((i & 1 ? dst1 : dst0) + (i & ~1) * ROW_STEP * 128, valid ? src : gmem, valid);")
def cp_async_panels(smem, smem_tile: int, rows: int, dim: int, nthreads: int, gmem: np.ndarray,
                    rows_valid: int, headdim: int, log=None) -> None:
    """Every thread's cp.async copies; gmem[r] is global row r of the tile (headdim columns).
    Invalid copies zero-fill (src-size 0). `log` (optional) collects (thread, dst, i) per copy.
    A row step of 4 (128 threads on rows of 32 chunks) alternates two swizzled destinations."""
    chunks = dim // 8
    row_step = nthreads // chunks
    assert nthreads % chunks == 0 and rows % row_step == 0 and (row_step % 8 == 0 or row_step == 4)  # the static_assert
    for thread in range(nthreads):
        row0, chunk = thread // chunks, thread % chunks
        rows_left = rows_valid - row0 if chunk * 8 < headdim else 0
        dst0 = smem_tile + panel_offset(rows, row0, chunk)
        dst1 = smem_tile + panel_offset(rows, row0 + 4, chunk)
        for i in range(rows // row_step):
            if row_step % 8 == 0:
                dst = dst0 + i * row_step * 128
            else:
                dst = (dst1 if i & 1 else dst0) + (i & ~1) * row_step * 128
            valid = i * row_step < rows_left
            row = row0 + i * row_step
            smem[dst // 2: dst // 2 + 8] = gmem[row, 8 * chunk: 8 * chunk + 8] if valid else 0.0
            if log is not None:
                log.append((thread, dst, i))



def assert_operand(smem, desc, trans, rows, want):
    """The operand the tensor cores read through `desc` is exactly `want`."""
    got = operand(smem, desc, major(trans), rows)
    assert got.shape == want.shape and np.array_equal(got, want)
