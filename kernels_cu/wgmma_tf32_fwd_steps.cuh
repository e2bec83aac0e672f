// The tf32 wgmma forward's per-block steps, shared by flash_fwd_tf32_wgmma.cu (one warpgroup a
// CTA, v0 / v1) and flash_fwd_tf32_wgmma_ws.cu (a producer and two consumer warpgroups, v2):
// docs/perf-log.md tf32-wgmma-v0 .. v2. A warpgroup owns 64 query rows; its warp w holds rows
// strip_row0 = 16 w (+ its warpgroup's offset in the CTA) of every accumulator.
#pragma once

#include "common.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"
#include "params.cuh"
#include "split_image.cuh"
#include "tf32_fwd_steps.cuh"
#include "wgmma_tf32.cuh"

namespace cf {

// A's registers of S = Q K^T for every k-step (Q_REGS), split once: a[kk][r] is Q's (row, column)
// (row g + 8 (r & 1), column 8 kk + t + 4 (r >> 1) of the warp's 16 rows, g = lane / 4, t =
// lane % 4: the tf32 register fragment), zero past the rows and head dim given.
template <int D_TILE, int PRODUCTS>
__device__ __forceinline__ void load_q_fragments(u32 (&hi)[D_TILE / 8][4], u32 (&lo)[D_TILE / 8][4],
                                                 const float* q_rows, int rows_valid, int headdim, i64 stride,
                                                 int strip_row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D_TILE / 8; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = strip_row0 + lane / 4 + 8 * (r & 1), column = 8 * kk + lane % 4 + 4 * (r >> 1);
            const float x = row < rows_valid && column < headdim ? __ldg(q_rows + row * stride + column) : 0.f;
            split_tf32<PRODUCTS>(x, hi[kk][r], lo[kk][r]);
        }
}

// Q staged raw (tf32-wgmma-d128; wgmma_tf32.cuh's StagedQ and stage_q_rows): where Q split once
// into registers does not fit (16 D_TILE / 8 registers a thread: at d128 the consumers of
// flash_fwd_tf32_wgmma_ws spill), each warp copies its 16 rows of Q into shared memory as they are,
// in store_o's float32 staging layout (swizzled_offset_f32: the tile doubles as O's staging tile in
// the epilogue, each warp's rows its own), and every key block splits the A fragments of each
// k-step into registers just before its products (tf32_product_sums' PREPARE). The products, their
// order and the split are Q_REGS', so the results are bitwise the same but for lo (StagedQ's).
struct NoStagedQ {
    static constexpr bool ACTIVE = false;
    __device__ __forceinline__ NoStagedQ(const unsigned char*, int, int) {}
    __device__ __forceinline__ NoStagedQ() {}
};

// StagedQ where ON, else NoStagedQ.
template <bool ON, int D_TILE, int PRODUCTS>
struct QStagingOf {
    typedef NoStagedQ type;
};
template <int D_TILE, int PRODUCTS>
struct QStagingOf<true, D_TILE, PRODUCTS> {
    typedef StagedQ<D_TILE, PRODUCTS> type;
};

// One key block for a warpgroup: S = Q K_j^T as tf32 wgmma (A = Q from registers with Q_REGS,
// else from the warpgroup's 64-row Q hi / lo tiles; B = K_j's tiles), the online softmax and dropout
// on its registers, P split into wgmma's register A operand, O += P V_j (B = V_j^T's KEY_PAIRS
// tiles); both products waited for, so the caller may reuse the tiles. BLOCK_M: the CTA's rows
// (the mask's partial-block question is the CTA's).
//
// SUMS_APART (precision "ieee"): S's small products and hi hi's chains summed apart
// (tf32_product_sums' APART) and each block's P V in a fresh accumulator added to the rescaled O
// (tf32_acc_times_tile's FRESH: one block's keys chained, not the sequence's; tf32-fwd-v2's
// FRESH_O), for the accuracy the truncating accumulation costs. Same products, more registers:
// S's width three times over, and O's. q_staged (StagedQ): A from registers split per k-step from
// Q's raw rows, in place of Q_REGS' (q_hi, q_lo unused). HH_CHAIN: tf32_product_sums' hi hi chain.
template <int D_TILE, int BLOCK_M, int BLOCK_N, int PRODUCTS, bool Q_REGS, bool SUMS_APART = false, int HH_CHAIN = 2,
          class Mask, class Score, class Stats, class Drop, int QK, class Turns = NoTurns,
          class QStaging = NoStagedQ>
