"""Model of kernels_cu/flash_bwd_dkdv_tf32_wgmma.cu (perf log tf32-wgmma-bwd-v0): its shared-memory
layout, the tiles its loaders fill (wgmma_tf32.cuh's loaders, models/wgmma_tf32.py), the operands
each product reads through its descriptors and registers, and where the epilogue stores each
accumulator value. The products are emulated k-step by k-step from what the tensor cores read
(models/tf32.py tensor_core_reads), in float64: a layout slip moves a value to another key, query
or column and shows as an O(1) error, where the split's own error is 2^-21 relative.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .tf32 import tensor_core_reads
from .wgmma import ROW_LO, THREAD_IN_GROUP, acc_from_matrix
from .wgmma_tf32 import (p_as_a_registers, split_tf32_panels, split_tf32_panels_transposed, tf32_a_fragment_matrix,
                         tf32_k_step_desc, tf32_operand)

KERNEL = "flash_bwd_dkdv_tf32_wgmma"
BLOCK_N = 64
NTHREADS = 128
STAT_SLOTS = 4  # dmma_bwd_steps.cuh's StatSlot: lse, delta, weight, dp_ref


@mirrors(KERNEL,
         "static constexpr int BLOCK_N = 64, STAT_RING = RAW_STAGES + 1;",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4, Q_TILE = BLOCK_M * D_TILE * 4;",
         "static constexpr u32 K_HI = 0, K_LO = K_HI + KV_TILE, V_HI = K_LO + KV_TILE, V_LO = V_HI + KV_TILE;",
         "static constexpr u32 Q_HI = V_LO + KV_TILE, Q_LO = Q_HI + Q_TILE, DO_HI = Q_LO + Q_TILE, "
         "DO_LO = DO_HI + Q_TILE;",
         "static constexpr u32 QT_HI = DO_LO + Q_TILE, QT_LO = QT_HI + Q_TILE, DOT_HI = QT_LO + Q_TILE, "
         "DOT_LO = DOT_HI + Q_TILE;",
         "static constexpr u32 RAW = DOT_LO + Q_TILE;",
         "static constexpr u32 STATS = RAW + RAW_STAGES * 2 * Q_TILE;",
         "static constexpr u32 BYTES = STATS + STAT_RING * STAT_SLOTS * BLOCK_M * 4;",
         "constexpr int BLOCK_N = L::BLOCK_N, NTHREADS = 128, PRODUCTS = 3;",
         "constexpr int SV = BLOCK_M / 2;",
         "constexpr int DV = D_TILE / 2;",
         "constexpr int STAGES = RAW_STAGES > 0 ? RAW_STAGES : 1;",
         "constexpr int K_STEPS = D_TILE / 8;",
         "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);",
         "const u32 raw = base + L::RAW + (it % STAGES) * 2 * L::Q_TILE;",
         "const u32 dst = base + L::STATS + ((it % L::STAT_RING) * STAT_SLOTS * BLOCK_M + tid) * 4;")
def backward_smem(d_tile: int, block_m: int, raw_stages: int) -> dict:
    """BwdTf32WgmmaSmem's offsets in bytes from the aligned base."""
    kv_tile, q_tile = BLOCK_N * d_tile * 4, block_m * d_tile * 4
    layout = {"STAT_RING": raw_stages + 1, "KV_TILE": kv_tile, "Q_TILE": q_tile, "K_HI": 0}
    for name, after, size in (("K_LO", "K_HI", kv_tile), ("V_HI", "K_LO", kv_tile), ("V_LO", "V_HI", kv_tile),
                              ("Q_HI", "V_LO", kv_tile), ("Q_LO", "Q_HI", q_tile), ("DO_HI", "Q_LO", q_tile),
                              ("DO_LO", "DO_HI", q_tile), ("QT_HI", "DO_LO", q_tile), ("QT_LO", "QT_HI", q_tile),
                              ("DOT_HI", "QT_LO", q_tile), ("DOT_LO", "DOT_HI", q_tile), ("RAW", "DOT_LO", q_tile)):
        layout[name] = layout[after] + size
    layout["STATS"] = layout["RAW"] + raw_stages * 2 * q_tile
    layout["BYTES"] = layout["STATS"] + layout["STAT_RING"] * STAT_SLOTS * block_m * 4
    return layout


