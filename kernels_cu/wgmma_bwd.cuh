// Copies shared by the two wgmma dK/dV kernels (flash_bwd_wgmma, flash_bwd_wgmma_dsplit): their
// tiles are wgmma's 128-byte-swizzled panels (wgmma.cuh), filled by cp.async. Both kernels hold
// their tensors as a raw pointer and three strides each, copied from BwdParams at their top.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma_bwd.cuh"
#include "softmax_bwd.cuh"
#include "wgmma.cuh"

namespace cf {

// K_j, V_j: rows n0 .. n0 + BLOCK_N - 1 of this kv head's keys (k_rows, v_rows: its row 0 of the
// sequence), zero past seqlen_k and past headdim (K) and headdim_v (V) columns.
template <int BLOCK_N, int D_TILE, int NTHREADS, typename T>
__device__ __forceinline__ void cp_async_key_panels(u32 k_tile, u32 v_tile, const T* k_rows, i64 k_ss, const T* v_rows,
                                                    i64 v_ss, int n0, int seqlen_k, int headdim, int headdim_v,
                                                    int tid) {
    cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(k_tile, k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);
    cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(v_tile, v_rows + n0 * v_ss, seqlen_k - n0, headdim_v, v_ss, tid);
}

// Q_i, dO_i (query block m0 of query head `head`, strides batch / row / head) and the lse, D of
// its rows into pipeline stage `stage` of layout L: its Q and DO tiles (Q_TILE bytes a stage) and
// its LSE, DELTA slots; rows past seqlen_q, Q's columns past headdim and dO's past headdim_v
// zero-filled.
template <class L, int BLOCK_M, int D_TILE, int NTHREADS, typename T>
__device__ __forceinline__ void cp_async_query_panels(u32 base, int stage, const T* q, i64 q_sb, i64 q_ss, i64 q_sh,
                                                      const T* dout, i64 do_sb, i64 do_ss, i64 do_sh,
                                                      const float* lse, const float* delta, const SequenceRows& seq,
                                                      const StatDims& stat_dims, int head, int m0, int seqlen_q,
                                                      int headdim, int headdim_v, int tid) {
    cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,
                                               q + row_offset(seq.batch, seq.q_begin + m0, head, q_sb, q_ss, q_sh),
                                               seqlen_q - m0, headdim, q_ss, tid);
    cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,
                                               dout + row_offset(seq.batch, seq.q_begin + m0, head, do_sb, do_ss, do_sh),
                                               seqlen_q - m0, headdim_v, do_ss, tid);
    cp_async_row_stats<BLOCK_M, NTHREADS>(base + L::LSE, base + L::DELTA, stage, lse, delta,
                                           seq.stat(stat_dims, head, m0), m0, seqlen_q, tid);
}

}  // namespace cf
