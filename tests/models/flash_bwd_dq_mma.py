"""Models of the mma.sync dQ kernels: flash_bwd_dq_mma (one CTA per query block, a warp owns 16
query rows) and flash_bwd_dq_mma_v2 (ROW_GROUPS 16-row query groups per warp, lse and D staged in
shared memory, dP in 16-column slices from head-dim tile 128). A CTA walks the key blocks its rows
see, two K / V stages by absolute key block, and writes dq itself (no adds)."""
from __future__ import annotations

import math

import numpy as np

from .fragments import lse_base_log2, recomputed_p
from .mirrors import mirrors
from .mma import GROUP, THREAD_IN_GROUP, cp_async_tile
from .mma_bwd import (mma_AB_regs, mma_AB_regs_groups, mma_ABt, mma_ABt_groups, pack_a_frags, stage_acc, store_tile,
                      tile_offset)
from .mma_bwd_walks import DQ_KERNELS, block_partial, key_block_range, visible

V1, V2 = DQ_KERNELS

def bwd_dq_layout(d_tile, block_m, block_n):
    """DqSmem<...> of flash_bwd_dq_mma."""
    q_tile, kv_tile = block_m * d_tile * 2, block_n * d_tile * 2
    lay = dict(Q_TILE=q_tile, KV_TILE=kv_tile, Q=0, DO=q_tile, K=2 * q_tile)
    lay["V"] = lay["K"] + 2 * kv_tile
    lay["BYTES"] = lay["V"] + 2 * kv_tile
    return lay


def bwd_dq_layout_v2(d_tile, block_m, block_n):
    """DqSmemV2<...>: v1's tiles, then float lse (log2 units) and D of the block's rows."""
    lay = bwd_dq_layout(d_tile, block_m, block_n)
    lay["LSE"] = lay["BYTES"]
    lay["DELTA"] = lay["LSE"] + block_m * 4
    lay["BYTES"] = lay["DELTA"] + block_m * 4
    return lay


@mirrors(V1,  # MmaQueryCta's (mma_bwd_query_cta.cuh)
         "if (keys.first < keys.end) load_key_block(p, keys.first, keys.first & 1, tid);",
         "if (j + 1 < keys.end) load_key_block(p, j + 1, (j + 1) & 1, tid);")
@mirrors(V2,  # (dq_block_v2 loads K and V as v1 does: the same CTA)
         "if (keys.first < keys.end) load_key_block(p, keys.first, keys.first & 1, tid);",
         "if (j + 1 < keys.end) load_key_block(p, j + 1, (j + 1) & 1, tid);")
