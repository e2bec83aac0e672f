// flash_bwd_dkdv_tf32_wgmma: dK and dV of the float32 backward on Hopper's tf32 warpgroup MMA
// (sm_90a), each product three tf32 products of split operands (PRODUCTS 3, precision "ieee"; 1:
// "tf32", the operands rounded to tf32 and the lo tiles zeros): a candidate, docs/perf-log.md
// tf32-wgmma-bwd-v0. Not a row of any plan: backward_plans.Tf32WgmmaBwdConfig runs it through
// dmma.backward(config=...) beside flash_bwd_dq_tf32_wgmma (or the tf32x3 experiment's dQ
// kernel) and the tf32x3 experiment's statistics kernel.
//
// One warpgroup per CTA owns BLOCK_N = 64 keys of one kv head (wgmma's M) and walks the query
// blocks that see them, of every query head of its GQA group (block_walk.cuh), as
// flash_bwd_wgmma.cu does for 16-bit inputs:
//   S^T  = K Q^T     A = K, B = Q: K-major hi / lo panel tiles in shared memory
//   dP^T = V dO^T    A = V, B = dO
//   P^T, dS^T        score_entry / ds_entry on the accumulators (dmma_bwd_steps.cuh, the float32 and
//                    float64 kernels' element step: mask, score transform, dropout, statistics)
//   dV  += P^T dO    A = P^T from registers (tf32_acc_times_tile), B = dO^T [d][query] KEY_PAIRS
//   dK  += dS^T Q    A = dS^T from registers, B = Q^T [d][query] KEY_PAIRS
// wgmma's tf32 form reads shared memory K-major only, so the two products that reduce over the
// queries need Q and dO a second time, transposed; every tile is split once, by the threads that
// store it (wgmma_tf32.cuh's loaders). K and V are split once per CTA; each query block's Q and
// dO four times (hi and lo, natural and transposed).
//
// RAW_STAGES 0: each query block's Q and dO read from global memory by the split, the other CTAs
// on the SM (none at the tiles that fill its shared memory) all that overlaps the loads.
// RAW_STAGES > 0: cp.async copies the raw Q and dO rows of the blocks RAW_STAGES ahead into
// staging tiles while this block computes; the row statistics come by cp.async with them.
//
// SUMS_APART: S^T's and dP^T's small products and hi hi chains summed apart
// (tf32_product_sums), and each query block's dV and dK products into fresh accumulators added
// by FADD (tf32_acc_times_tile's FRESH), for the accuracy the truncating accumulation costs: dV
// and dK chain every query of the sequence otherwise (the forward's 10x standard float32's
// error, tf32-wgmma-v0).
//
// DQ_ATOMIC (d64): dQ here too, as FA2 forms it: each query block's dQ^T = K^T dS^T (A = K^T
// split once per CTA, B = dS stored [query][key] by the threads that hold dS^T) added to dq by
// float32 atomics, so dS and the products before it are formed once (10 product units per 10
// counted, not the two kernels' 14; perf log tf32-wgmma-bwd-v0). dq must hold zeros first.
#include "block_walk.cuh"
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "wgmma_tf32.cuh"
#include "wgmma_tf32_bwd_steps.cuh"

