"""Model of kernels_cu/tf32_panels.cuh: the split-and-transpose loaders of float32 operand tiles
for wgmma's tf32 form, their K-major descriptors, and what the tensor cores read through them.

The ground truth of a tf32 operand is written from the PTX ISA (a K-major operand of wgmma
.m64nNk8 .tf32 with the 128-byte swizzle: element (row, k) of a k-step at start + (row % 8) 128 +
(row / 8) SBO + 4 k, then the swizzle on the final address), independent of the loaders; the
loaders and the descriptor are mirrored statement by statement. Shared memory is one slot per
4-byte word, holding float32 bits.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .tf32 import split_tf32
from .wgmma import K_MAJOR, SWIZZLE_128B, decode_descriptor, panel_offset, smem_desc, swizzle_128b

SOURCE = "tf32_panels.cuh"


def tf32_operand_addresses(desc: int, rows: int) -> np.ndarray:
    """Byte address of element (row, k), k < 8, of the rows x 8 K-major tf32 operand of one
    k-step described by `desc` (128-byte swizzle): 8-row core groups of 128-byte rows, SBO apart;
    a row's 8 values are 32 contiguous bytes."""
    d = decode_descriptor(desc)
    assert d.swizzle == SWIZZLE_128B and d.base_offset == 0
    r = np.arange(rows)[:, None]
    k = np.arange(8)[None, :]
    return swizzle_128b(d.start + (r % 8) * 128 + (r // 8) * d.sbo + 4 * k)


def tf32_operand(smem: np.ndarray, desc: int, rows: int) -> np.ndarray:
    """The rows x 8 matrix of float32 bits the tensor cores read through `desc` (K-major; tf32
    has no other form)."""
    return smem[tf32_operand_addresses(desc, rows) // 4]


@mirrors(SOURCE, "return smem_desc(tile + (step >> 2) * (ROWS * 128) + (step & 3) * 32, 16, 1024);")
def tf32_k_step_desc(rows: int, tile: int, step: int) -> int:
    return smem_desc(tile + (step >> 2) * (rows * 128) + (step & 3) * 32, 16, 1024)


def _chunk_words(offset) -> np.ndarray:
    return int(offset) // 4 + np.arange(4)


class Log:
    """What the loaders did, per thread and static instruction: the global elements each 16-byte
    load read ((row, column) of its first value) and the shared byte offset each store wrote."""

    def __init__(self):
        self.loads: dict = {}   # (instruction, thread) -> (row, column) or None (zero fill)
        self.stores: dict = {}  # (instruction, thread) -> byte offset (hi tile; lo is the same offset)

    def load(self, instruction, thread, where):
        self.loads[(instruction, thread)] = where

    def store(self, instruction, thread, offset):
        self.stores[(instruction, thread)] = offset


@mirrors(SOURCE,
         "constexpr int CHUNKS = DIM / 4;",
         "constexpr int ROW_STEP = NTHREADS / CHUNKS;",
         "const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;",
         "const bool column_valid = 4 * chunk < headdim;",
         "const int row = row0 + i * ROW_STEP;",
         "const bool valid = column_valid && row < rows_valid;",
         "const float4 v = valid ? ldg_f32x4(gmem + row * stride + 4 * chunk) : make_float4(0.f, 0.f, 0.f, 0.f);",
         "const u32 offset = panel_offset<ROWS>(row, chunk);",
         "st_shared_v4(hi_tile + offset, hi);",
         "st_shared_v4(lo_tile + offset, lo);")
def split_tf32_panels(products: int, hi_smem, lo_smem, hi_tile: int, lo_tile: int, rows: int, dim: int,
                      nthreads: int, gmem: np.ndarray, rows_valid: int, headdim: int, log: Log | None = None) -> None:
    """Every thread's loads and stores; gmem[r, c] is the slice's element (row r, column c)."""
    chunks = dim // 4
    row_step = nthreads // chunks
    assert dim % 32 == 0 and nthreads % chunks == 0 and rows % row_step == 0  # the static_assert
    for thread in range(nthreads):
        row0, chunk = thread // chunks, thread % chunks
        column_valid = 4 * chunk < headdim
        for i in range(rows // row_step):
            row = row0 + i * row_step
            valid = column_valid and row < rows_valid
            x = gmem[row, 4 * chunk: 4 * chunk + 4] if valid else np.zeros(4, np.float32)
            hi, lo = split_tf32(products, x)
            offset = panel_offset(rows, row, chunk)
            hi_smem[_chunk_words(hi_tile + offset)] = hi
            lo_smem[_chunk_words(lo_tile + offset)] = lo
            if log is not None:
                log.load(i, thread, (row, 4 * chunk) if valid else None)
                log.store(i, thread, offset)


@mirrors(SOURCE,
         "constexpr int ROW_BLOCKS = ROWS / 32, COLUMN_BLOCKS = DIM / 16;",
         "constexpr int WARPS = NTHREADS / 32;",
         "constexpr int WARP_UNITS = ROW_BLOCKS * COLUMN_BLOCKS;",
         "const int warp = thread / 32, lane = thread % 32;",
         "const int unit = warp + u * WARPS;",
         "const int row_group = 8 * (unit % ROW_BLOCKS) + lane % 8;",
         "const int column_group = 4 * (unit / ROW_BLOCKS) + lane / 8;",
         "const int row = 4 * row_group, column = 4 * column_group;",
         "const bool column_valid = column < headdim;",
         "const bool valid = column_valid && row + r < rows_valid;",
         "const float4 v = valid ? ldg_f32x4(gmem + (row + r) * stride + column) : make_float4(0.f, 0.f, 0.f, 0.f);",
         "const float column_values[4] = {x[0][e], x[1][e], x[2][e], x[3][e]};",
         "const u32 offset = panel_offset<DIM>(column + e, row_group);",
         "st_shared_v4(hi_tile + offset, hi);",
         "st_shared_v4(lo_tile + offset, lo);")
def split_tf32_panels_transposed(products: int, hi_smem, lo_smem, hi_tile: int, lo_tile: int, rows: int, dim: int,
                                 nthreads: int, gmem: np.ndarray, rows_valid: int, headdim: int,
                                 log: Log | None = None) -> None:
    row_blocks, column_blocks = rows // 32, dim // 16
    warps = nthreads // 32
    warp_units = row_blocks * column_blocks
    assert rows % 32 == 0 and dim % 16 == 0 and nthreads % 32 == 0 and warp_units % warps == 0  # the static_assert
    for thread in range(nthreads):
        warp, lane = thread // 32, thread % 32
        for u in range(warp_units // warps):
            unit = warp + u * warps
            row_group = 8 * (unit % row_blocks) + lane % 8
            column_group = 4 * (unit // row_blocks) + lane // 8
            row, column = 4 * row_group, 4 * column_group
            column_valid = column < headdim
            x = np.zeros((4, 4), np.float32)
            for r in range(4):
                valid = column_valid and row + r < rows_valid
                if valid:
                    x[r] = gmem[row + r, column: column + 4]
                if log is not None:
                    log.load((u, r), thread, (row + r, column) if valid else None)
            for e in range(4):
                hi, lo = split_tf32(products, x[:, e])
                offset = panel_offset(dim, column + e, row_group)
                hi_smem[_chunk_words(hi_tile + offset)] = hi
                lo_smem[_chunk_words(lo_tile + offset)] = lo
                if log is not None:
                    log.store((u, e), thread, offset)


def k_major_operand_of(products: int, matrix: np.ndarray):
    """(hi, lo) bits of a rows x K float32 matrix stored K-major: what a tile's k-steps must read,
    written from the definition of the split (models.tf32.split_tf32 is tf32.cuh's mirror)."""
    return split_tf32(products, np.ascontiguousarray(matrix, np.float32))


__all__ = ["K_MAJOR", "Log", "k_major_operand_of", "split_tf32_panels", "split_tf32_panels_transposed",
           "tf32_k_step_desc", "tf32_operand", "tf32_operand_addresses"]