def dq_block(q, k, v, do, lse, delta, dq, *, batch, head, m_block, group, scale, mask,
             d_tile, block_m, block_n, nwarps):
    """One CTA of flash_bwd_dq_mma."""
    seqlen_q, headdim = q.shape[1], q.shape[3]
    seqlen_k = k.shape[1]
    nthreads = 32 * nwarps
    assert block_m == 16 * nwarps
    lay = bwd_dq_layout(d_tile, block_m, block_n)
    smem = np.full(lay["BYTES"] // 2, np.nan)
    scale_log2 = scale * math.log2(math.e)
    m0 = m_block * block_m
    head_kv = head // group
    j_begin, j_end = key_block_range(mask, m0, block_m, block_n, seqlen_q, seqlen_k)

    def load_key_block(it, stage):
        n0 = it * block_n
        cp_async_tile(smem, lay["K"] + stage * lay["KV_TILE"], block_n, d_tile, nthreads, k[batch, :, head_kv],
                      n0, seqlen_k - n0, headdim)
        cp_async_tile(smem, lay["V"] + stage * lay["KV_TILE"], block_n, d_tile, nthreads, v[batch, :, head_kv],
                      n0, seqlen_k - n0, headdim)

    cp_async_tile(smem, lay["Q"], block_m, d_tile, nthreads, q[batch, :, head], m0, seqlen_q - m0, headdim)
    cp_async_tile(smem, lay["DO"], block_m, d_tile, nthreads, do[batch, :, head], m0, seqlen_q - m0, headdim)
    if j_begin < j_end:
        load_key_block(j_begin, j_begin & 1)

    warps = range(nwarps)
    stats = []
    for w in warps:
        base, d = [], []
        for half in range(2):
            m = m0 + 16 * w + GROUP + 8 * half
            ok = m < seqlen_q
            base.append(np.where(ok, lse_base_log2(lse[batch, head, np.where(ok, m, 0)]), 0.0))
            d.append(np.where(ok, delta[batch, head, np.where(ok, m, 0)], 0.0))
        stats.append((base, d))
    dq_acc = np.zeros((nwarps, 32, d_tile // 8, 4))

    for it in range(j_begin, j_end):
        stage = it & 1
        if it + 1 < j_end:
            load_key_block(it + 1, stage ^ 1)
        n0 = it * block_n
        s_k, s_v = lay["K"] + stage * lay["KV_TILE"], lay["V"] + stage * lay["KV_TILE"]
        partial = block_partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k, mask)
        for w in warps:
            s_acc = np.zeros((32, block_n // 8, 4))
            dp_acc = np.zeros((32, block_n // 8, 4))
            mma_ABt(s_acc, smem, block_n, d_tile, d_tile, d_tile, lay["Q"], 16 * w, s_k, 0)
            mma_ABt(dp_acc, smem, block_n, d_tile, d_tile, d_tile, lay["DO"], 16 * w, s_v, 0)
            base, d = stats[w]
            for j in range(block_n // 8):
                for e in range(4):
                    p = recomputed_p(s_acc[:, j, e], scale_log2, base[e >> 1])
                    ds = p * (dp_acc[:, j, e] - d[e >> 1])
                    hidden = partial & ~visible(m0 + 16 * w + GROUP + 8 * (e >> 1),
                                                 n0 + 8 * j + 2 * THREAD_IN_GROUP + (e & 1), seqlen_q, seqlen_k, mask)
                    dp_acc[:, j, e] = np.where(hidden, 0.0, ds)
            mma_AB_regs(dq_acc[w], pack_a_frags(dp_acc), smem, d_tile, block_n, d_tile, s_k, 0)

    for w in warps:
        stage_acc(smem, lay["Q"], d_tile, 16 * w, 0, dq_acc[w], scale)
        rows = dq[batch, m0 + 16 * w:, head]
        store_tile(rows, smem, lay["Q"] + tile_offset(d_tile, 16 * w, 0), 16, d_tile, 32,
                       seqlen_q - m0 - 16 * w, headdim)


@mirrors(V2,
         "partial && mask.hidden_left(origin, 16 * g + 8 * (e >> 1), 8 * f + (e & 1));",
         "s_acc[g][f][e] = hidden_left ? 0.f : p;",
         "n_lim[g][half] = m < seqlen_q ? mask.row_key_end(m) : 0;",
         "const bool hidden = partial && (n >= n_lim[g][e >> 1] ||",
         "(Mask::HAS_LEFT && s_acc[g][c0 / 8 + f][e] == 0.f));")
def dq_block_v2(q, k, v, do, lse, delta, dq, *, batch, head, m_block, group, scale, mask,
                d_tile, block_m, block_n, nwarps, row_groups):
    """One CTA of flash_bwd_dq_mma_v2."""
    seqlen_q, headdim = q.shape[1], q.shape[3]
    seqlen_k = k.shape[1]
    nthreads, G = 32 * nwarps, row_groups
    warp_rows = 16 * G
    assert block_m == warp_rows * nwarps
    dp_cols = 16 if d_tile >= 128 else block_n
    lay = bwd_dq_layout_v2(d_tile, block_m, block_n)
    smem = np.full(lay["LSE"] // 2, np.nan)  # 16-bit tiles; the float statistics are s_lse, s_delta
    scale_log2 = scale * math.log2(math.e)
    m0 = m_block * block_m
    head_kv = head // group
    j_begin, j_end = key_block_range(mask, m0, block_m, block_n, seqlen_q, seqlen_k)

    def load_key_block(it, stage):
        n0 = it * block_n
        cp_async_tile(smem, lay["K"] + stage * lay["KV_TILE"], block_n, d_tile, nthreads, k[batch, :, head_kv],
                      n0, seqlen_k - n0, headdim)
        cp_async_tile(smem, lay["V"] + stage * lay["KV_TILE"], block_n, d_tile, nthreads, v[batch, :, head_kv],
                      n0, seqlen_k - n0, headdim)

    cp_async_tile(smem, lay["Q"], block_m, d_tile, nthreads, q[batch, :, head], m0, seqlen_q - m0, headdim)
    cp_async_tile(smem, lay["DO"], block_m, d_tile, nthreads, do[batch, :, head], m0, seqlen_q - m0, headdim)
    if j_begin < j_end:
        load_key_block(j_begin, j_begin & 1)
    s_lse, s_delta = np.full(block_m, np.nan), np.full(block_m, np.nan)
    for r in range(block_m):
        m = m0 + r
        s_lse[r] = lse_base_log2(lse[batch, head, m]) if m < seqlen_q else 0.0
        s_delta[r] = delta[batch, head, m] if m < seqlen_q else 0.0

    dq_acc = np.zeros((nwarps, G, 32, d_tile // 8, 4))
    for it in range(j_begin, j_end):
        stage = it & 1
        if it + 1 < j_end:
            load_key_block(it + 1, stage ^ 1)
        n0 = it * block_n
        s_k, s_v = lay["K"] + stage * lay["KV_TILE"], lay["V"] + stage * lay["KV_TILE"]
        partial = block_partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k, mask)
        for w in range(nwarps):
            row0 = warp_rows * w
            lane_row = row0 + GROUP
            s_acc = np.zeros((G, 32, block_n // 8, 4))
            mma_ABt_groups(s_acc, smem, block_n, d_tile, d_tile, d_tile, lay["Q"], row0, s_k, 0)
            for g in range(G):
                for j in range(block_n // 8):
                    for e in range(4):
                        p = recomputed_p(s_acc[g, :, j, e], scale_log2, s_lse[lane_row + 16 * g + 8 * (e >> 1)])
                        m, n = m0 + lane_row + 16 * g + 8 * (e >> 1), n0 + 8 * j + 2 * THREAD_IN_GROUP + (e & 1)
                        s_acc[g, :, j, e] = np.where(partial & mask.hidden_left(m, n, seqlen_q, seqlen_k), 0.0, p)
            n_lim = np.zeros((G, 2, 32), dtype=np.int64)
            for g in range(G):
                for half in range(2):
                    m = m0 + lane_row + 16 * g + 8 * half
                    n_lim[g, half] = np.where(m < seqlen_q, mask.row_key_end(m, seqlen_q, seqlen_k), 0)
            ds_frag = np.full((G, 32, block_n // 16, 4, 2), np.nan)
            for c0 in range(0, block_n, dp_cols):
                dp_acc = np.zeros((G, 32, dp_cols // 8, 4))
                mma_ABt_groups(dp_acc, smem, dp_cols, d_tile, d_tile, d_tile, lay["DO"], row0,
                                   s_v + c0 * d_tile * 2, 0)
                for g in range(G):
                    for j in range(dp_cols // 8):
                        for e in range(4):
                            ds = s_acc[g, :, c0 // 8 + j, e] * (dp_acc[g, :, j, e]
                                                                 - s_delta[lane_row + 16 * g + 8 * (e >> 1)])
                            n = n0 + c0 + 8 * j + 2 * THREAD_IN_GROUP + (e & 1)
                            hidden = partial & ((n >= n_lim[g, e >> 1]) |
                                                (mask.HAS_LEFT & (s_acc[g, :, c0 // 8 + j, e] == 0.0)))
                            dp_acc[g, :, j, e] = np.where(hidden, 0.0, ds)
                    ds_frag[g, :, c0 // 16: (c0 + dp_cols) // 16] = pack_a_frags(dp_acc[g])
            mma_AB_regs_groups(dq_acc[w], ds_frag, smem, d_tile, block_n, d_tile, s_k, 0)

    for w in range(nwarps):
        row0 = warp_rows * w
        for g in range(G):
            stage_acc(smem, lay["Q"], d_tile, row0 + 16 * g, 0, dq_acc[w, g], scale)
        rows = dq[batch, m0 + row0:, head]
        store_tile(rows, smem, lay["Q"] + tile_offset(d_tile, row0, 0), warp_rows, d_tile, 32,
                       seqlen_q - m0 - row0, headdim)
