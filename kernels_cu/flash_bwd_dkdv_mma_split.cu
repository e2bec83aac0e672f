// flash_bwd_dkdv_mma_split: v3 dK, dV, warp pairs split by role (head dim 128); v1 is
// flash_bwd_dkdv_mma (flash_bwd_dkdv_mma.cu; the family: mma_bwd_layouts.cuh).
//
// Two 16-row groups of dK and dV at head dim 128 do not fit one warp's registers (256 fp32), so
// the two warps of a pair share 16 ROW_GROUPS key rows and split the work by gradient: warp p
// (role dV) computes S^T = K_j Q^T, P^T and dV += P^T dO; warp p + NWARPS / 2 (role dK) computes
// dP^T = V_j dO^T, receives P^T through shared memory, and accumulates dK += dS^T Q. Each Q / dO
// fragment then feeds 2 ROW_GROUPS mma. Head dim 128, 2 groups, M_SUB = 32: per pair and
// sub-block 96 ldmatrix.x4 and 8 KiB of P^T exchange per 256 mma (v1: 160 ldmatrix.x4).
//
// The P^T exchange is one float4 per (lane, group, C fragment): both warps own the same key rows
// and query columns, so lane l of the dK warp reads what lane l of the dV warp wrote. Two slots
// per pair alternate by sub-block: a slot is rewritten two pair barriers after it was written,
// and the dK warp reaches the second of them only after reading it.
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

template <int D_TILE, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS, int ROW_GROUPS, DqAdd DQ_ADD>
struct DkdvSplitSmem {
    typedef DkdvSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, 1, DQ_ADD> V1;
    static constexpr u32 XCHG_SLOT = ROW_GROUPS * (M_SUB / 8) * 32 * 16;
    static constexpr u32 XCHG = V1::BYTES;  // [NWARPS / 2 pairs][2 slots]
    static constexpr u32 BYTES = XCHG + (NWARPS / 2) * 2 * XCHG_SLOT;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS, int ROW_GROUPS,
          DqAdd DQ_ADD>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_mma_split(const __grid_constant__ BwdParams p) {
    static_assert(DQ_ADD == DqAdd::atomic || DQ_ADD == DqAdd::none, "dQ by float32 atomics or by flash_bwd_dq_mma");
    constexpr bool ATOMIC_DQ = DQ_ADD == DqAdd::atomic;
    typedef DkdvSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, 1, DQ_ADD> L;
    typedef DkdvSplitSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, ROW_GROUPS, DQ_ADD> X;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int PAIRS = NWARPS / 2;
    constexpr int G = ROW_GROUPS;
    constexpr int WARP_ROWS = 16 * G;
    static_assert(NWARPS % 2 == 0 && PAIRS <= 15, "warp pairs, one named barrier each");
    static_assert(BLOCK_N == WARP_ROWS * PAIRS, "16 * ROW_GROUPS key rows per warp pair");
    static_assert(BLOCK_M % M_SUB == 0 && M_SUB % 16 == 0 && D_TILE % 16 == 0, "m16n8k16 tiles");
    static_assert(X::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < X::BYTES) __trap();
    typedef MmaKeyCta<T, L, Mask, BLOCK_M, BLOCK_N, D_TILE, NTHREADS> Cta;
    const SequenceRows seq = cta_sequence_uniform<Mask>(p, blockIdx.z);
    if (Cta::past_end(seq)) return;
    const Cta cta(p, smem, seq);
    const u32 s_k = cta.base + L::K, s_v = cta.base + L::V, s_ds = cta.base + L::DS;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int pair = warp % PAIRS;
    const bool role_dk = warp >= PAIRS;  // warp-uniform
    const int row0 = WARP_ROWS * pair;   // the pair's key rows within the block
    const u32 s_xchg = cta.base + X::XCHG + pair * 2 * X::XCHG_SLOT + lane * 16;
    const int n0 = cta.n0, seqlen_q = cta.seqlen_q;
    const float scale_log2 = cta.scale_log2, drop_scale = cta.drop_scale;
    const Mask& mask = cta.mask;

    cta.load_key_block_and_first(tid);

    // dV_j rows of the pair (role dV) or dK_j rows (role dK).
    float acc[G][D_TILE / 8][4];
#pragma unroll
    for (int g = 0; g < G; ++g) zero(acc[g]);
    int slot = 0;

    for (int it = 0; it < cta.walk.iters; ++it) {
        cta.land_and_prefetch(it, tid);
        const int head = cta.head(it), m0 = cta.m_block(it) * BLOCK_M;
        const QueryStageTiles<L, BLOCK_M> tiles(smem, it & 1);
        const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, cta.seq), cta.seq.index, head, p.scale);
        const DropoutOf<Mask> dropout(p, cta.seq.index, head);

#pragma unroll 1
        for (int mc0 = 0; mc0 < BLOCK_M; mc0 += M_SUB, slot ^= 1) {
            const u32 s_q_sub = tiles.q + mc0 * (D_TILE * 2), s_do_sub = tiles.d_o + mc0 * (D_TILE * 2);
            const u32 s_p = s_xchg + slot * X::XCHG_SLOT;
            const int m0_sub = m0 + mc0;
            const bool partial = mask.partial(m0_sub, M_SUB, n0, BLOCK_N);
            int m_min[G][2];
            const typename Mask::Origin origin =
                key_rows_of_sub_block(m_min, mask, m0_sub, n0 + row0, lane, seqlen_q, cta.seqlen_k);

            if (!role_dk) {
                // S^T = K_j Q^T; P^T = exp2(S^T scale log2(e) - lse log2(e)), lse per column,
                // hidden entries selected to 0 (masked_or_not); P^T to the pair's slot; dV_j += P^T dO.
                // With a score transform (score.cuh) S^T is transformed first, and the slot gets
                // P^T times its derivative: the dK warp needs P^T only in dS^T.
                const auto score_origin = score.origin(m0_sub + 2 * (lane % 4), n0 + row0 + lane / 4, partial);
                float s_acc[G][M_SUB / 8][4];
#pragma unroll
                for (int g = 0; g < G; ++g) zero(s_acc[g]);
                mma_ABt_groups<T, G, M_SUB, D_TILE, D_TILE, D_TILE>(s_acc, s_k, row0, s_q_sub, 0, lane);
#pragma unroll
                for (int j = 0; j < M_SUB / 8; ++j) {
                    const int c = 8 * j + 2 * (lane % 4);
                    const float2 lse2 = *reinterpret_cast<const float2*>(tiles.lse + mc0 + c);
                    const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        float p_ds[4];  // what the slot gets: P^T, times ds'/ds with a derivative
                        masked_or_not(partial, [&](auto masked) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const bool hidden =
                                    masked.value && hides_p(mask, origin, m_min, m0_sub + c, seqlen_q, g, e,
                                                            8 * j + (e & 1), 16 * g + 8 * (e >> 1));
                                float dsds;
                                const float p = recomputed_p(score, s_acc[g][j][e], score_origin, 8 * j + (e & 1),
                                                             16 * g + 8 * (e >> 1), dsds, scale_log2, base_log2[e & 1]);
                                s_acc[g][j][e] = hidden ? 0.f : p;
                                p_ds[e] = Mask::Score::HAS_GRAD ? s_acc[g][j][e] * dsds : s_acc[g][j][e];
                            }
                        });
                        st_shared_v4(s_p + (g * (M_SUB / 8) + j) * 512, __float_as_uint(p_ds[0]),
                                     __float_as_uint(p_ds[1]), __float_as_uint(p_ds[2]), __float_as_uint(p_ds[3]));
                    }
                }
                named_barrier_sync(1 + pair, 64);
                // Dropout (dropout.cuh): dV takes the kept weights; the dK warp finds the bits itself.
                if constexpr (DropoutOf<Mask>::ENABLED)
