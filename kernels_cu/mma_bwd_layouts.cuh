// The two-kernel attention backward on tensor cores (mma.sync m16n8k16), fp16/bf16, sm_80 and sm_90.
// FlashAttention-2 work split; P and dS are recomputed from the saved lse, never stored globally.
//
// Each kernel is in a file of its own, named after it (flash_bwd_dkdv_mma.cu, ...):
//
//   flash_bwd_dkdv_mma    one CTA per (key block j, kv head, batch). K_j and V_j stay in shared
//                         memory while the CTA walks every query block i of every query head of its
//                         GQA group (Q_i, dO_i, lse_i, D_i double-buffered by cp.async) and keeps
//                         dK_j, dV_j in registers, so the sum over the group is deterministic.
//                         With DqAdd::atomic it also adds dS_ij K_j to a float32 dq_accum by red.add
//                         (DqAdd::none: no dQ, flash_bwd_dq_mma computes it).
//   flash_bwd_dq_mma      one CTA per (query block i, head, batch) walking the key blocks: dQ_i with
//                         no atomics (bitwise reproducible), at the price of recomputing S and dP.
//   flash_bwd_dq_mma_v2   the same with 2 x 16 query rows per warp: half the K_j, V_j reads per mma.
//   flash_bwd_dkdv_mma_v2 flash_bwd_dkdv_mma with 2 x 16 key rows per warp (head dim 64).
//   flash_bwd_dkdv_mma_split  warp pairs over 2 x 16 key rows, one warp for dV, one for dK (d128).
//   flash_bwd_dq_convert  dq = scale * dq_accum in the input dtype, after the atomic path.
//
// Every shared tile row of 16-bit values is swizzled (mma.cuh), so all ldmatrix reads and all
// fragment-sized writes are free of bank conflicts.
//
// The mask is the policy's (mask.cuh): a dK/dV CTA walks only the query blocks that see some key
// of its block, a dQ CTA only the key blocks that some of its rows see; blocks outside a window
// are never loaded. Rows of a visited block that see none of its keys get P = 0 by selection.
//
// This header holds the shared-memory layouts that several of them use.
#pragma once

#include "common.cuh"
#include "dq_add.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// Shared-memory layout of flash_bwd_dkdv_mma (flash_bwd_dkdv_mma_v2's with WARPS_D = 1, the base of
// flash_bwd_dkdv_mma_split's), in bytes; cupyflash/backward_plans.py (dkdv_smem_bytes) computes the
// same total.
template <int D_TILE, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS, int WARPS_D, DqAdd DQ_ADD>
struct DkdvSmem {
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;
    static constexpr u32 K = 0;
    static constexpr u32 V = K + KV_TILE;
    static constexpr u32 Q = V + KV_TILE;    // [2 stages]
    static constexpr u32 DO = Q + 2 * Q_TILE;  // [2 stages]
    static constexpr u32 DS = DO + 2 * Q_TILE;  // dS^T [BLOCK_N][BLOCK_M], 16-bit
    static constexpr u32 XCHG = DS + (DQ_ADD == DqAdd::atomic ? BLOCK_N * BLOCK_M * 2 : 0);
    // per warp: its partial S^T then dP^T, one float4 per (C fragment, lane)
    static constexpr u32 XCHG_WARP = (WARPS_D > 1 ? 2 * (M_SUB / 8) * 32 * 16 : 0);
    static constexpr u32 LSE = XCHG + NWARPS * XCHG_WARP;  // float [2 stages][BLOCK_M]
    static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;    // float [2 stages][BLOCK_M]
    static constexpr u32 BYTES = DELTA + 2 * BLOCK_M * 4;
};

// Shared-memory layout of flash_bwd_dq_mma (the base of flash_bwd_dq_mma_v2's), in bytes;
// cupyflash/backward_plans.py (dq_smem_bytes) computes the same total.
template <int D_TILE, int BLOCK_M, int BLOCK_N>
struct DqSmem {
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q = 0;
    static constexpr u32 DO = Q + Q_TILE;
    static constexpr u32 K = DO + Q_TILE;      // [2 stages]
    static constexpr u32 V = K + 2 * KV_TILE;  // [2 stages]
    static constexpr u32 BYTES = V + 2 * KV_TILE;
};

