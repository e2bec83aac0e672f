// flash_fwd_tf32_wgmma: the float32 forward on Hopper's tf32 warpgroup MMA (sm_90a), a candidate:
// docs/perf-log.md tf32-wgmma-v0 and v1. Not a row of any plan (run it through
// mma_fwd.forward(config=WgmmaTf32FwdConfig(...))).
//
// One warpgroup per CTA, BLOCK_M = 64 query rows of one (batch, head), walking the key blocks of
// its kv head in BLOCK_N-key blocks, as flash_fwd_wgmma.cu:
//   S = Q K_j^T      wgmma m64 x BLOCK_N x k8 .tf32, B = K_j from shared memory (K-major panels
//                    of hi and lo, wgmma_tf32.cuh), A = Q from shared memory too, or (Q_REGS) from
//                    registers, split once
//   online softmax   on the accumulators (online_softmax.cuh: their layout is the 16-bit one)
//   O += P V_j       wgmma m64 x D_TILE x k8 .tf32, A = P from registers (the accumulator's
//                    {d0, d2, d1, d3} per 8-key step), B = V_j^T stored [d][key] in KEY_PAIRS order
// PRODUCTS 3 (precision "ieee"): every product as lo hi + hi lo + hi hi, the small terms first;
// PRODUCTS 1 ("tf32"): hi hi. The threads split the tiles on their way into the hi and lo panels
// (tf32 has no transposed operand, so V must pass through registers anyway).
//
// SUMS_APART: S's small products and each block's P V in accumulators of their own
// (wgmma_tf32_fwd_steps.cuh), for the accuracy the truncating accumulation costs.
//
// RAW_STAGES 0 (v0): each block's K and V are read from global memory and split, then S, the
// softmax and P V run, P V waited for before the next block's split overwrites the tiles; the
// second CTA on the SM is all that overlaps the loads. RAW_STAGES > 0 (v1): cp.async copies the
// raw K and V of the blocks RAW_STAGES ahead into staging tiles while this block computes, so the
// split reads shared memory and global memory's latency is off the block's critical path.
#include "block_walk.cuh"
#include "common.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"
#include "params.cuh"
#include "tf32_fwd_steps.cuh"
#include "wgmma_tf32.cuh"
#include "wgmma_tf32_fwd_steps.cuh"

