// flash_bwd_dq_mma: dQ without atomics, for the dK/dV kernels' DqAdd::none (the family:
// mma_bwd_layouts.cuh).
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_layouts.cuh"
#include "mma_bwd_query_cta.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dq_mma(const __grid_constant__ BwdParams p) {
    typedef DqSmem<D_TILE, BLOCK_M, BLOCK_N> L;
    constexpr int NTHREADS = NWARPS * 32;
    static_assert(BLOCK_M == 16 * NWARPS, "16 query rows per warp");
    static_assert(BLOCK_N % 16 == 0 && D_TILE % 16 == 0, "m16n8k16 tiles");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    typedef MmaQueryCta<T, L, Mask, BLOCK_M, BLOCK_N, D_TILE, NTHREADS> Cta;
    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    if (Cta::past_end(seq)) return;
    const Cta cta(p, smem, seq);
    const u32 s_q = cta.base + L::Q, s_do = cta.base + L::DO;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = 16 * warp;  // this warp's query rows within the block
    const int seqlen_q = cta.seqlen_q, m0 = cta.m0, head = cta.head;
    const StatDims stat_dims{p.nheads, p.seqlen_q};
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const Mask& mask = cta.mask;
    const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, seq), seq.index, head, scale);

    cta.load_rows_and_first(p, tid);

    // Per-row statistics of this lane's two accumulator rows (lane / 4 and lane / 4 + 8), by ldg
    // (bwd_args in mma_bwd.cuh).
    float base_log2[2], d[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int m = m0 + row0 + lane / 4 + 8 * half;
        const i64 stat = seq.stat(stat_dims, head, m);
        base_log2[half] = m < seqlen_q ? lse_base_log2(ldg(cta.lse + stat)) : 0.f;
        d[half] = m < seqlen_q ? ldg(cta.delta + stat) : 0.f;
    }

    float dq_acc[D_TILE / 8][4];
    zero(dq_acc);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const float drop_scale = DropoutOf<Mask>::kept_scale(p);

    for (int j = cta.keys.first; j < cta.keys.end; ++j) {
        cta.land_and_prefetch(p, j, tid);
        const int n0 = j * BLOCK_N;
        const u32 s_k = cta.k_tile(j), s_v = cta.v_tile(j);

        // Step 1: S = Q_i K_j^T, dP = dO_i V_j^T for this warp's 16 query rows.
        float s_acc[BLOCK_N / 8][4], dp_acc[BLOCK_N / 8][4];
        zero(s_acc);
        zero(dp_acc);
        mma_ABt<T, BLOCK_N, D_TILE, D_TILE, D_TILE>(s_acc, s_q, row0, s_k, 0, lane);
        mma_ABt<T, BLOCK_N, D_TILE, D_TILE, D_TILE>(dp_acc, s_do, row0, s_v, 0, lane);
        if constexpr (DropoutOf<Mask>::ENABLED)  // Z dP / (1 - p) (dropout.cuh)
            for_s_frags(dp_acc, dropout, m0 + row0 + lane / 4, j * BLOCK_N + 2 * (lane % 4), ScaleKept{drop_scale});

        // Step 2: dS = P o (dP - D) with P = exp2(S scale log2(e) - lse log2(e)); lse, D per row.
        // The score policy's transform first (score.cuh), its derivative on dS.
        const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);
        const auto score_origin = score.origin(m0 + row0 + lane / 4, n0 + 2 * (lane % 4), partial);
#pragma unroll
        for (int f = 0; f < BLOCK_N / 8; ++f) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float dsds;
                const float p = recomputed_p(score, s_acc[f][e], score_origin, 8 * (e >> 1), 8 * f + (e & 1), dsds,
                                             scale_log2, base_log2[e >> 1]);
                const float ds = Mask::Score::HAS_GRAD ? p * (dp_acc[f][e] - d[e >> 1]) * dsds
                                                       : p * (dp_acc[f][e] - d[e >> 1]);
                const bool hidden = partial && !mask.visible(m0 + row0 + lane / 4 + 8 * (e >> 1),
                                                             n0 + 8 * f + 2 * (lane % 4) + (e & 1));
                dp_acc[f][e] = hidden ? 0.f : ds;
            }
        }
        u32 ds_frag[BLOCK_N / 16][4];
        pack_a_frags<T, BLOCK_N>(ds_frag, dp_acc);

        // Step 3: dQ_i += dS K_j.
        mma_AB_regs<T, D_TILE, BLOCK_N, D_TILE>(dq_acc, ds_frag, s_k, 0, lane);
    }

    // Epilogue: dQ = scale dS K, staged through this warp's own rows of the Q tile.
    cta.end_walk();
    stage_acc<T, D_TILE, D_TILE>(s_q, row0, 0, dq_acc, scale, lane);
    cta.store_dq<16>(row0, lane);
}

}  // namespace cf
