// flash_bwd_dkdv_mma_v2: v2 dK, dV, ROW_GROUPS 16-row key groups per warp (head dim 64); v1 is
// flash_bwd_dkdv_mma (flash_bwd_dkdv_mma.cu; the family: mma_bwd_layouts.cuh).
#include "common.cuh"
#include "dq_add.cuh"
#include "block_walk.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_key_cta.cuh"
#include "mma_bwd_layouts.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// As flash_bwd_dkdv_mma with WARPS_D = 1, but a warp owns 16 ROW_GROUPS key rows, so each Q / dO
// fragment it loads for S^T, dP^T, dV and dK feeds ROW_GROUPS times as many mma: at head dim 64,
// 2 groups and M_SUB = 32, 48 ldmatrix.x4 per 128 mma (v1: 72 per 128). Two 16-row groups of dK
// and dV at head dim 128 would take 256 accumulator registers, so there v1 stays.
template <typename T, int D_TILE, class Mask, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS, int ROW_GROUPS,
          DqAdd DQ_ADD>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_mma_v2(const __grid_constant__ BwdParams p) {
    static_assert(DQ_ADD == DqAdd::atomic || DQ_ADD == DqAdd::none, "dQ by float32 atomics or by flash_bwd_dq_mma");
    constexpr bool ATOMIC_DQ = DQ_ADD == DqAdd::atomic;
    typedef DkdvSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, 1, DQ_ADD> L;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int G = ROW_GROUPS;
    constexpr int WARP_ROWS = 16 * G;
    static_assert(BLOCK_N == WARP_ROWS * NWARPS, "16 * ROW_GROUPS key rows per warp");
    static_assert(BLOCK_M % M_SUB == 0 && M_SUB % 16 == 0 && D_TILE % 16 == 0, "m16n8k16 tiles");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    typedef MmaKeyCta<T, L, Mask, BLOCK_M, BLOCK_N, D_TILE, NTHREADS> Cta;
    const SequenceRows seq = cta_sequence_uniform<Mask>(p, blockIdx.z);
    if (Cta::past_end(seq)) return;
    const Cta cta(p, smem, seq);
    const u32 s_k = cta.base + L::K, s_v = cta.base + L::V, s_ds = cta.base + L::DS;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = WARP_ROWS * warp;  // this warp's key rows within the block
    const int n0 = cta.n0, seqlen_q = cta.seqlen_q;
    const float scale_log2 = cta.scale_log2, drop_scale = cta.drop_scale;
    const Mask& mask = cta.mask;

    cta.load_key_block_and_first(tid);

    float dk_acc[G][D_TILE / 8][4], dv_acc[G][D_TILE / 8][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        zero(dk_acc[g]);
        zero(dv_acc[g]);
    }

    for (int it = 0; it < cta.walk.iters; ++it) {
        cta.land_and_prefetch(it, tid);
        const int head = cta.head(it), m0 = cta.m_block(it) * BLOCK_M;
        const QueryStageTiles<L, BLOCK_M> tiles(smem, it & 1);
        const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, cta.seq), cta.seq.index, head, cta.scale);
        const DropoutOf<Mask> dropout(p, cta.seq.index, head);

#pragma unroll 1
        for (int mc0 = 0; mc0 < BLOCK_M; mc0 += M_SUB) {
            const u32 s_q_sub = tiles.q + mc0 * (D_TILE * 2), s_do_sub = tiles.d_o + mc0 * (D_TILE * 2);
            const int m0_sub = m0 + mc0;
            const bool partial = mask.partial(m0_sub, M_SUB, n0, BLOCK_N);
            int m_min[G][2];
            const typename Mask::Origin origin =
                key_rows_of_sub_block(m_min, mask, m0_sub, n0 + row0, lane, seqlen_q, cta.seqlen_k);
            const auto score_origin = score.origin(m0_sub + 2 * (lane % 4), n0 + row0 + lane / 4, partial);
            ScoreGrads<Mask::Score::HAS_GRAD, G * M_SUB / 2> grads;  // ds'/ds of the entries [g][j][e]

            // Step 1: S^T = K_j Q^T for this warp's 16 G key rows.
            float s_acc[G][M_SUB / 8][4];
#pragma unroll
            for (int g = 0; g < G; ++g) zero(s_acc[g]);
            mma_ABt_groups<T, G, M_SUB, D_TILE, D_TILE, D_TILE>(s_acc, s_k, row0, s_q_sub, 0, lane);

            // Step 2: P^T = exp2(S^T scale log2(e) - lse log2(e)), lse per column; hidden entries
            // selected to 0, blocks inside the mask without the test (masked_or_not; also step 5).
            masked_or_not(partial, [&](auto masked) {
#pragma unroll
                for (int j = 0; j < M_SUB / 8; ++j) {
                    const int c = 8 * j + 2 * (lane % 4);
                    const float2 lse2 = *reinterpret_cast<const float2*>(tiles.lse + mc0 + c);
                    const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
#pragma unroll
                    for (int g = 0; g < G; ++g) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const bool hidden = masked.value && hides_p(mask, origin, m_min, m0_sub + c, seqlen_q, g, e,
                                                                        8 * j + (e & 1), 16 * g + 8 * (e >> 1));
                            float dsds;
                            const float p = recomputed_p(score, s_acc[g][j][e], score_origin, 8 * j + (e & 1),
                                                         16 * g + 8 * (e >> 1), dsds, scale_log2, base_log2[e & 1]);
                            grads.put((g * (M_SUB / 8) + j) * 4 + e, dsds);
                            s_acc[g][j][e] = hidden ? 0.f : p;
                        }
                    }
                }
            });
            // Dropout (dropout.cuh): a dropped weight keeps its magnitude for dS and loses its sign.
            if constexpr (DropoutOf<Mask>::ENABLED)
