"""Model of kernels_cu/flash_bwd_dkdv_tf32_wgmma.cu (perf log tf32-wgmma-bwd-v0): its shared-memory
layout, the tiles its loaders fill (wgmma_tf32.cuh's loaders, models/wgmma_tf32.py), the operands
each product reads (models/wgmma_tf32_bwd_steps.py emulates them), and the (key, query) of each
value of its element step and epilogue.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .wgmma import acc_from_matrix
from .wgmma_tf32_bwd_steps import STEPS, acc_times_tile, accumulator_positions, rows_times_rows, split_into

KERNEL = "flash_bwd_dkdv_tf32_wgmma"
BLOCK_N = 64
CTA_ROWS = BLOCK_N  # the rows a CTA keeps (models/wgmma_tf32_bwd_steps.py emulate)
STAT_SLOTS = 4  # dmma_bwd_steps.cuh's StatSlot: lse, delta, weight, dp_ref


@mirrors(KERNEL,
         "static constexpr int BLOCK_N = 64, STAT_RING = RAW_STAGES + 1;",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4, Q_TILE = BLOCK_M * D_TILE * 4;",
         "static constexpr u32 K_HI = 0, K_LO = K_HI + KV_TILE, V_HI = K_LO + KV_TILE, V_LO = V_HI + KV_TILE;",
         "static constexpr u32 Q_HI = V_LO + KV_TILE, Q_LO = Q_HI + Q_TILE, DO_HI = Q_LO + Q_TILE, "
         "DO_LO = DO_HI + Q_TILE;",
         "static constexpr u32 QT_HI = DO_LO + Q_TILE, QT_LO = QT_HI + Q_TILE, DOT_HI = QT_LO + Q_TILE, "
         "DOT_LO = DOT_HI + Q_TILE;",
         "static constexpr u32 KT = DOT_LO + Q_TILE;",
         "static constexpr u32 DS = KT + (DQ_ATOMIC ? 2 * KV_TILE : 0u);",
         "static constexpr u32 RAW = DS + (DQ_ATOMIC ? 2 * BLOCK_M * BLOCK_N * 4 : 0u);",
         "static constexpr u32 STATS = RAW + RAW_STAGES * 2 * Q_TILE;",
         "static constexpr u32 BYTES = STATS + STAT_RING * STAT_SLOTS * BLOCK_M * 4;",
         "constexpr int BLOCK_N = L::BLOCK_N, NTHREADS = 128;",
         "constexpr int SV = BLOCK_M / 2;",
         "constexpr int DV = D_TILE / 2;",
         "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);",
         "const Tf32RawStages<BLOCK_M, D_TILE, NTHREADS, RAW_STAGES> stages{base + L::RAW};",
         "const u32 dst = base + L::STATS + ((it % L::STAT_RING) * STAT_SLOTS * BLOCK_M + tid) * 4;")
def backward_smem(d_tile: int, block_m: int, raw_stages: int, dq_atomic: bool = False) -> dict:
    """BwdTf32WgmmaSmem's offsets in bytes from the aligned base (KT_HI / KT_LO, DS_HI / DS_LO: the
    fused dQ's tiles, DQ_ATOMIC)."""
    kv_tile, q_tile = BLOCK_N * d_tile * 4, block_m * d_tile * 4
    layout = {"STAT_RING": raw_stages + 1, "KV_TILE": kv_tile, "Q_TILE": q_tile, "K_HI": 0}
    for name, after, size in (("K_LO", "K_HI", kv_tile), ("V_HI", "K_LO", kv_tile), ("V_LO", "V_HI", kv_tile),
                              ("Q_HI", "V_LO", kv_tile), ("Q_LO", "Q_HI", q_tile), ("DO_HI", "Q_LO", q_tile),
                              ("DO_LO", "DO_HI", q_tile), ("QT_HI", "DO_LO", q_tile), ("QT_LO", "QT_HI", q_tile),
                              ("DOT_HI", "QT_LO", q_tile), ("DOT_LO", "DOT_HI", q_tile), ("KT", "DOT_LO", q_tile)):
        layout[name] = layout[after] + size
    layout["DS"] = layout["KT"] + (2 * kv_tile if dq_atomic else 0)
    layout["RAW"] = layout["DS"] + (2 * block_m * BLOCK_N * 4 if dq_atomic else 0)
    layout["STATS"] = layout["RAW"] + raw_stages * 2 * q_tile
    layout["BYTES"] = layout["STATS"] + layout["STAT_RING"] * STAT_SLOTS * block_m * 4
    layout.update(KT_HI=layout["KT"], KT_LO=layout["KT"] + kv_tile, DS_HI=layout["DS"],
                  DS_LO=layout["DS"] + block_m * BLOCK_N * 4)
    return layout


def load_tiles(d_tile: int, block_m: int, k, v, q, do, keys_valid: int, queries_valid: int, headdim: int,
               headdim_v: int) -> np.ndarray:
    """Shared memory after the kernel's split of K and V and of one query block's Q and dO, both
    ways (split_tf32_panels_both)."""
    return split_into(backward_smem(d_tile, block_m, 0), d_tile, [
        ("K", BLOCK_N, keys_valid, headdim, k, False), ("V", BLOCK_N, keys_valid, headdim_v, v, False),
        ("Q", block_m, queries_valid, headdim, q, False), ("QT", block_m, queries_valid, headdim, q, True),
        ("DO", block_m, queries_valid, headdim_v, do, False), ("DOT", block_m, queries_valid, headdim_v, do, True)])