__device__ __forceinline__ void tf32_wgmma_forward_block(float (&o_acc)[1][D_TILE / 8][4], Stats& row_stats,
                                                         const u32 (&q_hi)[QK][4], const u32 (&q_lo)[QK][4],
                                                         u32 q_hi_tile, u32 q_lo_tile, u32 k_hi_tile, u32 k_lo_tile,
                                                         u32 v_hi_tile, u32 v_lo_tile, const Mask& mask,
                                                         const Score& score, const Drop& dropout, float scale_log2,
                                                         int m0, int n0, int strip_row0, int lane,
                                                         const Turns& turns = Turns(),
                                                         const QStaging& q_staged = QStaging()) {
    constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT, APART = SPLIT && SUMS_APART;
    static_assert(!Q_REGS || QK == D_TILE / 8, "Q's registers: one A fragment per k-step");
    constexpr int K_STEPS = D_TILE / 8;
    float s[1][N_FRAGS][4];
    float(&s_flat)[N_FRAGS * 4] = reinterpret_cast<float(&)[N_FRAGS * 4]>(s);
    constexpr bool STAGED = QStaging::ACTIVE;
    u32 qs_hi[STAGED ? 4 : 1][4], qs_lo[STAGED ? 4 : 1][4];  // tf32_product_sums' four A slots
    auto split_q = [&](int kk) {
        if constexpr (STAGED) q_staged.split(kk, qs_hi[kk & 3], qs_lo[kk & 3]);
    };
    // One k-step of S: the small products (SPLIT) into `small`, which starts at k-step 0 (its own
    // accumulator, or S's before hi hi goes in), and hi hi into `hh`.
    const u64 k_hi_desc = tf32_k_step_desc<BLOCK_N>(k_hi_tile, 0), k_lo_desc = tf32_k_step_desc<BLOCK_N>(k_lo_tile, 0);
    auto s_k_step = [&](int kk, float(&small)[N_FRAGS * 4], float(&hh)[N_FRAGS * 4], int hh_accumulates) {
        const u64 k_hi = tf32_k_step_desc_after<BLOCK_N>(k_hi_desc, kk);
        if constexpr (STAGED) {
            if constexpr (SPLIT) {
                WgmmaTf32<BLOCK_N>::rs(small, qs_lo[kk & 3], k_hi, kk > 0);
                WgmmaTf32<BLOCK_N>::rs(small, qs_hi[kk & 3], tf32_k_step_desc_after<BLOCK_N>(k_lo_desc, kk), 1);
            }
            WgmmaTf32<BLOCK_N>::rs(hh, qs_hi[kk & 3], k_hi, hh_accumulates);
        } else if constexpr (Q_REGS) {
            if constexpr (SPLIT) {
                WgmmaTf32<BLOCK_N>::rs(small, q_lo[kk], k_hi, kk > 0);
                WgmmaTf32<BLOCK_N>::rs(small, q_hi[kk], tf32_k_step_desc_after<BLOCK_N>(k_lo_desc, kk), 1);
            }
            WgmmaTf32<BLOCK_N>::rs(hh, q_hi[kk], k_hi, hh_accumulates);
        } else {
            const u64 q_hi_desc = tf32_k_step_desc<64>(q_hi_tile, kk);
            if constexpr (SPLIT) {
                WgmmaTf32<BLOCK_N>::ss(small, tf32_k_step_desc<64>(q_lo_tile, kk), k_hi, kk > 0);
                WgmmaTf32<BLOCK_N>::ss(small, q_hi_desc, tf32_k_step_desc_after<BLOCK_N>(k_lo_desc, kk), 1);
            }
            WgmmaTf32<BLOCK_N>::ss(hh, q_hi_desc, k_hi, hh_accumulates);
        }
    };
    tf32_product_sums<N_FRAGS * 4, K_STEPS, SPLIT, APART, STAGED, HH_CHAIN>(s_flat, s_k_step, turns, split_q);

    scale_and_mask(s, scale_log2, mask.keys_partial(m0, BLOCK_M, n0, BLOCK_N), mask, score, m0 + strip_row0, n0,
                   lane);
    float m_new[1][2];
    row_max(m_new, s, row_stats, lane);
    softmax_rescale(s, o_acc, row_stats, m_new, lane);
    if constexpr (Drop::ENABLED)  // after the row sums: l and lse stay the softmax's
        for_s_frags(s, dropout, m0 + strip_row0 + lane / 4, n0 + 2 * (lane % 4), DropToZero{});

    // O += P V_j: P as the register A operand (tf32_acc_times_tile), V_j^T's KEY_PAIRS tiles as B.
    tf32_acc_times_tile<D_TILE, N_FRAGS, PRODUCTS, APART, true>(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc),
                                                                s_flat, v_hi_tile, v_lo_tile, turns);
}

