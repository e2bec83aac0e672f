"""Model of kernels_cu/flash_bwd_wgmma_dsplit.cu: two warpgroups splitting the head dimension, P^T
and dS^T exchanged through shared memory, one key block emulated product by product."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from .flash_bwd_wgmma import ds_transposed, p_transposed, red_add_pairs
from .mirrors import mirrors
from .mma_bwd import stage_acc, store_tile
from .smem import RAW_SMEM, aligned_base, ld_shared_b32, new_smem, st_shared_b32
from .wgmma import ROW_LO, THREAD_IN_GROUP, Step, cp_async_panels, panel_offset, smem_desc, wgmma

DSPLIT = "flash_bwd_wgmma_dsplit"  # the kernel (models.mirrors finds its file)



@mirrors(DSPLIT,
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;",
         "static constexpr u32 KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128;",
         "static constexpr u32 K = 0;",
         "static constexpr u32 V = K + KV_TILE;",
         "static constexpr u32 Q = V + KV_TILE;",
         "static constexpr u32 DO = Q + 2 * Q_TILE;",
         "static constexpr u32 PT = DO + 2 * Q_TILE;",
         "static constexpr u32 DST = PT + BLOCK_N * BLOCK_M * 2;",
         "static constexpr u32 LSE = DST + BLOCK_N * BLOCK_M * 2;",
         "static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;",
         "static constexpr u32 BYTES = DELTA + 2 * BLOCK_M * 4;",
         "constexpr int NTHREADS = 256, NWARPS = 8;",
         "constexpr int HALF = D_TILE / 2;",
         "constexpr int SJ = BLOCK_M / 8;",
         "constexpr int HJ = HALF / 8;",
         "static_assert(BLOCK_N == 64 && BLOCK_M == 64, \"one 64-row wgmma per product and warpgroup\");",
         "static_assert(D_TILE == 256, \"the head-dim halves are 128 columns: two panels\");")
def dsplit_smem(d_tile: int, block_m: int, block_n: int) -> SimpleNamespace:
    assert block_m == block_n == 64 and d_tile == 256
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, BLOCK_N=block_n, KV_TILE=block_n * d_tile * 2,
                        Q_TILE=block_m * d_tile * 2, KV_PANEL=block_n * 128, Q_PANEL=block_m * 128, K=0)
    L.V = L.K + L.KV_TILE
    L.Q = L.V + L.KV_TILE
    L.DO = L.Q + 2 * L.Q_TILE
    L.PT = L.DO + 2 * L.Q_TILE
    L.DST = L.PT + block_n * block_m * 2
    L.LSE = L.DST + block_n * block_m * 2
    L.DELTA = L.LSE + 2 * block_m * 4
    L.BYTES = L.DELTA + 2 * block_m * 4
    L.NWG, L.NTHREADS, L.HALF = 2, 256, d_tile // 2
    return L


@mirrors(DSPLIT,
         "const u32 s_k = base + L::K, s_v = base + L::V, s_pt = base + L::PT, s_dst = base + L::DST;",
         "const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;",
         # the copies: wgmma_bwd.cuh's, mirrored once (models.flash_bwd_wgmma.bwd_tiles)
         "key_block.load_key_block_and_first(p, seq, s_k, s_v, args, tid, load_query_block);")
def dsplit_tiles(L, stage: int) -> SimpleNamespace:
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(k=base + L.K, v=base + L.V, pt=base + L.PT, dst=base + L.DST,
                           q=base + L.Q + stage * L.Q_TILE, do=base + L.DO + stage * L.Q_TILE)


@mirrors(DSPLIT,
         "const u32 a_tile = wg == 0 ? s_k : s_v, b_tile = wg == 0 ? s_q : s_do;",
         "Wgmma<T, BLOCK_M>::template ss<0, 0>( reinterpret_cast<float(&)[SJ * 4]>(acc),"
         " smem_desc(a_tile + (kk / 4) * L::KV_PANEL + (kk % 4) * 32, 16, 1024),"
         " smem_desc(b_tile + (kk / 4) * L::Q_PANEL + (kk % 4) * 32, 16, 1024), kk > 0);")
def dsplit_step1(L, tiles, wg: int) -> list[Step]:
    """Warpgroup 0: S^T = K Q^T; warpgroup 1: dP^T = V dO^T (all 64 keys, K-major operands)."""
    a_tile, b_tile = (tiles.k, tiles.q) if wg == 0 else (tiles.v, tiles.do)
    return [Step(smem_desc(a_tile + (kk // 4) * L.KV_PANEL + (kk % 4) * 32, 16, 1024), 0,
                 smem_desc(b_tile + (kk // 4) * L.Q_PANEL + (kk % 4) * 32, 16, 1024), 0)
            for kk in range(L.D_TILE // 16)]


@mirrors(DSPLIT,
         "Wgmma<T, HALF>::template ss<0, 1>(reinterpret_cast<float(&)[HJ * 4]>(dv_acc),"
         " smem_desc(s_pt + kk * 32, 16, 1024),"
         " smem_desc(s_do + 2 * wg * L::Q_PANEL + kk * 2048, L::Q_PANEL, 1024), 1);",
         "Wgmma<T, HALF>::template ss<0, 1>(reinterpret_cast<float(&)[HJ * 4]>(dk_acc),"
         " smem_desc(s_dst + kk * 32, 16, 1024),"
         " smem_desc(s_q + 2 * wg * L::Q_PANEL + kk * 2048, L::Q_PANEL, 1024), 1);")
def dsplit_dkdv_steps(L, keys_by_queries_tile: int, query_tile: int, wg: int) -> list[Step]:
    """dV_g += P^T dO_g (P^T tile, dO) or dK_g += dS^T Q_g (dS^T tile, Q): A K-major from shared
    memory (a 16-query k-step is 32 bytes into the one panel), B = head-dim half wg (two
    panels: 2 wg Q_PANEL in, LBO one panel), MN-major."""
    return [Step(smem_desc(keys_by_queries_tile + kk * 32, 16, 1024), 0,
                 smem_desc(query_tile + 2 * wg * L.Q_PANEL + kk * 2048, L.Q_PANEL, 1024), 1)
            for kk in range(L.BLOCK_M // 16)]


@mirrors(DSPLIT,
         "Wgmma<T, HALF>::template ss<1, 1>(reinterpret_cast<float(&)[HJ * 4]>(dq_acc),"
         " smem_desc(s_dst + kk * 2048, L::KV_PANEL, 1024),"
         " smem_desc(s_k + 2 * wg * L::KV_PANEL + kk * 2048, L::KV_PANEL, 1024), kk > 0);")
def dsplit_dq_steps(L, tiles, wg: int) -> list[Step]:
    """dQ_g = dS K_g: A = the MN-major view of dS^T, B = K head-dim half wg, MN-major."""
    return [Step(smem_desc(tiles.dst + kk * 2048, L.KV_PANEL, 1024), 1,
                 smem_desc(tiles.k + 2 * wg * L.KV_PANEL + kk * 2048, L.KV_PANEL, 1024), 1)
            for kk in range(L.BLOCK_N // 16)]


@mirrors(DSPLIT,
         "const int key_row = 16 * warp_in_wg + lane / 4;",
         "return tile + panel_offset<BLOCK_N>(key_row + 8 * h, j) + 4 * (lane % 4);",
         "st_shared_b32(pair_addr(s_pt, j, 0), pack2<T>(acc[j][0], acc[j][1]));",
         "st_shared_b32(pair_addr(s_pt, j, 1), pack2<T>(acc[j][2], acc[j][3]));",
         "asm volatile(\"ld.shared.b32 %0, [%1];\\n\" : \"=r\"(p2[0]) : \"r\"(pair_addr(s_pt, j, 0)));",
         "asm volatile(\"ld.shared.b32 %0, [%1];\\n\" : \"=r\"(p2[1]) : \"r\"(pair_addr(s_pt, j, 1)));",
         "st_shared_b32(pair_addr(s_dst, j, 0), pack2<T>(acc[j][0], acc[j][1]));",
         "st_shared_b32(pair_addr(s_dst, j, 1), pack2<T>(acc[j][2], acc[j][3]));",
         "st_shared_b32(pair_addr(s_dst, j, 0), pack2<half_t>(dsds[0], dsds[1]));",
         "st_shared_b32(pair_addr(s_dst, j, 1), pack2<half_t>(dsds[2], dsds[3]));",
         # dropout: the stash words of the same pairs (a kept element's ds'/ds, a dropped one's dS^T)
         "st_shared_b32(pair_addr(s_dst, j, h), stash_pair<T>(stash[2 * h], stash[2 * h + 1], keep[j][2 * h], "
         "keep[j][2 * h + 1]));")
def dsplit_pair_addr(L, tile: int, j: int, h: int) -> np.ndarray:
    """Address of each thread's 16-bit pair of accumulator column block j, row half h (word
    lane % 4 of chunk j of row key_row + 8h) in a [BLOCK_N][BLOCK_M] panel tile. Softcap's
    derivative (float16) passes from warpgroup 0 to 1 at the dS^T pair of the same element, which
    thread t + 128 reads and then overwrites with dS^T."""
    return tile + panel_offset(L.BLOCK_N, ROW_LO + 8 * h, j) + 4 * THREAD_IN_GROUP


@mirrors(DSPLIT,
         "const int m_lo = m0 + 16 * warp_in_wg + lane / 4, m_hi = m_lo + 8;",
         "const int col = HALF * wg + 8 * j + 2 * (lane % 4);")
def dsplit_add_dq(dq_accum, dq_acc, m0: int, wg: int, L, headdim: int) -> None:
    m_lo = m0 + ROW_LO
    for j in range(L.HALF // 8):
        col = L.HALF * wg + 8 * j + 2 * THREAD_IN_GROUP
        red_add_pairs(dq_accum, m_lo, col, dq_acc[:, j, 0:2], headdim)
        red_add_pairs(dq_accum, m_lo + 8, col, dq_acc[:, j, 2:4], headdim)


def dsplit_emulated(q, k, v, do, lse, delta, L, headdim: int, scale: float):
    """One CTA of flash_bwd_wgmma_dsplit (key block 0, non-causal, full query blocks)."""
    assert q.shape[0] % L.BLOCK_M == 0 and k.shape[0] == L.BLOCK_N
    seqlen_q = q.shape[0]
    scale_log2 = scale * math.log2(math.e)
    smem = new_smem()
    tiles0 = dsplit_tiles(L, 0)
    cp_async_panels(smem, tiles0.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, k, L.BLOCK_N, headdim)
    cp_async_panels(smem, tiles0.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, v, L.BLOCK_N, headdim)
    dk_acc = [np.zeros((128, L.HALF // 8, 4)) for _ in range(2)]
    dv_acc = [np.zeros((128, L.HALF // 8, 4)) for _ in range(2)]
    dq_accum = np.zeros((seqlen_q, headdim))
    sj = L.BLOCK_M // 8
    for it in range(seqlen_q // L.BLOCK_M):
        stage, m0 = it & 1, it * L.BLOCK_M
        tiles = dsplit_tiles(L, stage)
        cp_async_panels(smem, tiles.q, L.BLOCK_M, L.D_TILE, L.NTHREADS, q[m0:], seqlen_q - m0, headdim)
        cp_async_panels(smem, tiles.do, L.BLOCK_M, L.D_TILE, L.NTHREADS, do[m0:], seqlen_q - m0, headdim)
        s_lse, s_delta = lse[m0: m0 + L.BLOCK_M], delta[m0: m0 + L.BLOCK_M]
        acc = [np.empty((128, sj, 4)) for _ in range(2)]  # wg 0: S^T, wg 1: dP^T
        for wg in range(2):
            for kk, step in enumerate(dsplit_step1(L, tiles, wg)):
                wgmma(acc[wg], smem, step, accumulate=kk > 0)
        p_t = p_transposed(acc[0], s_lse, scale_log2)  # step 2, warpgroup 0
        for j in range(sj):
            st_shared_b32(smem, dsplit_pair_addr(L, tiles.pt, j, 0), p_t[:, j, 0:2])
            st_shared_b32(smem, dsplit_pair_addr(L, tiles.pt, j, 1), p_t[:, j, 2:4])
        # __syncthreads: P^T complete; step 3
        for wg in range(2):
            for step in dsplit_dkdv_steps(L, tiles.pt, tiles.do, wg):
                wgmma(dv_acc[wg], smem, step, accumulate=True)
        p16 = np.empty((128, sj, 4))  # step 4, warpgroup 1
        for j in range(sj):
            pairs = [ld_shared_b32(smem, dsplit_pair_addr(L, tiles.pt, j, h)) for h in range(2)]
            p16[:, j] = np.concatenate(pairs, axis=1)  # {lo.x, lo.y, hi.x, hi.y}
        ds_t = ds_transposed(acc[1], p16, s_delta)
        for j in range(sj):
            st_shared_b32(smem, dsplit_pair_addr(L, tiles.dst, j, 0), ds_t[:, j, 0:2])
            st_shared_b32(smem, dsplit_pair_addr(L, tiles.dst, j, 1), ds_t[:, j, 2:4])
        # __syncthreads: dS^T complete; steps 5 and 6
        for wg in range(2):
            for step in dsplit_dkdv_steps(L, tiles.dst, tiles.q, wg):
                wgmma(dk_acc[wg], smem, step, accumulate=True)
            dq_acc = np.empty((128, L.HALF // 8, 4))
            for kk, step in enumerate(dsplit_dq_steps(L, tiles, wg)):
                wgmma(dq_acc, smem, step, accumulate=kk > 0)
            dsplit_add_dq(dq_accum, dq_acc, m0, wg, L, headdim)
    # the epilogue: each warp's 16 rows of its warpgroup's head-dim half staged into the K and V
    # tiles (row-major, swizzled), then 16-byte row stores (the mma.sync kernels' stage_acc and
    # store_key_block_grads)
    for wg in range(2):
        for w in range(4):
            lanes = slice(32 * w, 32 * w + 32)
            stage_acc(smem, tiles0.k, L.D_TILE, 16 * w, L.HALF * wg, dk_acc[wg][lanes], scale)
            stage_acc(smem, tiles0.v, L.D_TILE, 16 * w, L.HALF * wg, dv_acc[wg][lanes], 1.0)
    dk, dv = np.full((L.BLOCK_N, headdim), np.nan), np.full((L.BLOCK_N, headdim), np.nan)
    store_tile(dk, smem, tiles0.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, L.BLOCK_N, headdim)
    store_tile(dv, smem, tiles0.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, L.BLOCK_N, headdim)
    return dk, dv, dq_accum


mirrors(DSPLIT,
        "stage_acc<T, HALF, D_TILE>(s_k, 16 * warp_in_wg, HALF * wg, dk_acc, args.scale, lane);",
        "stage_acc<T, HALF, D_TILE>(s_v, 16 * warp_in_wg, HALF * wg, dv_acc, drop_scale, lane);",
        "store_key_block_grads<T, BLOCK_N, D_TILE, NTHREADS>(p.dk, p.dv, s_k, s_v, seq, key_block.head_kv,"
        " key_block.n0, seq.seqlen_k, args.headdim, args.headdim_v, tid);",
        "const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + 8 * j + 2 * (lane % 4));",
        "const float p_ij = recomputed_p(score, acc[j][e], score_origin, 8 * j + (e & 1), 8 * (e >> 1), Mask::Score::HAS_GRAD ? dsds[e] : no_grad, args.scale_log2, base_log2[e & 1]);",  # the score policy's P of S (the identity's, in the plain kernels modelled here)
        "const float2 d2 = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * (lane % 4));",
        "const float2 lo = unpack2<T>(p2[0]), hi = unpack2<T>(p2[1]);",
        "acc[j][e] = p16[e] == 0.f ? 0.f : p16[e] * (acc[j][e] - ((e & 1) ? d2.y : d2.x));")(dsplit_emulated)



mirrors(DSPLIT, "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);")(aligned_base)


DSPLIT_CONFIG = (256, 64, 64)  # (D_TILE, BLOCK_M, BLOCK_N)
