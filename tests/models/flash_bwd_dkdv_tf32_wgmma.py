"""Model of kernels_cu/flash_bwd_dkdv_tf32_wgmma.cu (perf log tf32-wgmma-bwd-v0): its shared-memory
layout, the tiles its loaders fill (wgmma_tf32.cuh's loaders, models/wgmma_tf32.py), the operands
each product reads (models/wgmma_tf32_bwd_steps.py emulates them), the (key, query) of each value
of its element step, and where the epilogue stores each accumulator value.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .wgmma import acc_from_matrix
from .wgmma_tf32 import split_tf32_panels, split_tf32_panels_transposed
from .wgmma_tf32_bwd_steps import acc_times_tile, rows_times_rows, store_acc_rows

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
         "s, RowsTimesRows{base + L::K_HI, base + L::K_LO, base + L::Q_HI, base + L::Q_LO}, NoTurns());",
         "dp, RowsTimesRows{base + L::V_HI, base + L::V_LO, base + L::DO_HI, base + L::DO_LO}, NoTurns());",
         "tf32_acc_times_tile<D_TILE, BLOCK_M / 8, PRODUCTS, SUMS_APART>(dv_acc, s, base + L::DOT_HI, base + L::DOT_LO,",
         "tf32_acc_times_tile<D_TILE, BLOCK_M / 8, PRODUCTS, SUMS_APART>(dk_acc, dp, base + L::QT_HI, base + L::QT_LO,")
def products(smem, d_tile: int, block_m: int) -> dict:
    """The kernel's four products on one query block's tiles: S^T = K Q^T and dP^T = V dO^T
    (Tf32RowsTimesRows<BLOCK_N, BLOCK_M>), then dV and dK from them as the accumulators they are
    (any matrices serve: S^T and dP^T rounded to float32 stand for P^T and dS^T)."""
    L = backward_smem(d_tile, block_m, 0)
    st = rows_times_rows(smem, d_tile, BLOCK_N, block_m, L["K_HI"], L["K_LO"], L["Q_HI"], L["Q_LO"])
    dpt = rows_times_rows(smem, d_tile, BLOCK_N, block_m, L["V_HI"], L["V_LO"], L["DO_HI"], L["DO_LO"])
    p_t, ds_t = (x.astype(np.float32).astype(np.float64) for x in (st, dpt))
    dv = acc_times_tile(smem, d_tile, block_m, acc_from_matrix(p_t), L["DOT_HI"], L["DOT_LO"])
    dk = acc_times_tile(smem, d_tile, block_m, acc_from_matrix(ds_t), L["QT_HI"], L["QT_LO"])
    return {"st": st, "dpt": dpt, "p_t": p_t, "ds_t": ds_t, "dv": dv, "dk": dk}


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
         "store_acc_rows_f32<D_TILE>(dk_acc, scale, keys_valid, p.headdim,",
         "store_acc_rows_f32<D_TILE>(dv_acc, drop_scale, keys_valid, p.headdim_v,",
         "[&](int r) { return p.dk.row<float>(batch, seq.k_begin + n0 + r, head_kv); }, warp, lane);",
         "[&](int r) { return p.dv.row<float>(batch, seq.k_begin + n0 + r, head_kv); }, warp, lane);")
def epilogue_rows(acc_flat: np.ndarray, d_tile: int) -> np.ndarray:
    """dK's (and dV's) 64 x d_tile block of keys n0 .. n0 + 63, as store_acc_rows_f32 stores it."""
    return store_acc_rows(acc_flat, d_tile)


__all__ = ["KERNEL", "BLOCK_N", "backward_smem", "load_tiles", "products", "element_positions", "epilogue_rows",
           "acc_from_matrix"]