// A key block's K and V split for the float32 forward's products, in bytes from a 1024-byte
// aligned base: K (hi, then lo; K-major) for S = Q K^T, V^T (hi, lo; KEY_PAIRS order) for O += P V.
// The same bytes are one stage of flash_fwd_tf32_wgmma_ws's ring and one block of the image
// flash_fwd_split_kv_tf32 writes (FwdParams' kv_split).
template <int D_TILE, int BLOCK_N>
struct Tf32FwdKeyBlockTiles {
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4;
    static constexpr u32 K_HI = 0, K_LO = KV_TILE, V_HI = 2 * KV_TILE, V_LO = 3 * KV_TILE, BYTES = 4 * KV_TILE;
};

// Splits keys [0, keys_valid) of K and V (read through `k` and `v`) into Tf32FwdKeyBlockTiles at
// `tiles`, spread over NTHREADS threads; the rest zero-filled.
template <int D_TILE, int BLOCK_N, int NTHREADS, int PRODUCTS, class Source>
__device__ __forceinline__ void split_key_block_fwd_tf32(u32 tiles, const Source& k, const Source& v, int keys_valid,
                                                         int headdim, int headdim_v, int thread) {
    typedef Tf32FwdKeyBlockTiles<D_TILE, BLOCK_N> T;
    split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(tiles + T::K_HI, tiles + T::K_LO, k, keys_valid, headdim,
                                                           thread);
    split_tf32_panels_transposed<BLOCK_N, D_TILE, NTHREADS, PRODUCTS, true>(tiles + T::V_HI, tiles + T::V_LO, v,
                                                                          keys_valid, headdim_v, thread);
}

// Where key block j of sequence `seq`'s kv head `head_kv` lies in the forward's kv_split image, in
// bytes (blocks of Tf32FwdKeyBlockTiles' BYTES; split_image.cuh's image_block order).
template <bool PACKED, int D_TILE, int BLOCK_N>
__device__ __forceinline__ i64 kv_fwd_image_offset(const FwdParams& p, const SequenceRows& seq, int head_kv, int j) {
    return image_block<PACKED, BLOCK_N>(seq, seq.k_begin, p.seqlen_k, p.nheads_kv, head_kv, j) *
           Tf32FwdKeyBlockTiles<D_TILE, BLOCK_N>::BYTES;
}

}  // namespace cf
