"""Model of kernels_cu/flash_bwd_wgmma.cu: tiles and stages, the descriptors of S^T, dP^T, dV, dK
and dQ, the P^T / dS^T fragment stores, the dQ staging and one key block emulated product by
product."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from .fragments import lse_base_log2, pack_a_frags, recomputed_p
from .mirrors import mirrors
from .mma_bwd import stage_acc, store_tile
from .smem import RAW_SMEM, aligned_base, new_smem, st_shared_b32
from .wgmma import (LANE, ROW_LO, THREAD_IN_GROUP, WARP_IN_WG, Step, cp_async_panels, panel_offset, smem_desc,
                    wgmma)

BWD = "flash_bwd_wgmma"  # the kernel (models.mirrors finds its file)
WGMMA_BWD = "wgmma_bwd.cuh"  # its copies, walk and epilogue, shared with flash_bwd_wgmma_dsplit



@mirrors(BWD,
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;",
         "static constexpr u32 KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128;",
         "static constexpr u32 DS_PANEL = BLOCK_N * 128;",
         "static constexpr u32 K = 0;",
         "static constexpr u32 V = K + KV_TILE;",
         "static constexpr u32 Q = V + KV_TILE;",
         "static constexpr u32 DO = Q + 2 * Q_TILE;",
         "static constexpr u32 DST = DO + 2 * Q_TILE;",
         "static constexpr u32 LSE = DST + BLOCK_N * BLOCK_M * 2;",
         "static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;",
         "static constexpr u32 STAGE_ROW = DQ_ADD == DqAdd::fixed ? DQ_STAGE_ROW"
         " : DQ_ADD == DqAdd::fixed_panels ? 512 : 0;",
         "static constexpr u32 DQ_STAGE = DELTA + 2 * BLOCK_M * 4;",
         "static constexpr u32 BYTES = DQ_STAGE + BLOCK_N / 64 * 64 * STAGE_ROW;",
         "constexpr int NWG = BLOCK_N / 64, NTHREADS = NWG * 128, NWARPS = NWG * 4;",
         "constexpr int SJ = BLOCK_M / 8;",
         "constexpr int DJ = D_TILE / 8;",
         "constexpr int QK = BLOCK_M / 16;",
         "constexpr int DQ_PANELS = (BLOCK_M / 64) * (D_TILE / 64);")
def bwd_smem(d_tile: int, block_m: int, block_n: int, dq_add: str = "atomic") -> SimpleNamespace:
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, BLOCK_N=block_n, KV_TILE=block_n * d_tile * 2,
                        Q_TILE=block_m * d_tile * 2, KV_PANEL=block_n * 128, Q_PANEL=block_m * 128,
                        DS_PANEL=block_n * 128, K=0)
    L.V = L.K + L.KV_TILE
    L.Q = L.V + L.KV_TILE
    L.DO = L.Q + 2 * L.Q_TILE
    L.DST = L.DO + 2 * L.Q_TILE
    L.LSE = L.DST + block_n * block_m * 2
    L.DELTA = L.LSE + 2 * block_m * 4
    L.STAGE_ROW = {"fixed": DQ_STAGE_ROW, "fixed_panels": 512}.get(dq_add, 0)
    L.DQ_STAGE = L.DELTA + 2 * block_m * 4
    L.BYTES = L.DQ_STAGE + block_n // 64 * 64 * L.STAGE_ROW
    L.NWG = block_n // 64
    L.NTHREADS = L.NWG * 128
    L.DQ_PANELS = (block_m // 64) * (d_tile // 64)
    return L


@mirrors(BWD,
         "const u32 s_k = base + L::K, s_v = base + L::V, s_dst = base + L::DST;",
         "const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;")
@mirrors(WGMMA_BWD,  # the copies, which flash_bwd_wgmma_dsplit's layout takes the same way
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,"
         " q + row_offset(seq.batch, seq.q_begin + m0, head, q_sb, q_ss, q_sh), seqlen_q - m0, headdim, q_ss, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,"
         " dout + row_offset(seq.batch, seq.q_begin + m0, head, do_sb, do_ss, do_sh), seqlen_q - m0, headdim_v,"
         " do_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(k_tile, k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(v_tile, v_rows + n0 * v_ss, seqlen_k - n0, headdim_v, v_ss, tid);",
         "cp_async_key_panels<BLOCK_N, D_TILE, NTHREADS>(k_tile, v_tile, k_rows, k_ss, v_rows, v_ss, n0, seqlen_k, headdim,"
         " headdim_v, tid);",
         "Walk::load_key_block_and_first(k_tile, v_tile, k_rows, args.k_ss, v_rows, args.v_ss, this->n0, seq.seqlen_k,"
         " args.headdim, args.headdim_v, tid, walk.iters, load_query_block);")
@mirrors(BWD, "key_block.load_key_block_and_first(p, seq, s_k, s_v, args, tid, load_query_block);")
def bwd_tiles(L, stage: int) -> SimpleNamespace:
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(k=base + L.K, v=base + L.V, dst=base + L.DST,
                           q=base + L.Q + stage * L.Q_TILE, do=base + L.DO + stage * L.Q_TILE)


@mirrors(WGMMA_BWD,  # issue_keys_times_queries, twice in issue_st_dpt (flash_bwd_wgmma, flash_bwd_wgmma_ws)
         "const u32 key_off = (kk / 4) * L::KV_PANEL + wg * 64 * 128 + (kk % 4) * 32;",
         "const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;",
         "Wgmma<T, BLOCK_M>::template ss<0, 0>(reinterpret_cast<float(&)[SJ * 4]>(acc),"
         " smem_desc(key_tile + key_off, 16, 1024), smem_desc(query_tile + q_off, 16, 1024), kk > 0);",
         "issue_keys_times_queries<T, L, BLOCK_M, D_TILE>(s_acc, s_k, s_q, wg);",
         "issue_keys_times_queries<T, L, BLOCK_M, D_TILE>(dp_acc, s_v, s_do, wg);")
def bwd_st_steps(L, key_tile: int, query_tile: int, wg: int) -> list[Step]:
    """S^T = K_g Q^T (key_tile K, query_tile Q) or dP^T = V_g dO^T (V, dO): warpgroup wg's 64 key
    rows x BLOCK_M queries, k-steps over the head dim; both operands K-major."""
    steps = []
    for kk in range(L.D_TILE // 16):
        a_off = (kk // 4) * L.KV_PANEL + wg * 64 * 128 + (kk % 4) * 32
        q_off = (kk // 4) * L.Q_PANEL + (kk % 4) * 32
        steps.append(Step(smem_desc(key_tile + a_off, 16, 1024), 0, smem_desc(query_tile + q_off, 16, 1024), 0))
    return steps


@mirrors(WGMMA_BWD,  # issue_dv_dk
         "Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[DJ * 4]>(dv_acc), p_frag[kk],"
         " smem_desc(s_do + kk * 2048, L::Q_PANEL, 1024), 1);",
         "Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[DJ * 4]>(dk_acc), ds_frag[kk],"
         " smem_desc(s_q + kk * 2048, L::Q_PANEL, 1024), 1);")
def bwd_dkdv_steps(L, query_tile: int) -> list[Step]:
    """dV_g += P^T dO (query_tile dO) or dK_g += dS^T Q (Q): A from registers, B MN-major,
    k-steps over the queries."""
    return [Step(None, None, smem_desc(query_tile + kk * 2048, L.Q_PANEL, 1024), 1) for kk in range(L.BLOCK_M // 16)]


@mirrors(BWD,
         "for (int panel = wg; panel < DQ_PANELS; panel += NWG)",
         "const int qp = panel / (D_TILE / 64), dp = panel % (D_TILE / 64);")
def bwd_dq_panels(L, wg: int) -> list[tuple[int, int]]:
    """The (query panel, head-dim panel) pairs of dQ that warpgroup wg computes."""
    return [(panel // (L.D_TILE // 64), panel % (L.D_TILE // 64)) for panel in range(wg, L.DQ_PANELS, L.NWG)]


@mirrors(BWD,
         "Wgmma<T, 64>::template ss<1, 1>(reinterpret_cast<float(&)[32]>(dq_acc),"
         " smem_desc(s_dst + qp * L::DS_PANEL + kk * 2048, L::DS_PANEL, 1024),"
         " smem_desc(s_k + dp * L::KV_PANEL + kk * 2048, L::KV_PANEL, 1024), kk > 0);")
def bwd_dq_steps(L, tiles, qp: int, dp: int) -> list[Step]:
    """dQ panel (qp, dp) = dS K_j: A = dS, the MN-major view of dS^T panel qp; B = K head-dim
    panel dp, MN-major; k-steps over the keys."""
    return [Step(smem_desc(tiles.dst + qp * L.DS_PANEL + kk * 2048, L.DS_PANEL, 1024), 1,
                 smem_desc(tiles.k + dp * L.KV_PANEL + kk * 2048, L.KV_PANEL, 1024), 1)
            for kk in range(L.BLOCK_N // 16)]


@mirrors(BWD,
         "const int key_row = 64 * wg + 16 * warp_in_wg + lane / 4;",
         "const int chunk = 2 * kk + h;",
         "st_shared_b32(s_dst + panel_offset<BLOCK_N>(key_row, chunk) + 4 * (lane % 4), ds_frag[kk][2 * h]);",
         "st_shared_b32(s_dst + panel_offset<BLOCK_N>(key_row + 8, chunk) + 4 * (lane % 4), ds_frag[kk][2 * h + 1]);")
def bwd_ds_t_stores(L, tiles, wg: int) -> list[tuple[np.ndarray, int, int]]:
    """Step 5's st.shared.b32 in issue order: (address per thread, kk, register of ds_frag[kk])."""
    key_row = 64 * wg + ROW_LO
    word = 4 * THREAD_IN_GROUP
    stores = []
    for kk in range(L.BLOCK_M // 16):
        for h in range(2):
            chunk = 2 * kk + h
            stores.append((tiles.dst + panel_offset(L.BLOCK_N, key_row, chunk) + word, kk, 2 * h))
            stores.append((tiles.dst + panel_offset(L.BLOCK_N, key_row + 8, chunk) + word, kk, 2 * h + 1))
    return stores


@mirrors(WGMMA_BWD,
         "return s_dst + panel_offset<BLOCK_N>(key_row + 8 * h, j) + 4 * (lane % 4);",
         "st_shared_b32(stash_addr<BLOCK_N>(s_dst, key_row, j, 0, lane), pack2<half_t>(dsds[0], dsds[1]));",
         "st_shared_b32(stash_addr<BLOCK_N>(s_dst, key_row, j, 1, lane), pack2<half_t>(dsds[2], dsds[3]));")
def bwd_grad_stash(L, tiles, wg: int) -> list[np.ndarray]:
    """Softcap's derivative stashed in the dS^T tile (float16 pairs of accumulator column block j,
    row half h), in issue order: each thread's words must be its own dS^T words of step 5, which
    it overwrites after reading them."""
    key_row = 64 * wg + ROW_LO
    return [tiles.dst + panel_offset(L.BLOCK_N, key_row + 8 * h, j) + 4 * THREAD_IN_GROUP
            for j in range(L.BLOCK_M // 8) for h in range(2)]


def _acc_columns(nj: int) -> np.ndarray:
    """Column (query) of accumulator element (j, e) of each thread: 8j + 2t + e % 2."""
    return 8 * np.arange(nj)[None, :, None] + 2 * THREAD_IN_GROUP[:, None, None] + (np.arange(4) & 1)[None, None, :]


@mirrors(BWD,
         "const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + 8 * j + 2 * (lane % 4));",
         "const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};",
         "const float p_ij = recomputed_p(score, s_acc[j][e], score_origin, query_off, key_off, dsds[e], scale_log2, base_log2[e & 1]);")  # the score policy's P of S (the identity's, in the plain kernels modelled here)
def p_transposed(s_acc, s_lse, scale_log2):
    """Step 3 (P^T from S^T; full blocks, so no entry is hidden)."""
    return recomputed_p(s_acc, scale_log2, lse_base_log2(s_lse[_acc_columns(s_acc.shape[1])]))


@mirrors(BWD,
         "const float2 d2 = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * (lane % 4));",
         "const float p16[4] = {lo.x, lo.y, hi.x, hi.y};",
         "const float d = (e & 1) ? d2.y : d2.x;",
         "dp_acc[j][e] = p16[e] == 0.f ? 0.f : ds;")
def ds_transposed(dp_acc, p16, s_delta):
    """Step 4: dS^T = P^T o (dP^T - D), with P^T from its 16-bit copy p16[thread, j, e] (without
    dropout: with it, dropout.cuh's dropped_ds, models/dropout.py)."""
    return np.where(p16 == 0.0, 0.0, p16 * (dp_acc - s_delta[_acc_columns(dp_acc.shape[1])]))


@mirrors(BWD,
         "const float2 lo = unpack2<T>(p_frag[j / 2][2 * (j % 2)]), hi = unpack2<T>(p_frag[j / 2][2 * (j % 2) + 1]);")
def unpack_p16(p_frag, sj: int) -> np.ndarray:
    """p16[thread, j, e] = {lo.x, lo.y, hi.x, hi.y} of column block j from the packed A fragments."""
    p16 = np.empty((128, sj, 4))
    for j in range(sj):
        lo, hi = p_frag[:, j // 2, 2 * (j % 2)], p_frag[:, j // 2, 2 * (j % 2) + 1]
        p16[:, j] = np.concatenate([lo, hi], axis=1)
    return p16


@mirrors(BWD,
         "const int m_lo = m0 + 64 * qp + 16 * warp_in_wg + lane / 4, m_hi = m_lo + 8;",
         "const int col = 64 * dp + 8 * j + 2 * (lane % 4);",
         "if (m_lo < seq.seqlen_q) red_add_f32x2(dqa + m_lo * args.dqa_ss + col, dq_acc[j][0], dq_acc[j][1]);",
         "if (m_hi < seq.seqlen_q) red_add_f32x2(dqa + m_hi * args.dqa_ss + col, dq_acc[j][2], dq_acc[j][3]);")
def bwd_add_dq_panel(dq_accum, dq_acc, m0: int, qp: int, dp: int, headdim: int) -> None:
    m_lo = m0 + 64 * qp + ROW_LO
    for j in range(8):
        col = 64 * dp + 8 * j + 2 * THREAD_IN_GROUP
        red_add_pairs(dq_accum, m_lo, col, dq_acc[:, j, 0:2], headdim)
        red_add_pairs(dq_accum, m_lo + 8, col, dq_acc[:, j, 2:4], headdim)


@mirrors("dq_add.cuh", "constexpr u32 DQ_STAGE_ROW = 64 * 8 + 64;")
def _stage_row_bytes():
    return 64 * 8 + 64


DQ_STAGE_ROW = _stage_row_bytes()


@mirrors(BWD,
         "const u32 s_stage = base + L::DQ_STAGE + wg * 64 * DQ_STAGE_ROW;",
         "const int r_lo = 16 * warp_in_wg + lane / 4;",
         "const u32 at = s_stage + r_lo * DQ_STAGE_ROW + 64 * j + 16 * (lane % 4);",
         "st_shared_v2_b64(at, to_fixed(dq_acc[j][0], scale_lo, dq_limit, bad_lo),"
         " to_fixed(dq_acc[j][1], scale_lo, dq_limit, bad_lo));",
         "st_shared_v2_b64(at + 8 * DQ_STAGE_ROW, to_fixed(dq_acc[j][2], scale_hi, dq_limit, bad_hi),"
         " to_fixed(dq_acc[j][3], scale_hi, dq_limit, bad_hi));",
         "if (lane < 16) bulk_wait_read_all();",
         "if (lane < 16) {",
         "const int row = 16 * warp_in_wg + lane, m = m0 + 64 * qp + row;",
         "bulk_reduce_add_s64(static_cast<long long*>(args.dq_accum) + dqa_head + m * args.dqa_ss + 64 * dp,"
         " s_stage + row * DQ_STAGE_ROW, 64 * 8);")
def bwd_dq_stage_stores(L, wg: int):
    """Fixed-point dQ: the 16-byte stores of warpgroup wg's 128 threads into its staging tile, as
    [(addresses (128,), accumulator row (128,), accumulator column (128,))] per (j, half) store,
    and, per panel row r, the warp that issues its bulk reduction and the shared address it reads
    (lanes 0-15 of warp r / 16)."""
    s_stage = aligned_base(RAW_SMEM) + L.DQ_STAGE + wg * 64 * DQ_STAGE_ROW
    r_lo = 16 * WARP_IN_WG + LANE // 4
    stores = []
    for j in range(8):
        at = s_stage + r_lo * DQ_STAGE_ROW + 64 * j + 16 * (LANE % 4)
        col = 8 * j + 2 * (LANE % 4)  # the pair col, col + 1 of dq_acc[j][0..1] (half 0) / [2..3]
        stores.append((at, r_lo, col))
        stores.append((at + 8 * DQ_STAGE_ROW, r_lo + 8, col))
    issuers = [(warp, lane) for warp in range(4) for lane in range(16)]
    sources = {16 * warp + lane: (warp, s_stage + (16 * warp + lane) * DQ_STAGE_ROW) for warp, lane in issuers}
    return stores, sources


@mirrors(BWD,
         "const i64 dqa_head = (i64)key_block.batch * args.dqa_sb + (i64)head * args.dqa_sh"
         " + (i64)seq.q_begin * args.dqa_ss;",
         "const u32 s_warp = base + L::DQ_STAGE + (wg * 64 + 16 * warp_in_wg) * L::STAGE_ROW;",
         "if (lane == 0) bulk_wait_read_all();",
         "const int flip = (lane / 4) & 1;",
         "for (int e = 0; e < 4; ++e) x[e] = flip ? dq_acc[j ^ 1][e] : dq_acc[j][e];",
         "const u32 at = s_warp + (lane / 4) * L::STAGE_ROW + 64 * (j ^ flip) + 16 * (lane % 4);",
         "st_shared_v2_b64(at, to_fixed(x[0], scale_lo, dq_limit, bad_lo), to_fixed(x[1], scale_lo, dq_limit, bad_lo));",
         "st_shared_v2_b64(at + 8 * L::STAGE_ROW, to_fixed(x[2], scale_hi, dq_limit, bad_hi),"
         " to_fixed(x[3], scale_hi, dq_limit, bad_hi));",
         "const int m = m0 + 64 * qp + 16 * warp_in_wg;",
         "if (m < seq.seqlen_q) bulk_reduce_add_s64(static_cast<long long*>(args.dq_accum) + dqa_head"
         " + dp * args.dqa_sp + m * args.dqa_ss, s_warp, 16 * L::STAGE_ROW);")
def bwd_dq_panel_stage(L, wg: int, qp: int, dp: int, m0: int, batch: int, head: int, strides, seqlen_q: int):
    """Panel-major fixed point: warpgroup wg's 16-byte stores into its staging, as [(addresses
    (128,), accumulator row (128,), accumulator column (128,))] per (j, half), where the (j ^ 1)
    order of odd rows takes its values from dq_acc[j ^ 1]; and the bulk reductions the warps issue
    (none for a warp whose first row is past seqlen_q): {warp: (shared source, bytes, dq_accum
    element offset)}."""
    sb, ss, sh, sp = strides  # BwdParams' dq_accum strides and dq_accum_panel_stride
    dqa_head = batch * sb + head * sh
    s_warp = aligned_base(RAW_SMEM) + L.DQ_STAGE + (wg * 64 + 16 * WARP_IN_WG) * L.STAGE_ROW
    flip = (LANE // 4) & 1
    stores = []
    for j in range(8):
        src_j = np.where(flip == 1, j ^ 1, j)  # the dq_acc block each thread's x[] comes from
        at = s_warp + (LANE // 4) * L.STAGE_ROW + 64 * (j ^ flip) + 16 * (LANE % 4)
        col = 8 * src_j + 2 * (LANE % 4)
        stores.append((at, ROW_LO, col))
        stores.append((at + 8 * L.STAGE_ROW, ROW_LO + 8, col))
    bulks = {w: (s_warp[32 * w], 16 * L.STAGE_ROW, dqa_head + dp * sp + (m0 + 64 * qp + 16 * w) * ss)
             for w in range(4) if m0 + 64 * qp + 16 * w < seqlen_q}
    return stores, bulks


def red_add_pairs(out, rows, cols, pairs, headdim):
    for r, c, (x, y) in zip(rows, cols, pairs):
        if c < headdim and r < out.shape[0]:
            out[r, c] += x
            out[r, c + 1] += y


def bwd_emulated(q, k, v, do, lse, delta, L, headdim: int, scale: float):
    """One CTA of flash_bwd_wgmma (key block 0, one head, non-causal, every query block of full
    BLOCK_M rows): steps 1-8 and the epilogue. Returns dK, dV and dq_accum."""
    assert q.shape[0] % L.BLOCK_M == 0 and k.shape[0] == L.BLOCK_N  # no hidden entries: no masks
    seqlen_q = q.shape[0]
    scale_log2 = scale * math.log2(math.e)
    smem = new_smem()
    tiles0 = bwd_tiles(L, 0)
    cp_async_panels(smem, tiles0.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, k, L.BLOCK_N, headdim)
    cp_async_panels(smem, tiles0.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, v, L.BLOCK_N, headdim)
    dk_acc = [np.zeros((128, L.D_TILE // 8, 4)) for _ in range(L.NWG)]
    dv_acc = [np.zeros((128, L.D_TILE // 8, 4)) for _ in range(L.NWG)]
    dq_accum = np.zeros((seqlen_q, headdim))
    for it in range(seqlen_q // L.BLOCK_M):
        stage, m0 = it & 1, it * L.BLOCK_M
        tiles = bwd_tiles(L, stage)
        cp_async_panels(smem, tiles.q, L.BLOCK_M, L.D_TILE, L.NTHREADS, q[m0:], seqlen_q - m0, headdim)
        cp_async_panels(smem, tiles.do, L.BLOCK_M, L.D_TILE, L.NTHREADS, do[m0:], seqlen_q - m0, headdim)
        s_lse, s_delta = lse[m0: m0 + L.BLOCK_M], delta[m0: m0 + L.BLOCK_M]
        for wg in range(L.NWG):
            s_acc, dp_acc = np.empty((128, L.BLOCK_M // 8, 4)), np.empty((128, L.BLOCK_M // 8, 4))
            for kk, step in enumerate(bwd_st_steps(L, tiles.k, tiles.q, wg)):
                wgmma(s_acc, smem, step, accumulate=kk > 0)
            for kk, step in enumerate(bwd_st_steps(L, tiles.v, tiles.do, wg)):
                wgmma(dp_acc, smem, step, accumulate=kk > 0)
            p_frag = pack_a_frags(p_transposed(s_acc, s_lse, scale_log2))
            ds_frag = pack_a_frags(ds_transposed(dp_acc, unpack_p16(p_frag, L.BLOCK_M // 8), s_delta))
            for addr, kk, reg in bwd_ds_t_stores(L, tiles, wg):
                st_shared_b32(smem, addr, ds_frag[:, kk, reg])
            for kk, step in enumerate(bwd_dkdv_steps(L, tiles.do)):
                wgmma(dv_acc[wg], smem, step, accumulate=True, a_regs=p_frag[:, kk])
            for kk, step in enumerate(bwd_dkdv_steps(L, tiles.q)):
                wgmma(dk_acc[wg], smem, step, accumulate=True, a_regs=ds_frag[:, kk])
        # __syncthreads: dS^T complete
        for wg in range(L.NWG):
            for qp, dp in bwd_dq_panels(L, wg):
                dq_acc = np.empty((128, 8, 4))
                for kk, step in enumerate(bwd_dq_steps(L, tiles, qp, dp)):
                    wgmma(dq_acc, smem, step, accumulate=kk > 0)
                bwd_add_dq_panel(dq_accum, dq_acc, m0, qp, dp, headdim)
    # the epilogue: each warp's rows staged into the K and V tiles (row-major, swizzled), then
    # 16-byte row stores (the mma.sync kernels' stage_acc and store_key_block_grads)
    for wg in range(L.NWG):
        for w in range(4):
            lanes = slice(32 * w, 32 * w + 32)
            stage_acc(smem, tiles0.k, L.D_TILE, 64 * wg + 16 * w, 0, dk_acc[wg][lanes], scale)
            stage_acc(smem, tiles0.v, L.D_TILE, 64 * wg + 16 * w, 0, dv_acc[wg][lanes], 1.0)
    dk, dv = np.full((L.BLOCK_N, headdim), np.nan), np.full((L.BLOCK_N, headdim), np.nan)
    store_tile(dk, smem, tiles0.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, L.BLOCK_N, headdim)
    store_tile(dv, smem, tiles0.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, L.BLOCK_N, headdim)
    return dk, dv, dq_accum


mirrors(BWD, "const int warp_row0 = 64 * wg + 16 * warp_in_wg;",
             "stage_acc<T, D_TILE, D_TILE>(s_k, warp_row0, 0, dk_acc, args.scale, lane);",
             "stage_acc<T, D_TILE, D_TILE>(s_v, warp_row0, 0, dv_acc, dv_scale, lane);",
             "store_key_block_grads<T, BLOCK_N, D_TILE, NTHREADS>(p.dk, p.dv, s_k, s_v, seq, key_block.head_kv,"
             " key_block.n0, seq.seqlen_k, args.headdim, args.headdim_v, tid);")(bwd_emulated)

mirrors(BWD, "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);")(aligned_base)


BWD_CONFIGS = [(128, 64, 128), (64, 128, 128)]  # (D_TILE, BLOCK_M, BLOCK_N) of flash_bwd_wgmma