@mirrors(KERNEL,
         "dk_acc, dv_acc, ds, Tf32DkdvTiles{base + L::K_HI, base + L::V_HI, base + L::Q_HI, base + L::DO_HI,",
         "base + L::QT_HI, base + L::DOT_HI},")
@mirrors(STEPS,
         "s, ds, Tf32RowsTimesRows<BLOCK_N, BLOCK_M, PRODUCTS>{tiles.k, tiles.k + KV_TILE, tiles.q, tiles.q + Q_TILE},",
         "{tiles.v, tiles.v + KV_TILE, tiles.dout, tiles.dout + Q_TILE});",
         "tf32_acc_times_tile<D_TILE, BLOCK_M / 8, PRODUCTS, SUMS_APART>(dv_acc, s, tiles.dot, tiles.dot + Q_TILE,",
         "tf32_acc_times_tile<D_TILE, BLOCK_M / 8, PRODUCTS, SUMS_APART>(dk_acc, ds, tiles.qt, tiles.qt + Q_TILE,",
         "constexpr int BLOCK_N = 64;")
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
         "split_tf32_panels_transposed<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(base + L::KT, base + L::KT + L::KV_TILE,",
         "const int query = 8 * f + 2 * t + (e & 1), key = 16 * warp + g + 8 * (e >> 1);",
         "const u32 at = panel_offset<BLOCK_M>(query, key >> 2) + 4 * (key & 3);",
         "st_shared_b32(base + L::DS + at, hi);",
         "st_shared_b32(base + L::DS + BLOCK_M * BLOCK_N * 4 + at, lo);",
         "Tf32RowsTimesRows<D_TILE, BLOCK_M, PRODUCTS>{base + L::KT, base + L::KT + L::KV_TILE, base + L::DS,",
         "base + L::DS + BLOCK_M * BLOCK_N * 4},",
         "const int column = 16 * warp + g + 8 * (e >> 1), query = m0 + 8 * f + 2 * t + (e & 1);",
         "atomicAdd(p.dq.row<float>(batch, seq.q_begin + query, head) + column, dq_t[4 * f + e] * scale);")
def fused_dq(k: np.ndarray, ds_t: np.ndarray, keys_valid: int, headdim: int, block_m: int) -> np.ndarray:
    """DQ_ATOMIC's product for one query block, block_m x 64 as the atomics add it (before the
    scale): K^T split without KEY_PAIRS (dQ^T's A from shared memory), dS^T's accumulator values
    stored at [query][key] hi and lo, then dQ^T = K^T dS^T (Tf32RowsTimesRows<D_TILE, BLOCK_M>),
    value 4 f + e of dQ^T's accumulator added at (query 8 f + 2 t + e % 2, column 16 warp + g +
    8 (e / 2)): the accumulator's own (row, column) transposed."""
    from .tf32 import split_tf32
    from .wgmma import panel_offset
    from .wgmma_tf32 import split_tf32_panels_transposed as transposed

    L = backward_smem(64, block_m, 0, dq_atomic=True)
    smem = np.full(L["BYTES"] // 4, 0xFFFFFFFF, np.uint32)
    transposed(3, smem, smem, L["KT_HI"], L["KT_LO"], BLOCK_N, 64, 128, k, keys_valid, headdim)
    acc = acc_from_matrix(ds_t).reshape(128, -1)  # [thread, 4 f + e]
    keys, queries = accumulator_positions(block_m)
    hi, lo = split_tf32(3, acc.astype(np.float32))
    at = panel_offset(block_m, queries, keys >> 2) + 4 * (keys & 3)
    smem[(L["DS_HI"] + at) // 4] = hi
    smem[(L["DS_LO"] + at) // 4] = lo
    dq_t = rows_times_rows(smem, BLOCK_N, 64, block_m, L["KT_HI"], L["KT_LO"], L["DS_HI"], L["DS_LO"])
    dq = np.zeros((block_m, 64))
    dims, dq_queries = accumulator_positions(block_m)  # dQ^T's (head-dim row, query column) of each value
    dq[dq_queries, dims] = acc_from_matrix(dq_t).reshape(128, -1)
    return dq


@mirrors(STEPS,
         "const int qi = 8 * (f0 + f) + 2 * t + (e & 1), q_row = m0 + qi;",
         "const int key = n0 + 16 * warp + g + 8 * (e >> 1);",
         "const int v = 4 * f + e;")
@mirrors(KERNEL,
         "store_acc_rows_f32<D_TILE>(dk_acc, scale, keys_valid, p.headdim,",
         "store_acc_rows_f32<D_TILE>(dv_acc, drop_scale, keys_valid, p.headdim_v,",
         "[&](int r) { return p.dk.row<float>(batch, seq.k_begin + n0 + r, head_kv); }, warp, lane);",
         "[&](int r) { return p.dv.row<float>(batch, seq.k_begin + n0 + r, head_kv); }, warp, lane);")
def element_positions(block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(key row, query) within the block of value v = 4 f + e of each of the 128 threads in the
    element step (P^T, dS^T), as [thread, v] arrays: S^T's accumulator, keys as its rows; the
    epilogue stores dK and dV from the same layout (store_acc_rows_f32, whose model is the steps').
    (f0 is 0 for a whole block; the pair kernel's warpgroups step half the column blocks each, f0
    their first, with the values of that half.)"""
    return accumulator_positions(block_m)


__all__ = ["KERNEL", "BLOCK_N", "backward_smem", "CTA_ROWS", "load_tiles", "products", "element_positions",
           "acc_from_matrix"]
