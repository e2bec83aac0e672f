"""Model of kernels_cu/wgmma_tf32.cuh: the split-and-transpose loaders of float32 operand tiles
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

SOURCE = "wgmma_tf32.cuh"


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


def tf32_a_fragment_matrix(a: np.ndarray) -> np.ndarray:
    """The 64 x 8 A operand of wgmma .m64nNk8 .tf32 held in registers a[thread, reg] (PTX ISA,
    register fragments of wgmma for 32-bit types): warp w's rows 16w.., reg 0 (g, t), 1 (g + 8, t),
    2 (g, t + 4), 3 (g + 8, t + 4), g = lane / 4, t = lane % 4."""
    from .wgmma import ROW_LO, THREAD_IN_GROUP
    m = np.full((64, 8), np.nan)
    for reg in range(4):
        m[ROW_LO + 8 * (reg & 1), THREAD_IN_GROUP + 4 * (reg >> 1)] = a[:, reg]
    assert not np.isnan(m).any()
    return m


@mirrors(SOURCE, "return smem_desc(tile + (step >> 2) * (ROWS * 128) + (step & 3) * 32, 16, 1024);")
def tf32_k_step_desc(rows: int, tile: int, step: int) -> int:
    return smem_desc(tile + (step >> 2) * (rows * 128) + (step & 3) * 32, 16, 1024)


@mirrors(SOURCE,
         "const u32 bytes = (step >> 2) * (ROWS * 128) + (step & 3) * 32;",
         "return (tile_desc & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(tile_desc) + (bytes >> 4));")
def tf32_k_step_desc_after(rows: int, tile_desc: int, step: int) -> int:
    """k-step `step`'s descriptor from its tile's (tf32_k_step_desc(rows, tile, 0)): the low word
    plus the step's offset >> 4, with the 32-bit wrap of the kernel's add."""
    nbytes = (step >> 2) * (rows * 128) + (step & 3) * 32
    return (tile_desc & 0xFFFFFFFF00000000) | ((tile_desc + (nbytes >> 4)) & 0xFFFFFFFF)


@mirrors(SOURCE, "return static_cast<u32>((row * (DIM / 4) + (chunk ^ ((row >> 2) & 7))) * 16);")
def staged_offset(dim: int, row, chunk):
    """Byte offset of 16-byte chunk `chunk` of row `row` in a StagedRows<dim> tile."""
    return (row * (dim // 4) + (chunk ^ ((row >> 2) & 7))) * 16


@mirrors(SOURCE,
         "const int q = thread + i * NTHREADS, row = q / CHUNKS, chunk = q % CHUNKS;",
         "if (row < rows_valid && 4 * chunk < headdim)",
         "cp_async_16(tile + staged_offset<DIM>(row, chunk), gmem + row * stride + 4 * chunk, true);")
def cp_async_staged_rows(rows: int, dim: int, nthreads: int, rows_valid: int, headdim: int) -> dict:
    """{(instruction, thread): (row, chunk, byte offset)} of the copies issued."""
    chunks = dim // 4
    assert (rows * chunks) % nthreads == 0
    out = {}
    for i in range(rows * chunks // nthreads):
        for thread in range(nthreads):
            q = thread + i * nthreads
            row, chunk = q // chunks, q % chunks
            if row < rows_valid and 4 * chunk < headdim:
                out[(i, thread)] = (row, chunk, staged_offset(dim, row, chunk))
    return out


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
         "const uint4 v = src.load4(row, 4 * chunk, valid);",
         "const u32 offset = panel_offset<ROWS>(row, chunk);",
         "st_shared_v4(hi_tile + offset, hi);",
         "st_shared_v4(lo_tile + offset, lo);")
def split_tf32_panels(products: int, hi_smem, lo_smem, hi_tile: int, lo_tile: int, rows: int, dim: int,
                      nthreads: int, gmem: np.ndarray, rows_valid: int, headdim: int, log: Log | None = None) -> None:
    """Every thread's loads and stores; gmem[r, c] is the slice's element (row r, column c), what
    the source's load4 returns (GlobalRows or StagedRows alike: staged_offset models the latter)."""
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
         "const uint4 v = src.load4(row + r, column, valid);",
         "u32 column_values[4] = {x[0][e], x[1][e], x[2][e], x[3][e]};",
         "const bool even = (lane & 1) == 0;",
         "const u32 give0 = even ? x[1][e] : x[0][e], give1 = even ? x[3][e] : x[2][e];",
         "const u32 take0 = __shfl_xor_sync(0xffffffffu, give0, 1);",
         "const u32 take1 = __shfl_xor_sync(0xffffffffu, give1, 1);",
         "column_values[0] = even ? x[0][e] : take0;",
         "column_values[1] = even ? x[2][e] : take1;",
         "column_values[2] = even ? take0 : x[1][e];",
         "column_values[3] = even ? take1 : x[3][e];",
         "const u32 offset = panel_offset<DIM>(column + e, row_group);",
         "st_shared_v4(hi_tile + offset, hi);",
         "st_shared_v4(lo_tile + offset, lo);")
