"""Model of kernels_cu/flash_bwd_dq_tf32_wgmma.cu (perf log tf32-wgmma-bwd-v0): its shared-memory
layout, the tiles its loaders fill (models/wgmma_tf32.py), its three products on one key block
(models/wgmma_tf32_bwd_steps.py emulates them), the (query row, key) of each value of its element
step, and its epilogue's rows.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .wgmma import acc_from_matrix
from .wgmma_tf32 import split_tf32_panels, split_tf32_panels_transposed
from .wgmma_tf32_bwd_steps import acc_times_tile, rows_times_rows, store_acc_rows

KERNEL = "flash_bwd_dq_tf32_wgmma"
BLOCK_M = 64
NTHREADS = 128


@mirrors(KERNEL,
         "static constexpr int BLOCK_M = 64;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4, KV_TILE = BLOCK_N * D_TILE * 4;",
         "static constexpr u32 Q_HI = 0, Q_LO = Q_HI + Q_TILE, DO_HI = Q_LO + Q_TILE, DO_LO = DO_HI + Q_TILE;",
         "static constexpr u32 K_HI = DO_LO + Q_TILE, K_LO = K_HI + KV_TILE, V_HI = K_LO + KV_TILE, "
         "V_LO = V_HI + KV_TILE;",
         "static constexpr u32 KT_HI = V_LO + KV_TILE, KT_LO = KT_HI + KV_TILE;",
         "static constexpr u32 RAW = KT_LO + KV_TILE;",
         "static constexpr u32 BYTES = RAW + RAW_STAGES * 2 * KV_TILE;",
         "constexpr int BLOCK_M = L::BLOCK_M, NTHREADS = 128, PRODUCTS = 3;",
         "constexpr int SV = BLOCK_N / 2;",
         "constexpr int STAGES = RAW_STAGES > 0 ? RAW_STAGES : 1;",
         "constexpr int K_STEPS = D_TILE / 8;",
         "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);",
         "const u32 raw = base + L::RAW + (j % STAGES) * 2 * L::KV_TILE;")
def dq_smem(d_tile: int, block_n: int, raw_stages: int) -> dict:
    """DqTf32WgmmaSmem's offsets in bytes from the aligned base."""
    q_tile, kv_tile = BLOCK_M * d_tile * 4, block_n * d_tile * 4
    layout = {"Q_TILE": q_tile, "KV_TILE": kv_tile, "Q_HI": 0}
    for name, after, size in (("Q_LO", "Q_HI", q_tile), ("DO_HI", "Q_LO", q_tile), ("DO_LO", "DO_HI", q_tile),
                              ("K_HI", "DO_LO", q_tile), ("K_LO", "K_HI", kv_tile), ("V_HI", "K_LO", kv_tile),
                              ("V_LO", "V_HI", kv_tile), ("KT_HI", "V_LO", kv_tile), ("KT_LO", "KT_HI", kv_tile),
                              ("RAW", "KT_LO", kv_tile)):
        layout[name] = layout[after] + size
    layout["BYTES"] = layout["RAW"] + raw_stages * 2 * kv_tile
    return layout


def load_tiles(d_tile: int, block_n: int, q, do, k, v, queries_valid: int, keys_valid: int, headdim: int,
               headdim_v: int) -> np.ndarray:
    """Shared memory (one uint32 word a slot, from the aligned base) after the split of Q and dO
    and of one key block's K and V (split_key_block), the calls as the kernel makes them."""
    L = dq_smem(d_tile, block_n, 0)
    smem = np.full(L["BYTES"] // 4, 0xFFFFFFFF, np.uint32)
    for tile, rows, rows_valid, dim_valid, x in (("Q", BLOCK_M, queries_valid, headdim, q),
                                                 ("DO", BLOCK_M, queries_valid, headdim_v, do),
                                                 ("K", block_n, keys_valid, headdim, k),
                                                 ("V", block_n, keys_valid, headdim_v, v)):
        split_tf32_panels(3, smem, smem, L[tile + "_HI"], L[tile + "_LO"], rows, d_tile, NTHREADS, x, rows_valid,
                          dim_valid)
    split_tf32_panels_transposed(3, smem, smem, L["KT_HI"], L["KT_LO"], block_n, d_tile, NTHREADS, k, keys_valid,
                                 headdim, key_pairs=True)
    return smem


@mirrors(KERNEL,
         "s, RowsTimesRows{base + L::Q_HI, base + L::Q_LO, base + L::K_HI, base + L::K_LO}, NoTurns());",
         "dp, RowsTimesRows{base + L::DO_HI, base + L::DO_LO, base + L::V_HI, base + L::V_LO}, NoTurns());",
         "tf32_acc_times_tile<D_TILE, BLOCK_N / 8, PRODUCTS, SUMS_APART>(dq_acc, s, base + L::KT_HI, base + L::KT_LO,")
def products(smem, d_tile: int, block_n: int) -> dict:
    """S = Q K^T and dP = dO V^T (Tf32RowsTimesRows<BLOCK_M, BLOCK_N>), then dQ from the
    accumulator (S rounded to float32 stands for dS)."""
    L = dq_smem(d_tile, block_n, 0)
    s = rows_times_rows(smem, d_tile, BLOCK_M, block_n, L["Q_HI"], L["Q_LO"], L["K_HI"], L["K_LO"])
    dp = rows_times_rows(smem, d_tile, BLOCK_M, block_n, L["DO_HI"], L["DO_LO"], L["V_HI"], L["V_LO"])
    ds = s.astype(np.float32).astype(np.float64)
    dq = acc_times_tile(smem, d_tile, block_n, acc_from_matrix(ds), L["KT_HI"], L["KT_LO"])
    return {"s": s, "dp": dp, "ds": ds, "dq": dq}


@mirrors(KERNEL,
         "q_row[h] = m0 + 16 * warp + g + 8 * h;",
         "const int h = e >> 1, key = n0 + 8 * f + 2 * t + (e & 1), v = 4 * f + e;")
def element_positions(block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(query row, key) within the blocks of value v = 4 f + e of each thread, as [thread, v]."""
    warp, lane = np.arange(NTHREADS) // 32, np.arange(NTHREADS) % 32
    g, t = lane // 4, lane % 4
    rows = np.zeros((NTHREADS, block_n // 2), int)
    keys = np.zeros_like(rows)
    for f in range(block_n // 8):
        for e in range(4):
            rows[:, 4 * f + e] = 16 * warp + g + 8 * (e >> 1)
            keys[:, 4 * f + e] = 8 * f + 2 * t + (e & 1)
    return rows, keys


@mirrors(KERNEL,
         "store_acc_rows_f32<D_TILE>(dq_acc, scale, seqlen_q - m0, p.headdim,",
         "[&](int r) { return p.dq.row<float>(batch, seq.q_begin + m0 + r, head); }, warp, lane);")
def epilogue_rows(acc_flat: np.ndarray, d_tile: int) -> np.ndarray:
    """dQ's 64 x d_tile block of rows m0 .. m0 + 63, as store_acc_rows_f32 stores it."""
    return store_acc_rows(acc_flat, d_tile)


__all__ = ["KERNEL", "BLOCK_M", "dq_smem", "load_tiles", "products", "element_positions", "epilogue_rows",
           "acc_from_matrix"]