namespace cf {

// Shared memory in bytes from a 1024-byte aligned base (backward_plans.tf32_wgmma_dkdv_smem_bytes
// mirrors BYTES and adds the alignment slack). Panel tiles (wgmma_tf32.cuh) of float32 words: K
// and V (64 rows, K-major), Q and dO (BLOCK_M rows, K-major), Q^T and dO^T (D_TILE rows of
// BLOCK_M query slots), with DQ_ATOMIC K^T (D_TILE rows of the 64 keys, in key order) and dS
// (BLOCK_M rows of the 64 keys, K-major), hi and lo, all 1024-byte aligned for the swizzle; then
// RAW_STAGES stages of raw Q and dO rows (StagedRows), then the row statistics, STAT_RING slots
// of [STAT_SLOTS][BLOCK_M] floats (dmma_bwd_steps.cuh's StatSlot).
template <int D_TILE, int BLOCK_M, int RAW_STAGES, bool DQ_ATOMIC = false>
struct BwdTf32WgmmaSmem {
    static constexpr int BLOCK_N = 64, STAT_RING = RAW_STAGES + 1;  // statistics slots
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4, Q_TILE = BLOCK_M * D_TILE * 4;
    static constexpr u32 K_HI = 0, K_LO = K_HI + KV_TILE, V_HI = K_LO + KV_TILE, V_LO = V_HI + KV_TILE;
    static constexpr u32 Q_HI = V_LO + KV_TILE, Q_LO = Q_HI + Q_TILE, DO_HI = Q_LO + Q_TILE, DO_LO = DO_HI + Q_TILE;
    static constexpr u32 QT_HI = DO_LO + Q_TILE, QT_LO = QT_HI + Q_TILE, DOT_HI = QT_LO + Q_TILE,
                         DOT_LO = DOT_HI + Q_TILE;
    static constexpr u32 KT = DOT_LO + Q_TILE;                       // [hi, lo] (DQ_ATOMIC)
    static constexpr u32 DS = KT + (DQ_ATOMIC ? 2 * KV_TILE : 0u);  // [hi, lo] (DQ_ATOMIC)
    static constexpr u32 RAW = DS + (DQ_ATOMIC ? 2 * BLOCK_M * BLOCK_N * 4 : 0u);  // [RAW_STAGES][Q, dO]
    static constexpr u32 STATS = RAW + RAW_STAGES * 2 * Q_TILE;
    static constexpr u32 BYTES = STATS + STAT_RING * STAT_SLOTS * BLOCK_M * 4;
};

template <int D_TILE, class Mask, int BLOCK_M, int RAW_STAGES, bool SUMS_APART, bool DQ_ATOMIC = false,
          int PRODUCTS = 3>
__global__ void __launch_bounds__(128, 1)
flash_bwd_dkdv_tf32_wgmma(const __grid_constant__ BwdParams p) {
    typedef BwdTf32WgmmaSmem<D_TILE, BLOCK_M, RAW_STAGES, DQ_ATOMIC> L;
    constexpr int BLOCK_N = L::BLOCK_N, NTHREADS = 128;
    static_assert(!SUMS_APART || Tf32Operand<PRODUCTS>::SPLIT, "apart sums are the split products'");
    constexpr int SV = BLOCK_M / 2;  // S^T's and dP^T's accumulator values a thread (BLOCK_M / 8 blocks of 4)
    constexpr int DV = D_TILE / 2;   // dK's and dV's
    static_assert(BLOCK_M % 32 == 0 && BLOCK_M <= 64 && D_TILE % 32 == 0 && D_TILE <= 128,
                  "whole tf32 panels; S^T's width is wgmma's N");
    static_assert(!DQ_ATOMIC || D_TILE == 64, "dQ^T = K^T dS^T: the head dim is wgmma's M");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    const float* const stat_tiles = reinterpret_cast<const float*>(smem_raw + (base - smem_u32(smem_raw)) + L::STATS);

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const int n0 = blockIdx.x * BLOCK_N, head_kv = blockIdx.y, batch = seq.batch;
    // Past a shorter sequence's end. A sequence without queries still stores dK = dV = 0 below.
    if (Mask::PACKED && n0 >= seqlen_k) return;
    const Mask mask = cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seqlen_q, seqlen_k);
    const float scale = scale_in<float>(p);
    const float drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<float>(p) : 1.f;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // the accumulators' row and column pair

