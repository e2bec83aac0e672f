// flash_bwd_dq_tf32_wgmma: dQ of the float32 backward on Hopper's tf32 warpgroup MMA (sm_90a),
// each product three tf32 products of split operands (PRODUCTS 3, precision "ieee"; 1: "tf32"):
// a candidate, docs/perf-log.md tf32-wgmma-bwd-v0, the query side of flash_bwd_dkdv_tf32_wgmma.cu
// (not a row of any plan: backward_plans.Tf32WgmmaBwdConfig's dq_block_n).
//
// One warpgroup per CTA owns BLOCK_M = 64 query rows of one head (wgmma's M) and walks the key
// blocks of its kv head that its rows see, BLOCK_N keys each, as flash_bwd_dq_dmma.cu does:
//   S  = Q K^T      A = Q, B = K: K-major hi / lo panel tiles (Tf32RowsTimesRows)
//   dP = dO V^T     A = dO, B = V
//   dS              score_entry / ds_entry on the accumulators (dmma_bwd_steps.cuh), from the two
//                   rows' statistics each thread holds in registers
//   dQ += dS K      A = dS from registers, B = K^T [d][key] in KEY_PAIRS order (tf32_acc_times_tile)
// Q and dO are split once per CTA; each key block's K twice (natural and transposed) and V once.
// RAW_STAGES > 0: cp.async copies the raw K and V rows of the blocks RAW_STAGES ahead while this
// block computes (0: the split reads them from global memory). SUMS_APART: as the dK/dV kernel.
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

// Shared memory in bytes from a 1024-byte aligned base (backward_plans.tf32_wgmma_dq_smem_bytes
// mirrors BYTES and adds the alignment slack): panel tiles of float32 words, Q and dO (64 rows,
// K-major), K and V (BLOCK_N rows, K-major), K^T (D_TILE rows of BLOCK_N key slots), each hi and
// lo; then RAW_STAGES stages of raw K and V rows (StagedRows).
template <int D_TILE, int BLOCK_N, int RAW_STAGES>
struct DqTf32WgmmaSmem {
    static constexpr int BLOCK_M = 64;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4, KV_TILE = BLOCK_N * D_TILE * 4;
    static constexpr u32 Q_HI = 0, Q_LO = Q_HI + Q_TILE, DO_HI = Q_LO + Q_TILE, DO_LO = DO_HI + Q_TILE;
    static constexpr u32 K_HI = DO_LO + Q_TILE, K_LO = K_HI + KV_TILE, V_HI = K_LO + KV_TILE, V_LO = V_HI + KV_TILE;
    static constexpr u32 KT_HI = V_LO + KV_TILE, KT_LO = KT_HI + KV_TILE;
    static constexpr u32 RAW = KT_LO + KV_TILE;  // [RAW_STAGES][K, V]
    static constexpr u32 BYTES = RAW + RAW_STAGES * 2 * KV_TILE;
};

template <int D_TILE, class Mask, int BLOCK_N, int RAW_STAGES, bool SUMS_APART, int PRODUCTS = 3>
__global__ void __launch_bounds__(128, 1)
flash_bwd_dq_tf32_wgmma(const __grid_constant__ BwdParams p) {
    typedef DqTf32WgmmaSmem<D_TILE, BLOCK_N, RAW_STAGES> L;
    constexpr int BLOCK_M = L::BLOCK_M, NTHREADS = 128;
    static_assert(!SUMS_APART || Tf32Operand<PRODUCTS>::SPLIT, "apart sums are the split products'");
    constexpr int SV = BLOCK_N / 2;  // S's and dP's accumulator values a thread (BLOCK_N / 8 blocks of 4)
    static_assert(BLOCK_N % 32 == 0 && BLOCK_N <= 64 && D_TILE % 32 == 0 && D_TILE <= 128,
                  "whole tf32 panels; S's width is wgmma's N");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, batch = seq.batch;
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    const int head = blockIdx.y, head_kv = head / p.group;
    const float scale_log2 = scale_log2_in<float>(p), scale = scale_in<float>(p);
    const float drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<float>(p) : 1.f;
    const ScoreOf<Mask, float> score(score_problem<Mask>(p, seq), seq.index, head, scale);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // the accumulators' row and column pair

    // Q and dO, split once (the first block's barriers make them whole for wgmma).
    split_tf32_panels<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(
        base + L::Q_HI, base + L::Q_LO, GlobalRows{p.q.row<const float>(batch, seq.q_begin + m0, head), p.q.row_stride},
        seqlen_q - m0, p.headdim, tid);
    split_tf32_panels<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(
        base + L::DO_HI, base + L::DO_LO,
        GlobalRows{p.dout.row<const float>(batch, seq.q_begin + m0, head), p.dout.row_stride}, seqlen_q - m0,
        p.headdim_v, tid);
    const Tf32DqRows rows(p, seq, head, m0, seqlen_q, warp, g);  // this thread's two rows and their statistics

    // The walk's key blocks and their raw K and V rows (RAW_STAGES ahead, or read by the split itself).
    const Tf32KeyBlocks<BLOCK_N, BLOCK_M, D_TILE, NTHREADS, RAW_STAGES> blocks(p, seq, mask, head_kv, m0, base + L::RAW,
                                                                             tid);
    blocks.copy_first();

    float dq_acc[D_TILE / 2];
#pragma unroll
    for (int e = 0; e < D_TILE / 2; ++e) dq_acc[e] = 0.f;

    for (int j = blocks.first; j < blocks.end; ++j) {
        const int n0 = j * BLOCK_N;
        // Step 1: K and V split into their three tile pairs (Tf32RawStages::land: between the
        // barriers that make it safe, and the tiles whole for wgmma).
        blocks.land(j, [&](const auto& k_src, const auto& v_src) {
            split_tf32_panels_both<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(base + L::K_HI, base + L::K_LO, base + L::KT_HI,
                                                                        base + L::KT_LO, k_src, seqlen_k - n0,
                                                                        p.headdim, tid);
            split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(base + L::V_HI, base + L::V_LO, v_src, seqlen_k - n0,
                                                                   p.headdim_v, tid);
        });

        // Steps 2-3: S = Q K^T and dP = dO V^T, three products a k-step.
        float s[SV], dp[SV];
        tf32_scores_and_dp<D_TILE / 8, SUMS_APART>(s, dp,
            Tf32RowsTimesRows<BLOCK_M, BLOCK_N, PRODUCTS>{base + L::Q_HI, base + L::Q_LO, base + L::K_HI,
                                                          base + L::K_LO},
            {base + L::DO_HI, base + L::DO_LO, base + L::V_HI, base + L::V_LO});

        // dS = P (dP - D) into s (Tf32DqRows: each value at its row and key).
        rows.ds_in_place<BLOCK_N>(s, dp, n0, t, mask, score, dropout, drop_scale, scale_log2,
                                  mask.partial(m0, BLOCK_M, n0, BLOCK_N));

        // Step 5: dQ += dS K.
        tf32_acc_times_tile<D_TILE, BLOCK_N / 8, PRODUCTS, SUMS_APART>(dq_acc, s, base + L::KT_HI, base + L::KT_LO,
                                                                     NoTurns());
    }
    cp_async_wait<0>();  // the empty groups past the walk's end

    store_acc_rows_f32<D_TILE>(dq_acc, scale, seqlen_q - m0, p.headdim,
                               [&](int r) { return p.dq.row<float>(batch, seq.q_begin + m0 + r, head); }, warp, lane);
}

}  // namespace cf