// --- a dK/dV CTA's copies and stores (flash_bwd_dkdv_mma, _v2, _split, flash_bwd_fused_mma) -----
// Each kernel copies the tensors from its BwdParams into locals at its top (bwd_args,
// mma_bwd.cuh) and passes those here. Rows past the sequence's end are zero-filled on the way in
// and not written on the way out.

// K_j, V_j: rows n0 .. n0 + BLOCK_N - 1 of the sequence's keys, kv head head_kv; K's columns past
// headdim and V's past headdim_v zero-filled.
template <typename T, int BLOCK_N, int D_TILE, int NTHREADS>
__device__ __forceinline__ void cp_async_key_block(u32 k_tile, u32 v_tile, const TensorRows& k, const TensorRows& v,
                                                   const SequenceRows& seq, int head_kv, int n0, int seqlen_k,
                                                   int headdim, int headdim_v, int tid) {
    cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(k_tile, k.row<const T>(seq.batch, seq.k_begin + n0, head_kv), seqlen_k - n0,
                                             headdim, k.row_stride, tid);
    cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(v_tile, v.row<const T>(seq.batch, seq.k_begin + n0, head_kv), seqlen_k - n0,
                                             headdim_v, v.row_stride, tid);
}

// Q_i, dO_i (query block m0 of query head `head`) and the lse, D of its rows into pipeline stage
// `stage` of layout L: its Q and DO tiles (Q_TILE bytes a stage) and its LSE, DELTA slots. Both
// tiles take `query_cols` columns, max(headdim, headdim_v): one column bound for the two, as a
// bound of their own for dO held one more register across these kernels' query loop and spilled
// (8-212 bytes). The launcher pads the narrower of q and dout with zero columns to that width
// (mma_bwd.backward), so the columns past a tensor's own head dim read as zeros.
template <typename T, class L, int BLOCK_M, int D_TILE, int NTHREADS>
__device__ __forceinline__ void cp_async_query_block(u32 base, int stage, const TensorRows& q, const TensorRows& dout,
                                                     const float* lse, const float* delta, const SequenceRows& seq,
                                                     const StatDims& stat_dims, int head, int m0, int seqlen_q,
                                                     int query_cols, int tid) {
    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,
                                             q.row<const T>(seq.batch, seq.q_begin + m0, head), seqlen_q - m0,
                                             query_cols, q.row_stride, tid);
    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,
                                             dout.row<const T>(seq.batch, seq.q_begin + m0, head), seqlen_q - m0,
                                             query_cols, dout.row_stride, tid);
    cp_async_row_stats<BLOCK_M, NTHREADS>(base + L::LSE, base + L::DELTA, stage, lse, delta,
                                           seq.stat(stat_dims, head, m0), m0, seqlen_q, tid);
}

// dK_j, dV_j from the tiles they were staged in (stage_acc into the K and V tiles) to rows
// n0 .. of dk (headdim columns) and dv (headdim_v), 16 bytes a thread and step.
template <typename T, int BLOCK_N, int D_TILE, int NTHREADS>
__device__ __forceinline__ void store_key_block_grads(const TensorRows& dk, const TensorRows& dv, u32 dk_tile,
                                                      u32 dv_tile, const SequenceRows& seq, int head_kv, int n0,
                                                      int seqlen_k, int headdim, int headdim_v, int tid) {
    store_tile<BLOCK_N, D_TILE, NTHREADS>(dk.row<T>(seq.batch, seq.k_begin + n0, head_kv), dk_tile, seqlen_k - n0,
                                          headdim, dk.row_stride, tid);
    store_tile<BLOCK_N, D_TILE, NTHREADS>(dv.row<T>(seq.batch, seq.k_begin + n0, head_kv), dv_tile, seqlen_k - n0,
                                          headdim_v, dv.row_stride, tid);
}