def load_tiles(d_tile: int, block_m: int, k, v, q, do, keys_valid: int, queries_valid: int, headdim: int,
               headdim_v: int) -> np.ndarray:
    """Shared memory (one uint32 word a slot, from the aligned base) after the kernel's split of K
    and V and of one query block's Q and dO (split_query_block), the calls as the kernel makes
    them (PRODUCTS 3, KEY_PAIRS for the transposed tiles)."""
    L = backward_smem(d_tile, block_m, 0)
    smem = np.full(L["BYTES"] // 4, 0xFFFFFFFF, np.uint32)
    for tile, rows, rows_valid, dim_valid, x in (("K", BLOCK_N, keys_valid, headdim, k),
                                                 ("V", BLOCK_N, keys_valid, headdim_v, v),
                                                 ("Q", block_m, queries_valid, headdim, q),
                                                 ("DO", block_m, queries_valid, headdim_v, do)):
        split_tf32_panels(3, smem, smem, L[tile + "_HI"], L[tile + "_LO"], rows, d_tile, NTHREADS, x, rows_valid,
                          dim_valid)
    for tile, dim_valid, x in (("QT", headdim, q), ("DOT", headdim_v, do)):
        split_tf32_panels_transposed(3, smem, smem, L[tile + "_HI"], L[tile + "_LO"], block_m, d_tile, NTHREADS, x,
                                     queries_valid, dim_valid, key_pairs=True)
    return smem


@mirrors(KERNEL,
         "const u64 a_hi_desc = tf32_k_step_desc<BLOCK_N>(a_hi, kk), b_hi_desc = tf32_k_step_desc<BLOCK_M>(b_hi, kk);",
         "WgmmaTf32<BLOCK_M>::ss(small, tf32_k_step_desc<BLOCK_N>(a_lo, kk), b_hi_desc, kk > 0);",
         "WgmmaTf32<BLOCK_M>::ss(small, a_hi_desc, tf32_k_step_desc<BLOCK_M>(b_lo, kk), 1);",
         "WgmmaTf32<BLOCK_M>::ss(hh, a_hi_desc, b_hi_desc, hh_accumulates);",
         "s, rows_times_rows(base + L::K_HI, base + L::K_LO, base + L::Q_HI, base + L::Q_LO), NoTurns());",
         "dp, rows_times_rows(base + L::V_HI, base + L::V_LO, base + L::DO_HI, base + L::DO_LO), NoTurns());")
def rows_times_rows(smem, d_tile: int, block_m: int, a_hi: int, a_lo: int, b_hi: int, b_lo: int) -> np.ndarray:
    """The 64 x block_m product the three ss wgmmas of every k-step form (lo hi + hi lo + hi hi),
    A (64 rows) and B (block_m rows) read K-major through their descriptors."""
    out = np.zeros((BLOCK_N, block_m))
    for kk in range(d_tile // 8):
        def read(tile, rows):
            return tensor_core_reads(tf32_operand(smem, tf32_k_step_desc(rows, tile, kk), rows))
        ah, al, bh, bl = read(a_hi, BLOCK_N), read(a_lo, BLOCK_N), read(b_hi, block_m), read(b_lo, block_m)
        out += al @ bh.T + ah @ bl.T + ah @ bh.T
    return out


@mirrors(KERNEL,
         "tf32_acc_times_tile<D_TILE, BLOCK_M / 8, PRODUCTS, SUMS_APART>(dv_acc, s, base + L::DOT_HI, base + L::DOT_LO,",
         "tf32_acc_times_tile<D_TILE, BLOCK_M / 8, PRODUCTS, SUMS_APART>(dk_acc, dp, base + L::QT_HI, base + L::QT_LO,")
def acc_times_tile(smem, d_tile: int, block_m: int, acc, b_hi: int, b_lo: int) -> np.ndarray:
    """tf32_acc_times_tile's product (wgmma_tf32.cuh), 64 x d_tile: A = the accumulator values
    acc[thread, f, e] of a 64 x block_m product, k-step f's registers relabelled
    (p_as_a_registers) and split, B = the KEY_PAIRS tile's k-step f, N = d_tile rows."""
    from .tf32 import split_tf32

    out = np.zeros((BLOCK_N, d_tile))
    for f in range(block_m // 8):
        a_hi, a_lo = split_tf32(3, p_as_a_registers(acc[:, f, :]))
        ah, al = (tf32_a_fragment_matrix(tensor_core_reads(x)) for x in (a_hi, a_lo))
        bh = tensor_core_reads(tf32_operand(smem, tf32_k_step_desc(d_tile, b_hi, f), d_tile))
        bl = tensor_core_reads(tf32_operand(smem, tf32_k_step_desc(d_tile, b_lo, f), d_tile))
        out += al @ bh.T + ah @ bl.T + ah @ bh.T
    return out


@mirrors(KERNEL,
         "const int qi = 8 * f + 2 * t + (e & 1), q_row = m0 + qi;",
         "const int key = n0 + 16 * warp + g + 8 * (e >> 1);",
         "const int v = 4 * f + e;")
def element_positions(block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(key row, query) within the block of value v = 4 f + e of each of the 128 threads in the
    element step (P^T, dS^T), as [thread, v] arrays."""
    warp, lane = np.arange(NTHREADS) // 32, np.arange(NTHREADS) % 32
    g, t = lane // 4, lane % 4
    keys = np.zeros((NTHREADS, block_m // 2), int)
    queries = np.zeros_like(keys)
    for f in range(block_m // 8):
        for e in range(4):
            keys[:, 4 * f + e] = 16 * warp + g + 8 * (e >> 1)
            queries[:, 4 * f + e] = 8 * f + 2 * t + (e & 1)
    return keys, queries


@mirrors(KERNEL,
         "const int key = n0 + 16 * warp + g + 8 * h;",
         "const int col = 8 * j + 2 * t;",
         "make_float2(dk_acc[4 * j + 2 * h] * scale, dk_acc[4 * j + 2 * h + 1] * scale);")
def epilogue_rows(acc_flat: np.ndarray, d_tile: int) -> np.ndarray:
    """The 64 x d_tile block the epilogue stores from acc_flat[thread, 4 j + 2 h + e]."""
    out = np.full((BLOCK_N, d_tile), np.nan)
    warp, lane = np.arange(NTHREADS) // 32, np.arange(NTHREADS) % 32
    g, t = lane // 4, lane % 4
    for h in range(2):
        key = 16 * warp + g + 8 * h
        for j in range(d_tile // 8):
            col = 8 * j + 2 * t
            out[key, col] = acc_flat[:, 4 * j + 2 * h]
            out[key, col + 1] = acc_flat[:, 4 * j + 2 * h + 1]
    return out


__all__ = ["KERNEL", "BLOCK_N", "backward_smem", "load_tiles", "rows_times_rows", "acc_times_tile",
           "element_positions", "epilogue_rows", "ROW_LO", "THREAD_IN_GROUP", "acc_from_matrix"]