namespace cf {

// Shared memory from a 1024-byte aligned base (cupyflash/plans.py tf32_wgmma_smem_bytes adds the
// alignment slack): Q (none with Q_REGS but the O staging tile), K and V^T, each a hi and a lo
// tile of float32 words, then RAW_STAGES stages of raw K and V rows (StagedRows). Q hi stages O in
// the epilogue.
template <int D_TILE, int BLOCK_N, int RAW_STAGES = 0, bool Q_REGS = false>
struct FwdTf32WgmmaSmem {
    static constexpr int BLOCK_M = 64;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4, KV_TILE = BLOCK_N * D_TILE * 4;
    static constexpr u32 Q_HI = 0, Q_LO = Q_HI + Q_TILE;
    static constexpr u32 K_HI = Q_LO + (Q_REGS ? 0u : Q_TILE), K_LO = K_HI + KV_TILE;
    static constexpr u32 V_HI = K_LO + KV_TILE, V_LO = V_HI + KV_TILE;
    static constexpr u32 RAW = V_LO + KV_TILE;
    static constexpr u32 BYTES = RAW + RAW_STAGES * 2 * KV_TILE;
};

template <int D_TILE, class Mask, int BLOCK_N, int PRODUCTS, int RAW_STAGES = 0, bool Q_REGS = false,
          bool SUMS_APART = false>
__global__ void __launch_bounds__(128, 1)
flash_fwd_tf32_wgmma(const __grid_constant__ FwdParams p) {
    typedef FwdTf32WgmmaSmem<D_TILE, BLOCK_N, RAW_STAGES, Q_REGS> L;
    constexpr int BLOCK_M = L::BLOCK_M, NTHREADS = 128;
    constexpr int D_FRAGS = D_TILE / 8;
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT;
    static_assert(BLOCK_N % 32 == 0 && BLOCK_N <= 256 && D_TILE % 32 == 0 && D_TILE <= 256, "whole tf32 panels");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    constexpr Tanh TANH = SPLIT ? Tanh::ACCURATE : Tanh::RATIONAL;
    const ScoreOf<Mask, float, TANH> score(score_problem<Mask>(p, seq), seq.index, blockIdx.y, p.scale);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    // Keys [key_begin, n_end) hold those some row of the block sees (mask.cuh), the end asked
    // first; KeyBlockRange rounds them to blocks, the first here and the end below, where the
    // staging needs it. NVRTC's code keeps where each is computed: one range built here rounds the
    // end here too and moves the code of about half the candidate kernels.
    const int n_end = mask.key_end(m0, BLOCK_M), key_begin = mask.key_begin(m0);
    const int j_begin = KeyBlockRange<BLOCK_N>(key_begin, n_end).first;
    const int head = blockIdx.y, head_kv = head / p.group;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int strip_row0 = 16 * warp;

    const float* __restrict__ q_rows = p.q.row<const float>(seq.batch, seq.q_begin + m0, head);
    const float* __restrict__ k_rows = p.k.row<const float>(seq.batch, seq.k_begin, head_kv);
    const float* __restrict__ v_rows = p.v.row<const float>(seq.batch, seq.k_begin, head_kv);
    const i64 k_ss = p.k.row_stride, v_ss = p.v.row_stride;

    u32 q_hi[Q_REGS ? D_TILE / 8 : 1][4], q_lo[Q_REGS ? D_TILE / 8 : 1][4];
    if constexpr (Q_REGS)
        load_q_fragments<D_TILE, PRODUCTS>(q_hi, q_lo, q_rows, seqlen_q - m0, p.headdim, p.q.row_stride, strip_row0,
                                           lane);
    else
        split_tf32_panels<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(base + L::Q_HI, base + L::Q_LO,
                                                               GlobalRows{q_rows, p.q.row_stride}, seqlen_q - m0,
                                                               p.headdim, tid);
    // The raw K and V of block j into stage j % RAW_STAGES, one commit group (empty past the end,
    // so that every iteration waits for the same count).
    const int j_end = KeyBlockRange<BLOCK_N>(key_begin, n_end).end;
    const Tf32RawStages<BLOCK_N, D_TILE, NTHREADS, RAW_STAGES> stages{base + L::RAW};
    auto stage_block = [&](int j) {
        stages.copy(j, j < j_end, j * BLOCK_N, k_rows, k_ss, p.headdim, v_rows, v_ss, p.headdim_v, seqlen_k, tid);
    };
    stages.copy_first(j_begin, stage_block);

    float o_acc[1][D_FRAGS][4];
    zero_acc(o_acc);
    RowStats<RowState::ALL_LANES, 1> row_stats;
    const DropoutOf<Mask> dropout(p, seq.index, head);

    for (int j = j_begin; j < j_end; ++j) {
        const int n0 = j * BLOCK_N;
        if constexpr (RAW_STAGES > 0) {
            // Block j's raw rows have landed (this thread's copies; the barrier: everyone's), and
            // every thread is past block j - 1's products, whose tiles the split overwrites.
            cp_async_wait<RAW_STAGES - 1>();
            __syncthreads();
            const u32 raw = stages.stage(j);
            split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(base + L::K_HI, base + L::K_LO,
                                                                   StagedRows<D_TILE>{raw}, seqlen_k - n0, p.headdim,
                                                                   tid);
            split_tf32_panels_transposed<BLOCK_N, D_TILE, NTHREADS, PRODUCTS, true>(
                base + L::V_HI, base + L::V_LO, StagedRows<D_TILE>{raw + stages.TILE}, seqlen_k - n0,
                p.headdim_v, tid);
            fence_proxy_async_shared();
            __syncthreads();  // the tiles are whole for wgmma, and every thread is done with stage j
            stage_block(j + RAW_STAGES);
        } else {
            // Every thread is past block j - 1's products (waited for below), whose tiles these
            // stores overwrite; the fence hands the stores to the async proxy that wgmma reads with.
            __syncthreads();
            split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(base + L::K_HI, base + L::K_LO,
                                                                   GlobalRows{k_rows + n0 * k_ss, k_ss},
                                                                   seqlen_k - n0, p.headdim, tid);
            split_tf32_panels_transposed<BLOCK_N, D_TILE, NTHREADS, PRODUCTS, true>(
                base + L::V_HI, base + L::V_LO, GlobalRows{v_rows + n0 * v_ss, v_ss}, seqlen_k - n0, p.headdim_v,
                tid);
            fence_proxy_async_shared();
            __syncthreads();
        }

        tf32_wgmma_forward_block<D_TILE, BLOCK_M, BLOCK_N, PRODUCTS, Q_REGS, SUMS_APART>(
            o_acc, row_stats, q_hi, q_lo, base + L::Q_HI, base + L::Q_LO, base + L::K_HI, base + L::K_LO,
            base + L::V_HI, base + L::V_LO, mask, score, dropout, p.scale_log2, m0, n0, strip_row0, lane);
    }

    if constexpr (DropoutOf<Mask>::ENABLED) scale_acc(o_acc, p.variant.dropout.scale);

    // Q's hi tile stages O: every warp is done with the products that read it.
    __syncthreads();
    store_o<float, D_TILE, Mask::Score::HAS_SINK>(
        o_acc, row_stats, base + L::Q_HI, strip_row0, m0, seqlen_q, p.headdim_v,
        p.o.row<float>(seq.batch, seq.q_begin + m0, head), p.o.row_stride,
        static_cast<float*>(p.lse) + seq.stat(p, head, m0), lane, sink_log2<Mask, float>(p, head));
}

}  // namespace cf