// dS^T of a warp's G groups of 16 key rows (rows row0 + 16 g ..) and M_SUB query columns (mc0 ..)
// into the shared dS^T tile ([BLOCK_N][BLOCK_M], 16-bit, swizzled) that step 7 reads back.
template <int G, int BLOCK_M, int M_SUB>
__device__ __forceinline__ void store_ds_t(u32 s_ds, const u32 (&ds_frag)[G][M_SUB / 16][4], int row0, int mc0,
                                           int lane) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int r = row0 + 16 * g + lane / 4, c = 2 * (lane % 4);
#pragma unroll
        for (int kk = 0; kk < M_SUB / 16; ++kk) {
            const int chunk = mc0 / 8 + 2 * kk;
            st_shared_b32(s_ds + tile_offset<BLOCK_M>(r, chunk) + 2 * c, ds_frag[g][kk][0]);
            st_shared_b32(s_ds + tile_offset<BLOCK_M>(r + 8, chunk) + 2 * c, ds_frag[g][kk][1]);
            st_shared_b32(s_ds + tile_offset<BLOCK_M>(r, chunk + 1) + 2 * c, ds_frag[g][kk][2]);
            st_shared_b32(s_ds + tile_offset<BLOCK_M>(r + 8, chunk + 1) + 2 * c, ds_frag[g][kk][3]);
        }
    }
}

// Step 7 with DqAdd::atomic (flash_bwd_dkdv_mma, _v2, _split): dq_accum += dS K_j for query block
// m0 of query head `head`, dS^T read back from its shared tile s_ds ([BLOCK_N][BLOCK_M], every
// warp's rows stored and past a barrier: the one at the top). The NWARPS warps tile the query
// block by 16 rows x DQ_COLS columns, in passes of DQ_PASS columns (registers again: dK_j, dV_j
// stay live), each reduced over all BLOCK_N keys and added to dq_accum by red.global.add.
template <typename T, int BLOCK_M, int BLOCK_N, int D_TILE, int NWARPS>
__device__ __forceinline__ void add_dq_atomic(const TensorRows& dq_accum, const SequenceRows& seq, int head, int m0,
                                              u32 s_ds, u32 s_k, int seqlen_q, int headdim, int warp, int lane) {
    constexpr int DQ_WARPS_M = BLOCK_M / 16;
    constexpr int DQ_COLS = D_TILE / (NWARPS / DQ_WARPS_M);  // dQ columns per warp
    constexpr int DQ_PASS = DQ_COLS < 32 ? DQ_COLS : 32;
    static_assert(NWARPS % DQ_WARPS_M == 0 && DQ_COLS % DQ_PASS == 0 && DQ_PASS % 16 == 0, "dQ warp grid");
    __syncthreads();
    const int q_row0 = 16 * (warp % DQ_WARPS_M);
    const int m_lo = m0 + q_row0 + lane / 4, m_hi = m_lo + 8;
    float* dqa = dq_accum.row<float>(seq.batch, seq.q_begin, head);  // float32 rows (panel stride 64)
    const i64 dqa_ss = dq_accum.row_stride;
#pragma unroll 1
    for (int col0 = DQ_COLS * (warp / DQ_WARPS_M); col0 < DQ_COLS * (warp / DQ_WARPS_M + 1); col0 += DQ_PASS) {
        float dq_acc[DQ_PASS / 8][4];
        zero(dq_acc);
        mma_AtB<T, DQ_PASS, BLOCK_N, BLOCK_M, D_TILE>(dq_acc, s_ds, q_row0, s_k, col0, lane);
#pragma unroll
        for (int j = 0; j < DQ_PASS / 8; ++j) {
            const int col = col0 + 8 * j + 2 * (lane % 4);
            if (col < headdim) {
                if (m_lo < seqlen_q) red_add_f32x2(dqa + m_lo * dqa_ss + col, dq_acc[j][0], dq_acc[j][1]);
                if (m_hi < seqlen_q) red_add_f32x2(dqa + m_hi * dqa_ss + col, dq_acc[j][2], dq_acc[j][3]);
            }
        }
    }
}

}  // namespace cf