def split_tf32_panels_transposed(products: int, hi_smem, lo_smem, hi_tile: int, lo_tile: int, rows: int, dim: int,
                                 nthreads: int, gmem: np.ndarray, rows_valid: int, headdim: int,
                                 log: Log | None = None, key_pairs: bool = False) -> None:
    """The threads run in lockstep per unit, so a shuffle reads the partner's registers of the
    same unit (x_of[thread])."""
    row_blocks, column_blocks = rows // 32, dim // 16
    warps = nthreads // 32
    warp_units = row_blocks * column_blocks
    assert rows % 32 == 0 and dim % 16 == 0 and nthreads % 32 == 0 and warp_units % warps == 0  # the static_assert
    for u in range(warp_units // warps):
        x_of, where = {}, {}
        for thread in range(nthreads):
            warp, lane = thread // 32, thread % 32
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
            x_of[thread], where[thread] = x, (row_group, column)
        for thread in range(nthreads):
            lane = thread % 32
            x, (row_group, column) = x_of[thread], where[thread]
            for e in range(4):
                column_values = x[:, e].copy()
                if key_pairs:
                    even = (lane & 1) == 0
                    partner = x_of[thread ^ 1]
                    give = (lambda y: (y[1, e], y[3, e]) if (thread ^ 1) % 2 == 0 else (y[0, e], y[2, e]))
                    take0, take1 = give(partner)
                    column_values = np.array([x[0, e] if even else take0, x[2, e] if even else take1,
                                              take0 if even else x[1, e], take1 if even else x[3, e]], np.float32)
                hi, lo = split_tf32(products, column_values)
                offset = panel_offset(dim, column + e, row_group)
                hi_smem[_chunk_words(hi_tile + offset)] = hi
                lo_smem[_chunk_words(lo_tile + offset)] = lo
                if log is not None:
                    log.store((u, e), thread, offset)


KEY_PAIR_SLOTS = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # slot s of an 8-group holds position KEY_PAIR_SLOTS[s]


def key_pair_order(n: int) -> np.ndarray:
    """The sequence position in each column slot of a KEY_PAIRS tile of n positions."""
    return (8 * (np.arange(n) // 8) + KEY_PAIR_SLOTS[np.arange(n) % 8])


def k_major_operand_of(products: int, matrix: np.ndarray):
    """(hi, lo) bits of a rows x K float32 matrix stored K-major: what a tile's k-steps must read,
    written from the definition of the split (models.tf32.split_tf32 is tf32.cuh's mirror)."""
    return split_tf32(products, np.ascontiguousarray(matrix, np.float32))


# flash_fwd_tf32_wgmma.cu's uses of the above: its shared-memory layout, the descriptors of each
# product's k-steps, and P's registers as the A operand of O += P V (the relabelling that
# tests/kernels/test_wgmma_tf32.py's P V check applies).
KERNEL = "flash_fwd_tf32_wgmma"
STEPS = "wgmma_tf32_fwd_steps.cuh"  # the per-block steps it shares with flash_fwd_tf32_wgmma_ws


@mirrors(KERNEL,
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4, KV_TILE = BLOCK_N * D_TILE * 4;",
         "static constexpr u32 Q_HI = 0, Q_LO = Q_HI + Q_TILE;",
         "static constexpr u32 K_HI = Q_LO + (Q_REGS ? 0u : Q_TILE), K_LO = K_HI + KV_TILE;",
         "static constexpr u32 V_HI = K_LO + KV_TILE, V_LO = V_HI + KV_TILE;",
         "static constexpr u32 RAW = V_LO + KV_TILE;",
         "static constexpr u32 BYTES = RAW + RAW_STAGES * 2 * KV_TILE;")
def forward_smem(d_tile: int, block_n: int, block_m: int = 64, raw_stages: int = 0, q_regs: bool = False) -> dict:
    q_tile, kv_tile = block_m * d_tile * 4, block_n * d_tile * 4
    layout = {"Q_HI": 0}
    layout["Q_LO"] = layout["Q_HI"] + q_tile
    layout["K_HI"] = layout["Q_LO"] + (0 if q_regs else q_tile)
    layout["K_LO"] = layout["K_HI"] + kv_tile
    layout["V_HI"] = layout["K_LO"] + kv_tile
    layout["V_LO"] = layout["V_HI"] + kv_tile
    layout["RAW"] = layout["V_LO"] + kv_tile
    layout["BYTES"] = layout["RAW"] + raw_stages * 2 * kv_tile
    return layout


WS_KERNEL = "flash_fwd_tf32_wgmma_ws"


@mirrors("wgmma_tf32_fwd_steps.cuh",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4;",
         "static constexpr u32 K_HI = 0, K_LO = KV_TILE, V_HI = 2 * KV_TILE, V_LO = 3 * KV_TILE, BYTES = 4 * KV_TILE;")
def fwd_key_block_tiles(d_tile: int, block_n: int) -> dict:
    """Tf32FwdKeyBlockTiles: a key block's K hi, K lo, V^T hi, V^T lo (the producer's stage, and a
    block of flash_fwd_split_kv_tf32's image)."""
    kv_tile = block_n * d_tile * 4
    return {"KV_TILE": kv_tile, "K_HI": 0, "K_LO": kv_tile, "V_HI": 2 * kv_tile, "V_LO": 3 * kv_tile,
            "BYTES": 4 * kv_tile}


@mirrors(WS_KERNEL,
         "static constexpr u32 KV_TILE = Tiles::KV_TILE, STAGE = Tiles::BYTES;",
         "static constexpr u32 K_HI = Tiles::K_HI, K_LO = Tiles::K_LO, V_HI = Tiles::V_HI, V_LO = Tiles::V_LO;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4;",
         "static constexpr u32 Q = STAGES * STAGE, RAW = Q + (Q_STAGED ? Q_TILE : 0u);",
         "static constexpr u32 RAW_BYTES = Q_STAGED || RAW_STAGES * 2 * KV_TILE > Q_TILE ? RAW_STAGES * 2 * KV_TILE : Q_TILE;",
         "static constexpr u32 O_STAGING = Q_STAGED ? Q : RAW;",
         "static constexpr u32 FULL = RAW + RAW_BYTES, EMPTY = FULL + 8 * STAGES;",
         "static constexpr u32 BYTES = EMPTY + 8 * STAGES;")
def forward_ws_smem(d_tile: int, block_n: int, stages: int, raw_stages: int, q_staged: bool = False) -> dict:
    tiles = fwd_key_block_tiles(d_tile, block_n)
    kv_tile = tiles["KV_TILE"]
    layout = {"KV_TILE": kv_tile, "STAGE": tiles["BYTES"], **{k: tiles[k] for k in ("K_HI", "K_LO", "V_HI", "V_LO")}}
    q_tile = 128 * d_tile * 4
    layout["Q"] = stages * layout["STAGE"]
    layout["RAW"] = layout["Q"] + (q_tile if q_staged else 0)
    # the raw tiles stage O in the epilogue (128 rows): the region is at least that large, unless
    # Q's staged tile does it
    raw_bytes = raw_stages * 2 * kv_tile if q_staged or raw_stages * 2 * kv_tile > q_tile else q_tile
    layout["O_STAGING"] = layout["Q"] if q_staged else layout["RAW"]
    layout["FULL"] = layout["RAW"] + raw_bytes
    layout["EMPTY"] = layout["FULL"] + 8 * stages
    layout["BYTES"] = layout["EMPTY"] + 8 * stages
    return layout


@mirrors(STEPS,
         ": tile(tile_), lane_offset((strip_row0 + lane / 4) * ROW_BYTES + (lane / 4 % 8) * 16 + 4 * (lane % 4)) {}",
         "const u32 offset = (lane_offset ^ static_cast<u32>((2 * kk + (r >> 1)) * 16)) + (r & 1) * 8 * ROW_BYTES;")
def staged_q_offsets(d_tile: int, strip_row0: int, lane: int, kk: int) -> list:
    """StagedQ::split's byte offsets in the Q tile of k-step kk's four A registers of a lane."""
    row_bytes = d_tile * 4
    lane_offset = (strip_row0 + lane // 4) * row_bytes + (lane // 4 % 8) * 16 + 4 * (lane % 4)
    return [(lane_offset ^ ((2 * kk + (r >> 1)) * 16)) + (r & 1) * 8 * row_bytes for r in range(4)]


@mirrors(STEPS,
         "const int row = strip_row0 + lane % 16, chunk = 2 * i + lane / 16;",
         "const uint4 v = ldg_bits4(q_rows + row * stride + 4 * chunk, row < rows_valid && 4 * chunk < headdim);")
def stage_q_rows(d_tile: int, strip_row0: int, lane: int) -> list:
    """(row, chunk) of each of a lane's stage_q_rows copies, in order."""
    return [(strip_row0 + lane % 16, 2 * i + lane // 16) for i in range(d_tile // 4 // 2)]


@mirrors(STEPS,
         "const int row = strip_row0 + lane / 4 + 8 * (r & 1), column = 8 * kk + lane % 4 + 4 * (r >> 1);",
         "const float x = row < rows_valid && column < headdim ? __ldg(q_rows + row * stride + column) : 0.f;")
def load_q_fragments(d_tile: int, q: np.ndarray, rows_valid: int, headdim: int) -> np.ndarray:
    """a[thread, kk, r] of the warpgroup's 128 threads (strip_row0 = 16 warp): Q's values, zero past
    rows_valid and headdim (before the split, which acts per value)."""
    a = np.zeros((128, d_tile // 8, 4), np.float32)
    for thread in range(128):
        strip_row0, lane = 16 * (thread // 32), thread % 32
        for kk in range(d_tile // 8):
            for r in range(4):
                row, column = strip_row0 + lane // 4 + 8 * (r & 1), 8 * kk + lane % 4 + 4 * (r >> 1)
                a[thread, kk, r] = q[row, column] if row < rows_valid and column < headdim else 0.0
    return a


@mirrors(STEPS,
         "const u64 q_hi_desc = tf32_k_step_desc<64>(q_hi_tile, kk);",
         "const u64 k_hi_desc = tf32_k_step_desc<BLOCK_N>(k_hi_tile, 0), k_lo_desc = tf32_k_step_desc<BLOCK_N>(k_lo_tile, 0);",
         "const u64 k_hi = tf32_k_step_desc_after<BLOCK_N>(k_hi_desc, kk);")
@mirrors(SOURCE,  # tf32_acc_times_tile: the forward's O += P V, the backward's dV += P^T dO and dK += dS^T Q
         "const u64 b_hi_desc = tf32_k_step_desc<N>(b_hi_tile, 0), b_lo_desc = tf32_k_step_desc<N>(b_lo_tile, 0);",
         "const u64 b_hi = tf32_k_step_desc_after<N>(b_hi_desc, f);",
         "const float x[4] = {a[4 * f], a[4 * f + 2], a[4 * f + 1], a[4 * f + 3]};")
def p_as_a_registers(acc_block: np.ndarray) -> np.ndarray:
    """A's registers of an accumulator-times-tile product's k-step (O += P V) from the accumulator's
    column block (acc[:, j, :], the flat a[4 j .. 4 j + 3]): {d0, d2, d1, d3}, for a B tile in
    KEY_PAIRS order."""
    return acc_block[:, [0, 2, 1, 3]]


__all__ = ["WS_KERNEL", "forward_ws_smem", "load_q_fragments", "staged_offset", "cp_async_staged_rows", "forward_smem", "p_as_a_registers", "tf32_a_fragment_matrix", "K_MAJOR", "KEY_PAIR_SLOTS", "Log", "k_major_operand_of", "key_pair_order", "split_tf32_panels", "split_tf32_panels_transposed",
           "tf32_k_step_desc", "tf32_k_step_desc_after", "tf32_operand", "tf32_operand_addresses"]