#pragma unroll
                for (int g = 0; g < G; ++g)
                    for_st_frags(s_acc[g], dropout, n0 + row0 + 16 * g + lane / 4, m0_sub + 2 * (lane % 4),
                                 MarkDropped{});

            // Step 3: dV_j += P^T dO (Z P^T: the kept weights).
            {
                u32 p_frag[G][M_SUB / 16][4];
#pragma unroll
                for (int g = 0; g < G; ++g) pack_a_frags<T, M_SUB>(p_frag[g], s_acc[g]);
                if constexpr (DropoutOf<Mask>::ENABLED) relu_frags<T>(p_frag);
                mma_AB_regs_groups<T, G, D_TILE, M_SUB, D_TILE>(dv_acc, p_frag, s_do_sub, 0, lane);
            }

            // Steps 4, 5: dP^T = V_j dO^T and dS^T = P^T o (dP^T - D), D per column, in slices of
            // 16 query columns: a full-width dP^T next to P^T, dK_j and dV_j spills (the V_j
            // fragments are reloaded per slice). P^T is already 0 where hidden; the selection
            // keeps a non-finite dP^T there out.
            u32 ds_frag[G][M_SUB / 16][4];
#pragma unroll
            for (int kk = 0; kk < M_SUB / 16; ++kk) {
                float dp_acc[G][2][4];
#pragma unroll
                for (int g = 0; g < G; ++g) zero(dp_acc[g]);
                // dO rows 16 kk.. form a tile of their own: 16 rows keep the swizzle phase.
                mma_ABt_groups<T, G, 16, D_TILE, D_TILE, D_TILE>(dp_acc, s_v, row0,
                                                                 s_do_sub + 16 * kk * (D_TILE * 2), 0, lane);
                masked_or_not(partial, [&](auto masked) {
#pragma unroll
                    for (int jj = 0; jj < 2; ++jj) {
                        const int j = 2 * kk + jj;
                        const int c = 8 * j + 2 * (lane % 4);
                        const float2 d2 = *reinterpret_cast<const float2*>(tiles.delta + mc0 + c);
#pragma unroll
                        for (int g = 0; g < G; ++g) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const bool hidden =
                                    masked.value && hides_ds<Mask>(m_min, m0_sub + c, seqlen_q, g, e, s_acc[g][j][e]);
                                const float d = (e & 1) ? d2.y : d2.x, x = s_acc[g][j][e], dp = dp_acc[g][jj][e];
                                const float ds = (DropoutOf<Mask>::ENABLED ? dropped_ds(x, dp, d, drop_scale) : x * (dp - d)) *
                                                 grads.get((g * (M_SUB / 8) + j) * 4 + e);
                                dp_acc[g][jj][e] = hidden ? 0.f : ds;
                            }
                        }
                    }
                });
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    ds_frag[g][kk][0] = pack2<T>(dp_acc[g][0][0], dp_acc[g][0][1]);
                    ds_frag[g][kk][1] = pack2<T>(dp_acc[g][0][2], dp_acc[g][0][3]);
                    ds_frag[g][kk][2] = pack2<T>(dp_acc[g][1][0], dp_acc[g][1][1]);
                    ds_frag[g][kk][3] = pack2<T>(dp_acc[g][1][2], dp_acc[g][1][3]);
                }
            }

            // Step 6: dK_j += dS^T Q.
            mma_AB_regs_groups<T, G, D_TILE, M_SUB, D_TILE>(dk_acc, ds_frag, s_q_sub, 0, lane);

            // dS^T to shared memory for step 7.
            if constexpr (ATOMIC_DQ) store_ds_t<G, BLOCK_M, M_SUB>(s_ds, ds_frag, row0, mc0, lane);
        }

        if constexpr (ATOMIC_DQ) cta.add_dq(head, m0, warp, lane);  // step 7
    }

    cta.end_walk();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        cta.stage_dk(row0 + 16 * g, dk_acc[g], lane);
        cta.stage_dv(row0 + 16 * g, dv_acc[g], lane);
    }
    cta.store_grads(tid);
}

}  // namespace cf