#pragma unroll
                    for (int g = 0; g < G; ++g)
                        for_st_frags(s_acc[g], dropout, n0 + row0 + 16 * g + lane / 4, m0_sub + 2 * (lane % 4),
                                     DropToZero{});
                u32 p_frag[G][M_SUB / 16][4];
#pragma unroll
                for (int g = 0; g < G; ++g) pack_a_frags<T, M_SUB>(p_frag[g], s_acc[g]);
                mma_AB_regs_groups<T, G, D_TILE, M_SUB, D_TILE>(acc, p_frag, s_do_sub, 0, lane);
            } else {
                // dP^T = V_j dO^T; dS^T = P^T o (dP^T - D), D per column (P^T from the pair's
                // slot, already 0 where hidden; the selection keeps a non-finite dP^T out);
                // dK_j += dS^T Q.
                float dp_acc[G][M_SUB / 8][4];
#pragma unroll
                for (int g = 0; g < G; ++g) zero(dp_acc[g]);
                mma_ABt_groups<T, G, M_SUB, D_TILE, D_TILE, D_TILE>(dp_acc, s_v, row0, s_do_sub, 0, lane);
                if constexpr (DropoutOf<Mask>::ENABLED)  // Z dP^T / (1 - p)
#pragma unroll
                    for (int g = 0; g < G; ++g)
                        for_st_frags(dp_acc[g], dropout, n0 + row0 + 16 * g + lane / 4, m0_sub + 2 * (lane % 4),
                                     ScaleKept{drop_scale});
                named_barrier_sync(1 + pair, 64);
#pragma unroll
                for (int j = 0; j < M_SUB / 8; ++j) {
                    const int c = 8 * j + 2 * (lane % 4);
                    const float2 d2 = *reinterpret_cast<const float2*>(tiles.delta + mc0 + c);
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        u32 p[4];
                        ld_shared_v4(p, s_p + (g * (M_SUB / 8) + j) * 512);
                        masked_or_not(partial, [&](auto masked) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const bool hidden = masked.value && hides_ds<Mask>(m_min, m0_sub + c, seqlen_q, g, e,
                                                                                   __uint_as_float(p[e]));
                                const float ds =
                                    __uint_as_float(p[e]) * (dp_acc[g][j][e] - ((e & 1) ? d2.y : d2.x));
                                dp_acc[g][j][e] = hidden ? 0.f : ds;
                            }
                        });
                    }
                }
                u32 ds_frag[G][M_SUB / 16][4];
#pragma unroll
                for (int g = 0; g < G; ++g) pack_a_frags<T, M_SUB>(ds_frag[g], dp_acc[g]);
                mma_AB_regs_groups<T, G, D_TILE, M_SUB, D_TILE>(acc, ds_frag, s_q_sub, 0, lane);

                if constexpr (ATOMIC_DQ) store_ds_t<G, BLOCK_M, M_SUB>(s_ds, ds_frag, row0, mc0, lane);
            }
        }

        if constexpr (ATOMIC_DQ) cta.add_dq(head, m0, warp, lane);  // step 7
    }

    cta.end_walk();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (role_dk) cta.stage_dk(row0 + 16 * g, acc[g], lane);
        else cta.stage_dv(row0 + 16 * g, acc[g], lane);
    }
    cta.store_grads(tid);
}

}  // namespace cf