    // K and V, split once (the walk's first barrier makes them whole for wgmma).
    const GlobalRows k_global{p.k.row<const float>(batch, seq.k_begin + n0, head_kv), p.k.row_stride};
    const GlobalRows v_global{p.v.row<const float>(batch, seq.k_begin + n0, head_kv), p.v.row_stride};
    split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(base + L::K_HI, base + L::K_LO, k_global, seqlen_k - n0,
                                                           p.headdim, tid);
    split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(base + L::V_HI, base + L::V_LO, v_global, seqlen_k - n0,
                                                           p.headdim_v, tid);
    if constexpr (DQ_ATOMIC)  // K^T: dQ^T's A operand, the keys in their own order (A from shared memory)
        split_tf32_panels_transposed<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(base + L::KT, base + L::KT + L::KV_TILE,
                                                                          k_global, seqlen_k - n0, p.headdim, tid);

    const QueryBlockWalk<BLOCK_M> walk(mask, n0, BLOCK_N, p.group);
    const float* const lse = static_cast<const float*>(p.lse);
    const float* const delta = static_cast<const float*>(p.delta);
    const float* const weight = static_cast<const float*>(p.weight);
    const float* const dp_ref = static_cast<const float*>(p.dp_ref);
    // Query head `head`'s rows of the sequence.
    auto q_rows = [&](int head) { return p.q.row<const float>(batch, seq.q_begin, head); };
    auto do_rows = [&](int head) { return p.dout.row<const float>(batch, seq.q_begin, head); };
    // Iteration it's raw Q and dO rows (Tf32RawStages: RAW_STAGES ahead, or read by the split itself)
    // and its rows' statistics, always by cp.async, into slot it % STAT_RING.
    const Tf32RawStages<BLOCK_M, D_TILE, NTHREADS, RAW_STAGES> stages{base + L::RAW};
    auto stage_block = [&](int it) {
        const bool valid_it = it < walk.iters;
        // (past the walk's end nothing is copied, and block(it) would divide by its 0 blocks)
        const int m0 = valid_it ? walk.block(it) * BLOCK_M : 0, head = valid_it ? walk.head(head_kv, it) : 0;
        stages.copy(it, valid_it, m0, q_rows(head), p.q.row_stride, p.headdim, do_rows(head), p.dout.row_stride,
                    p.headdim_v, seqlen_q, tid, [&] {
                        if (tid < BLOCK_M) {
                            const bool valid = m0 + tid < seqlen_q;
                            const i64 stat = seq.stat(p, head, valid ? m0 + tid : 0);
                            const u32 dst = base + L::STATS + ((it % L::STAT_RING) * STAT_SLOTS * BLOCK_M + tid) * 4;
                            cp_async_row_stats(dst, 4 * BLOCK_M, lse, delta, weight, dp_ref, stat, valid);
                        }
                    });
    };
    stages.copy_first(0, stage_block);

    float dk_acc[DV], dv_acc[DV];
#pragma unroll
    for (int e = 0; e < DV; ++e) dk_acc[e] = dv_acc[e] = 0.f;

