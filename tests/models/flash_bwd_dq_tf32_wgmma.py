"""Model of kernels_cu/flash_bwd_dq_tf32_wgmma.cu (perf log tf32-wgmma-bwd-v0): its shared-memory
layout, the tiles its loaders fill (models/wgmma_tf32.py), its three products on one key block
(models/wgmma_tf32_bwd_steps.py emulates them), and the (query row, key) of each value of its
element step and epilogue.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .wgmma import acc_from_matrix
from .wgmma_tf32_bwd_steps import acc_times_tile, accumulator_positions, rows_times_rows, split_into

KERNEL = "flash_bwd_dq_tf32_wgmma"
BLOCK_M = 64
CTA_ROWS = BLOCK_M  # the rows a CTA keeps (models/wgmma_tf32_bwd_steps.py emulate)


@mirrors(KERNEL,
         "static constexpr int BLOCK_M = 64;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4, KV_TILE = BLOCK_N * D_TILE * 4;",
         "static constexpr u32 Q_HI = 0, Q_LO = Q_HI + Q_TILE, DO_HI = Q_LO + Q_TILE, DO_LO = DO_HI + Q_TILE;",
         "static constexpr u32 K_HI = DO_LO + Q_TILE, K_LO = K_HI + KV_TILE, V_HI = K_LO + KV_TILE, "
         "V_LO = V_HI + KV_TILE;",
         "static constexpr u32 KT_HI = V_LO + KV_TILE, KT_LO = KT_HI + KV_TILE;",
         "static constexpr u32 RAW = KT_LO + KV_TILE;",
         "static constexpr u32 BYTES = RAW + RAW_STAGES * 2 * KV_TILE;",
         "constexpr int BLOCK_M = L::BLOCK_M, NTHREADS = 128;",
         "constexpr int SV = BLOCK_N / 2;",
         "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);",
         "const Tf32KeyBlocks<BLOCK_N, BLOCK_M, D_TILE, NTHREADS, RAW_STAGES> blocks(p, seq, mask, head_kv, m0, "
         "base + L::RAW, tid);")
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
    """Shared memory after the kernel's split of Q and dO and of one key block's K (both ways:
    split_tf32_panels_both) and V."""
    return split_into(dq_smem(d_tile, block_n, 0), d_tile, [
        ("Q", BLOCK_M, queries_valid, headdim, q, False), ("DO", BLOCK_M, queries_valid, headdim_v, do, False),
        ("K", block_n, keys_valid, headdim, k, False), ("KT", block_n, keys_valid, headdim, k, True),
        ("V", block_n, keys_valid, headdim_v, v, False)])


@mirrors(KERNEL,
         "Tf32RowsTimesRows<BLOCK_M, BLOCK_N, PRODUCTS>{base + L::Q_HI, base + L::Q_LO, base + L::K_HI,"
         " base + L::K_LO},",
         "{base + L::DO_HI, base + L::DO_LO, base + L::V_HI, base + L::V_LO});",
         "tf32_acc_times_tile<D_TILE, BLOCK_N / 8, PRODUCTS, SUMS_APART>(dq_acc, s, base + L::KT_HI, base + L::KT_LO,")
def products(smem, d_tile: int, block_n: int) -> dict:
    """S = Q K^T and dP = dO V^T (Tf32RowsTimesRows<BLOCK_M, BLOCK_N>), then dQ from the
    accumulator (S rounded to float32 stands for dS)."""
    return products_at(smem, d_tile, block_n, dq_smem(d_tile, block_n, 0))


def products_at(smem, d_tile: int, block_n: int, L: dict) -> dict:
    """products() on the tiles at layout L's offsets (Q_HI .. KT_LO): the dQ kernels' three
    products wherever a kernel keeps its tiles (its producer form: in stages)."""
    s = rows_times_rows(smem, d_tile, BLOCK_M, block_n, L["Q_HI"], L["Q_LO"], L["K_HI"], L["K_LO"])
    dp = rows_times_rows(smem, d_tile, BLOCK_M, block_n, L["DO_HI"], L["DO_LO"], L["V_HI"], L["V_LO"])
    ds = s.astype(np.float32).astype(np.float64)
    dq = acc_times_tile(smem, d_tile, block_n, acc_from_matrix(ds), L["KT_HI"], L["KT_LO"])
    return {"s": s, "dp": dp, "ds": ds, "dq": dq}


@mirrors(KERNEL,
         "q_row[h] = m0 + 16 * warp + g + 8 * h;",
         "const int h = e >> 1, key = n0 + 8 * (f0 + f) + 2 * t + (e & 1), v = 4 * f + e;",
         "store_acc_rows_f32<D_TILE>(dq_acc, scale, seqlen_q - m0, p.headdim,",
         "[&](int r) { return p.dq.row<float>(batch, seq.q_begin + m0 + r, head); }, warp, lane);")
def element_positions(block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(query row, key) within the blocks of value v = 4 f + e of each thread, as [thread, v]: S's
    accumulator, queries as its rows; the epilogue stores dQ from the same layout
    (store_acc_rows_f32, whose model is the steps')."""
    return accumulator_positions(block_n)


__all__ = ["KERNEL", "BLOCK_M", "dq_smem", "CTA_ROWS", "load_tiles", "products", "products_at", "element_positions",
           "acc_from_matrix"]
