"""Model of kernels_cu/flash_bwd_dq_wgmma.cu: Q and dO once, K and V stages by absolute key block,
S, dP, P, dS in registers, dQ += dS K_j, and one CTA emulated over the key blocks its mask policy
walks."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from cupyflash import masks

from .flash_fwd_wgmma import row_block_k_major_steps
from .fragments import lse_base_log2, pack_a_frags, recomputed_p
from .mask import MaskPolicy
from .mirrors import mirrors
from .mma_bwd import stage_acc, store_tile
from .mma_bwd_walks import key_range
from .smem import RAW_SMEM, aligned_base, new_smem
from .wgmma import THREADS, Step, cp_async_panels, smem_desc, wgmma

DQW = "flash_bwd_dq_wgmma"  # the kernel (models.mirrors finds its file)
WGMMA_BWD = "wgmma_bwd.cuh"  # its steps, shared with flash_bwd_dq_wgmma_ws



@mirrors(DQW,
         "static constexpr int V_STAGES = 2;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2, KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q = 0;",
         "static constexpr u32 DO = Q + Q_TILE;",
         "static constexpr u32 K = DO + Q_TILE;",
         "static constexpr u32 V = K + K_STAGES * KV_TILE;",
         "static constexpr u32 BYTES = V + V_STAGES * KV_TILE;",
         "constexpr int NWG = BLOCK_M / 64, NTHREADS = NWG * 128;",
         "constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;",
         "constexpr bool DQ_ACROSS_BARRIER = K_STAGES >= 3;",
         "static_assert(BLOCK_M % 64 == 0 && BLOCK_N % 16 == 0 && D_TILE % 64 == 0,"
         " \"64-row panels, 16-key k-steps\");",
         "static_assert(K_STAGES == 2 || K_STAGES == 3, \"two or three K stages\");",
         "static_assert(L::BYTES + 1024 <= 227 * 1024, \"shared memory\");")
def dqw_smem(d_tile: int, block_m: int, block_n: int, k_stages: int) -> SimpleNamespace:
    """DqWgmmaSmem and the kernel's derived constants (the shared-memory static_assert is checked
    by test_smem_layouts_are_panel_aligned_and_match_python)."""
    assert block_m % 64 == 0 and block_n % 16 == 0 and d_tile % 64 == 0 and k_stages in (2, 3)
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, BLOCK_N=block_n, K_STAGES=k_stages, V_STAGES=2,
                        Q_PANEL=block_m * 128, KV_PANEL=block_n * 128, Q_TILE=block_m * d_tile * 2,
                        KV_TILE=block_n * d_tile * 2, Q=0)
    L.DO = L.Q + L.Q_TILE
    L.K = L.DO + L.Q_TILE
    L.V = L.K + L.K_STAGES * L.KV_TILE
    L.BYTES = L.V + L.V_STAGES * L.KV_TILE
    L.NWG = block_m // 64
    L.NTHREADS = L.NWG * 128
    L.N_FRAGS, L.D_FRAGS = block_n // 8, d_tile // 8
    L.DQ_ACROSS_BARRIER = k_stages >= 3
    return L


@mirrors(DQW,
         "const u32 s_q = base + L::Q, s_do = base + L::DO;",
         "const u32 k_tile = base + L::K + (j % K_STAGES) * L::KV_TILE;",
         "const u32 v_tile = base + L::V + (j % L::V_STAGES) * L::KV_TILE;")
def dqw_tiles(L, j: int) -> SimpleNamespace:
    """The tiles the products of key block j read (stages: K j % K_STAGES, V j % 2)."""
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(q=base + L.Q, do=base + L.DO, k=base + L.K + (j % L.K_STAGES) * L.KV_TILE,
                           v=base + L.V + (j % L.V_STAGES) * L.KV_TILE)


@mirrors(DQW,
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(s_q, p.q.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0, headdim,"
         " p.q.row_stride, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(s_do, p.dout.row<const T>(batch, seq.q_begin + m0, head),"
         " seqlen_q - m0, p.headdim_v, p.dout.row_stride, tid);")
def dqw_load_q_do(smem, L, q, do, m0: int, headdim: int, headdim_v: int | None = None) -> None:
    """The query block's Q and dO (rows m0.. of q and do; headdim and headdim_v columns), once per
    CTA."""
    tiles = dqw_tiles(L, 0)
    seqlen_q = q.shape[0]
    for tile, g, width in ((tiles.q, q, headdim), (tiles.do, do, headdim if headdim_v is None else headdim_v)):
        cp_async_panels(smem, tile, L.BLOCK_M, L.D_TILE, L.NTHREADS, g[m0:], seqlen_q - m0, width)


@mirrors(DQW,
         "const int n0 = j * BLOCK_N;",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::K + (j % K_STAGES) * L::KV_TILE,"
         " k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::V + (j % L::V_STAGES) * L::KV_TILE,"
         " v_rows + n0 * v_ss, seqlen_k - n0, p.headdim_v, v_ss, tid);")
def dqw_load_kv_block(smem, L, j: int, k, v, headdim: int, headdim_v: int | None = None) -> None:
    """load_kv_block(j): K_j and V_j (rows n0.. of k and v) into their stages. The destinations are
    the lambda's own expressions, not dqw_tiles': the two must agree."""
    base = aligned_base(RAW_SMEM)
    n0 = j * L.BLOCK_N
    seqlen_k = k.shape[0]
    cp_async_panels(smem, base + L.K + (j % L.K_STAGES) * L.KV_TILE, L.BLOCK_N, L.D_TILE, L.NTHREADS,
                    k[n0:], seqlen_k - n0, headdim)
    cp_async_panels(smem, base + L.V + (j % L.V_STAGES) * L.KV_TILE, L.BLOCK_N, L.D_TILE, L.NTHREADS,
                    v[n0:], seqlen_k - n0, headdim if headdim_v is None else headdim_v)


_ISSUE_S_DP = ("issue_s_dp<T, BLOCK_N, D_TILE, L::Q_PANEL, L::KV_PANEL>(s_acc, dp_acc, s_q + wg * 64 * 128,"
               " s_do + wg * 64 * 128, k_tile, v_tile);")


@mirrors(DQW, _ISSUE_S_DP)
@mirrors(WGMMA_BWD, "wgmma_rows_times_rows<T, BLOCK_N, D_TILE, Q_PANEL, KV_PANEL>("
                    "reinterpret_cast<float(&)[N_FRAGS * 4]>(s_acc), q_rows, k_tile);")
def dqw_s_steps(L, tiles, wg: int) -> list[Step]:
    """S = Q K_j^T of warpgroup wg (its 64 query rows x BLOCK_N keys), k-steps over the head dim;
    both operands K-major."""
    return row_block_k_major_steps(L, tiles.q, tiles.k, wg)


@mirrors(DQW, _ISSUE_S_DP)
@mirrors(WGMMA_BWD, "wgmma_rows_times_rows<T, BLOCK_N, D_TILE, Q_PANEL, KV_PANEL>("
                    "reinterpret_cast<float(&)[N_FRAGS * 4]>(dp_acc), do_rows, v_tile);")
def dqw_dp_steps(L, tiles, wg: int) -> list[Step]:
    """dP = dO V_j^T of warpgroup wg: S's shape and offsets with dO and V_j."""
    return row_block_k_major_steps(L, tiles.do, tiles.v, wg)