    for (int it = 0; it < walk.iters; ++it) {
        const int m0 = walk.block(it) * BLOCK_M, head = walk.head(head_kv, it);
        // Step 1: Q and dO split into their four tile pairs (Tf32RawStages::land: between the
        // barriers that make it safe, and the tiles whole for wgmma).
        const GlobalRows q_global{q_rows(head) + m0 * p.q.row_stride, p.q.row_stride};
        const GlobalRows do_global{do_rows(head) + m0 * p.dout.row_stride, p.dout.row_stride};
        stages.land(it, q_global, do_global, [&](const auto& q_src, const auto& do_src) {
            split_tf32_panels_both<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(base + L::Q_HI, base + L::Q_LO, base + L::QT_HI,
                                                                        base + L::QT_LO, q_src, seqlen_q - m0,
                                                                        p.headdim, tid);
            split_tf32_panels_both<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(base + L::DO_HI, base + L::DO_LO,
                                                                        base + L::DOT_HI, base + L::DOT_LO, do_src,
                                                                        seqlen_q - m0, p.headdim_v, tid);
        }, stage_block);

        // Steps 2-6 (wgmma_tf32_bwd_steps.cuh): S^T, dP^T, P^T and dS^T, dV += P^T dO, dK += dS^T Q.
        float ds[SV];
        tf32_dkdv_query_block<D_TILE, BLOCK_M, PRODUCTS, SUMS_APART>(
            dk_acc, dv_acc, ds, Tf32DkdvTiles{base + L::K_HI, base + L::V_HI, base + L::Q_HI, base + L::DO_HI,
                                              base + L::QT_HI, base + L::DOT_HI},
            stat_tiles + (it % L::STAT_RING) * STAT_SLOTS * BLOCK_M, p, seq, mask, head, m0, n0, warp, lane);

        // DQ_ATOMIC, step 7's operand: dS^T's values as dS, [query][key] hi and lo (the B operand of
        // dQ^T = K^T dS^T, K-major). A warp's store of one value index writes 4 query rows x 8 keys:
        // 8 distinct swizzled chunks (the rows' XOR patterns apart), every bank once.
        if constexpr (DQ_ATOMIC) {
#pragma unroll
            for (int f = 0; f < BLOCK_M / 8; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int query = 8 * f + 2 * t + (e & 1), key = 16 * warp + g + 8 * (e >> 1);
                    const u32 at = panel_offset<BLOCK_M>(query, key >> 2) + 4 * (key & 3);
                    u32 hi, lo;
                    split_tf32<PRODUCTS>(ds[4 * f + e], hi, lo);
                    st_shared_b32(base + L::DS + at, hi);
                    st_shared_b32(base + L::DS + BLOCK_M * BLOCK_N * 4 + at, lo);
                }
        }

        // Step 7 (DQ_ATOMIC): dQ^T = K^T dS^T for this query block (64 head-dim rows x BLOCK_M
        // queries, over the block's 64 keys), scaled and added to dq by float32 atomics (in any
        // order: not bitwise reproducible). The barrier: every thread's dS stores are whole for
        // wgmma; the next block's first barrier keeps the tile until this product is waited for.
        if constexpr (DQ_ATOMIC) {
            fence_proxy_async_shared();
            __syncthreads();
            float dq_t[SV];
            tf32_product_sums<SV, BLOCK_N / 8, Tf32Operand<PRODUCTS>::SPLIT, SUMS_APART>(
                dq_t,
                Tf32RowsTimesRows<D_TILE, BLOCK_M, PRODUCTS>{base + L::KT, base + L::KT + L::KV_TILE, base + L::DS,
                                                             base + L::DS + BLOCK_M * BLOCK_N * 4},
                NoTurns());
#pragma unroll
            for (int f = 0; f < BLOCK_M / 8; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int column = 16 * warp + g + 8 * (e >> 1), query = m0 + 8 * f + 2 * t + (e & 1);
                    if (column < p.headdim && query < seqlen_q)
                        atomicAdd(p.dq.row<float>(batch, seq.q_begin + query, head) + column, dq_t[4 * f + e] * scale);
                }
        }
    }
    cp_async_wait<0>();  // the empty groups past the walk's end

    // Epilogue: dK = scale dS^T Q summed, dV (times 1 / (1 - p) under dropout).
    const int keys_valid = seqlen_k - n0;
    store_acc_rows_f32<D_TILE>(dk_acc, scale, keys_valid, p.headdim,
                               [&](int r) { return p.dk.row<float>(batch, seq.k_begin + n0 + r, head_kv); }, warp, lane);
    store_acc_rows_f32<D_TILE>(dv_acc, drop_scale, keys_valid, p.headdim_v,
                               [&](int r) { return p.dv.row<float>(batch, seq.k_begin + n0 + r, head_kv); }, warp, lane);
}

}  // namespace cf