@mirrors(DQW, "issue_ds_k<T, D_TILE, BLOCK_N, L::KV_PANEL>(dq_acc, ds_frag, k_tile);")
@mirrors(WGMMA_BWD,
         "for (int kk = 0; kk < BLOCK_N / 16; ++kk)",
         "Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[D_FRAGS * 4]>(dq_acc), ds_frag[kk],"
         " smem_desc(k_tile + kk * 2048, KV_PANEL, 1024), 1);")
def dqw_dq_steps(L, tiles) -> list[Step]:
    """dQ += dS K_j: A = dS from registers (k-step kk: ds_frag[kk]), B = K_j MN-major (B[key][d]:
    16 keys of 2048 bytes per k-step, the D_TILE columns in 64-column atoms one panel apart)."""
    return [Step(None, None, smem_desc(tiles.k + kk * 2048, L.KV_PANEL, 1024), 1) for kk in range(L.BLOCK_N // 16)]


@mirrors(DQW,
         "const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;",
         "const int row_lo = m0 + 16 * warp + lane / 4;",
         "const int m = row_lo + 8 * h;",
         "const i64 stat = seq.stat(stat_dims, head, m);",
         "base_log2[h] = m < seqlen_q ? lse_base_log2(__ldg(lse + stat)) : 0.f;",
         "delta_row[h] = m < seqlen_q ? __ldg(delta + stat) : 0.f;")
def dqw_thread_rows(m0: int, wg: int, lse, delta, seqlen_q: int, batch: int, head: int, nheads: int):
    """Warpgroup wg's threads: lane, row_lo, and base_log2[thread, h], delta_row[thread, h] (lse and
    delta flat, (batch, nheads, seqlen_q))."""
    tid = 128 * wg + THREADS
    warp, lane = tid // 32, tid % 32
    row_lo = m0 + 16 * warp + lane // 4
    base_log2, delta_row = np.empty((128, 2)), np.empty((128, 2))
    for h in range(2):
        m = row_lo + 8 * h
        stat = (batch * nheads + head) * seqlen_q + m
        inside = m < seqlen_q
        base_log2[:, h] = np.where(inside, lse_base_log2(lse[np.where(inside, stat, 0)]), 0.0)
        delta_row[:, h] = np.where(inside, delta[np.where(inside, stat, 0)], 0.0)
    return lane, row_lo, base_log2, delta_row


@mirrors(DQW,
         "const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);",
         "const int key0 = n0 + 2 * (lane % 4);",
         "float p_ij = recomputed_p(score, s_acc[f][e], score_origin, 8 * (e >> 1), 8 * f + (e & 1), dsds, scale_log2, base_log2[e >> 1]);",  # the score policy's P of S (the identity's, in the plain kernels modelled here)
         "const bool hidden = !mask.visible(row_lo + 8 * (e >> 1), key0 + 8 * f + (e & 1));",
         "s_acc[f][e] = decltype(masked)::value && hidden ? 0.f : p_ij;",
         "if (partial)",
         "probabilities(Flag<true>());",
         "probabilities(Flag<false>());",
         "dp_acc[f][e] = s_acc[f][e] == 0.f ? 0.f : s_acc[f][e] * (dp_acc[f][e] - delta_row[e >> 1]);")
def dqw_p_and_ds(L, s_acc, dp_acc, visible, m0: int, n0: int, lane, row_lo, base_log2, delta_row, scale_log2):
    """Steps 3-4 on the accumulators [thread, f, e]: P (0 where hidden), then dS = P o (dP - D)."""
    partial = visible.partial(m0, L.BLOCK_M, n0, L.BLOCK_N)
    key0 = n0 + 2 * (lane % 4)
    f, e = np.arange(L.N_FRAGS)[None, :, None], np.arange(4)
    p = recomputed_p(s_acc, scale_log2, base_log2[:, None, e >> 1])
    p = np.where(partial & ~visible(row_lo[:, None, None] + 8 * (e >> 1), key0[:, None, None] + 8 * f + (e & 1)),
                 0.0, p)
    ds = np.where(p == 0.0, 0.0, p * (dp_acc - delta_row[:, None, e >> 1]))
    return p, ds


@mirrors(DQW,
         "stage_acc<T, D_TILE, D_TILE>(s_q, 16 * warp, 0, dq_acc, scale, lane);",
         "store_tile<BLOCK_M, D_TILE, NTHREADS>(p.dq.row<T>(batch, seq.q_begin + m0, head), s_q, seqlen_q - m0,"
         " headdim, p.dq.row_stride, tid);")
def dqw_store_dq(dq, smem, L, dq_acc, m0: int, scale: float, headdim: int) -> None:
    """Epilogue: each warp's 16 rows (warp 4 wg + w: rows 16 (4 wg + w) of the block) staged into
    the Q tile, row-major and swizzled (mma_bwd.cuh's stage_acc), then 16-byte row stores of the
    rows below seqlen_q (= dq.shape[0]) and the chunks below headdim (store_tile)."""
    s_q = aligned_base(RAW_SMEM) + L.Q
    for wg in range(L.NWG):
        for w in range(4):
            stage_acc(smem, s_q, L.D_TILE, 64 * wg + 16 * w, 0, dq_acc[wg][32 * w: 32 * w + 32], scale)
    store_tile(dq[m0:], smem, s_q, L.BLOCK_M, L.D_TILE, L.NTHREADS, dq.shape[0] - m0, headdim)


@mirrors(DQW,
         "const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);",
         "const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);",
         "const int j_begin = keys.first, n_end = keys.n_end;",
         "if (j_begin * BLOCK_N < n_end) load_kv_block(j_begin);",
         "for (int j = j_begin; j * BLOCK_N < n_end; ++j) {",
         "if ((j + 1) * BLOCK_N < n_end) load_kv_block(j + 1);",
         "pack_a_frags<T, BLOCK_N>(ds_frag, dp_acc);")
def dqw_emulated(q, k, v, do, lse, delta, L, headdim: int, scale: float, causal: bool, m0: int,
                 batch: int, head: int, nheads: int, log_blocks=None, window_size=(-1, -1)):
    """One CTA of flash_bwd_dq_wgmma (query block m0 of one head): Q and dO once, then every key
    block it visits: S, dP, P, dS through registers, dQ += dS K_j; the epilogue's rows and columns.
    Block j + 1's copies land before block j's products read (cp.async is instantaneous here), so
    a stage clash shows up as wrong operands. Returns dq (seqlen_q x headdim, NaN where this CTA
    wrote nothing) and fills log_blocks (optional) with the key blocks visited."""
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    scale_log2 = scale * math.log2(math.e)
    mask = masks.mask_for(causal, window_size)
    visible = MaskPolicy(mask, seqlen_q, seqlen_k)
    j_begin, _, _, n_end = key_range(mask, m0, L.BLOCK_M, L.BLOCK_N, seqlen_q, seqlen_k)
    smem = new_smem()
    dqw_load_q_do(smem, L, q, do, m0, headdim)
    if j_begin * L.BLOCK_N < n_end:
        dqw_load_kv_block(smem, L, j_begin, k, v, headdim)
    rows = [dqw_thread_rows(m0, wg, lse, delta, seqlen_q, batch, head, nheads) for wg in range(L.NWG)]
    dq_acc = [np.zeros((128, L.D_FRAGS, 4)) for _ in range(L.NWG)]
    j = j_begin
    while j * L.BLOCK_N < n_end:
        if (j + 1) * L.BLOCK_N < n_end:
            dqw_load_kv_block(smem, L, j + 1, k, v, headdim)
        if log_blocks is not None:
            log_blocks.append(j)
        n0 = j * L.BLOCK_N
        tiles = dqw_tiles(L, j)
        for wg in range(L.NWG):
            lane, row_lo, base_log2, delta_row = rows[wg]
            s_acc, dp_acc = np.empty((128, L.N_FRAGS, 4)), np.empty((128, L.N_FRAGS, 4))
            for kk, step in enumerate(dqw_s_steps(L, tiles, wg)):
                wgmma(s_acc, smem, step, accumulate=kk > 0)
            for kk, step in enumerate(dqw_dp_steps(L, tiles, wg)):
                wgmma(dp_acc, smem, step, accumulate=kk > 0)
            _, ds = dqw_p_and_ds(L, s_acc, dp_acc, visible, m0, n0, lane, row_lo, base_log2, delta_row, scale_log2)
            ds_frag = pack_a_frags(ds)
            for kk, step in enumerate(dqw_dq_steps(L, tiles)):
                wgmma(dq_acc[wg], smem, step, accumulate=True, a_regs=ds_frag[:, kk])
        j += 1
    dq = np.full((seqlen_q, headdim), np.nan)
    dqw_store_dq(dq, smem, L, dq_acc, m0, scale, headdim)
    return dq



mirrors(DQW, "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);")(aligned_base)


# (D_TILE, BLOCK_M, BLOCK_N, K_STAGES) of flash_bwd_dq_wgmma: mma_bwd.DQ_WGMMA_CONFIG and the tuner's
# DQ_WGMMA_CANDIDATES in dev/mma_bwd.py (test_smem_layouts_are_panel_aligned_and_match_python checks it is both).
DQW_CONFIGS = [(64, 128, 128, 2), (64, 128, 64, 2), (128, 128, 64, 2), (256, 128, 32, 2), (256, 128, 32, 3)]
