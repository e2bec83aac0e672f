// flash_bwd_dkdv_mma: dK, dV (and optionally dQ by atomics) of the two-kernel tensor-core backward
// (the family: mma_bwd_layouts.cuh).
//
// Warp split of flash_bwd_dkdv_mma: warp w owns 16 key rows (w / WARPS_D) and head-dim slice
// (w % WARPS_D) of dK_j and dV_j. It computes the transposed scores S^T = K_j Q_i^T and
// dP^T = V_j dO_i^T of its 16 key rows, so the accumulator fragments of P^T and dS^T repack
// directly into the A operands of dV += P^T dO_i and dK += dS^T Q_i (see mma.cuh): neither goes
// through shared memory. Only dQ += dS K_j, which sums over the key rows of all warps, reads dS
// from shared memory. A query block of BLOCK_M rows (one pipeline stage) is processed in steps of
// M_SUB query columns, sized so that S^T and dP^T of a step fit next to dK_j and dV_j in
// registers. With WARPS_D = 2 (head dim 256: 16 rows of dK and dV at full width would need 256
// accumulator registers per thread) the two warps of a key-row group each reduce S^T and dP^T
// over their half of the head dim and swap the partial sums through shared memory.
#include "common.cuh"
#include "dq_add.cuh"
#include "block_walk.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_layouts.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

template <typename T, int D_TILE, class Mask, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS,
          int WARPS_D, DqAdd DQ_ADD>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_mma(const __grid_constant__ BwdParams p) {
    static_assert(DQ_ADD == DqAdd::atomic || DQ_ADD == DqAdd::none, "dQ by float32 atomics or by flash_bwd_dq_mma");
    constexpr bool ATOMIC_DQ = DQ_ADD == DqAdd::atomic;
    typedef DkdvSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, WARPS_D, DQ_ADD> L;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int DW = D_TILE / WARPS_D;  // dK, dV columns per warp
    static_assert(BLOCK_N == 16 * NWARPS / WARPS_D, "one 16-row key group per warp (pair)");
    static_assert(WARPS_D == 1 || WARPS_D == 2, "head-dim split into 1 or 2 slices");
    static_assert(BLOCK_M % M_SUB == 0 && M_SUB % 16 == 0 && DW % 16 == 0, "m16n8k16 tiles");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    const u32 base = smem_u32(smem);
    const u32 s_k = base + L::K, s_v = base + L::V, s_ds = base + L::DS, s_xchg = base + L::XCHG;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int key_group = warp / WARPS_D, d_part = warp % WARPS_D;
    const int row0 = 16 * key_group;  // this warp's key rows within the block
    const int n0 = blockIdx.x * BLOCK_N, head_kv = blockIdx.y;
    const SequenceRows seq = cta_sequence_uniform<Mask>(p, blockIdx.z);
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, group = p.group, headdim = p.headdim;
    const int query_cols = max(headdim, p.headdim_v);  // of the Q and dO tiles (cp_async_query_block)
    const StatDims stat_dims{p.nheads, p.seqlen_q};
    // Past a shorter sequence's end. A sequence without queries still stores dK = dV = 0 below.
    if (Mask::PACKED && n0 >= seqlen_k) return;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const float drop_scale = DropoutOf<Mask>::kept_scale(p);  // 1 / (1 - p)
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dk = p.dk, dv = p.dv, dq_accum = p.dq_accum;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const Mask mask = cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seqlen_q, seqlen_k);

    // The query blocks that see some key of this block, for each query head of the group
    // (block_walk.cuh); the others are never loaded.
    const QueryBlockWalk<BLOCK_M> walk(mask, n0, BLOCK_N, group);
    auto load_query_block = [&](int it, int stage) {
        cp_async_query_block<T, L, BLOCK_M, D_TILE, NTHREADS>(base, stage, q, dout, lse, delta, seq, stat_dims,
                                                              walk.head(head_kv, it), walk.block(it) * BLOCK_M,
                                                              seqlen_q, query_cols, tid);
    };

    // Prologue: K_j, V_j and the first query block in one group.
    cp_async_key_block<T, BLOCK_N, D_TILE, NTHREADS>(s_k, s_v, k, v, seq, head_kv, n0,
                                                     seqlen_k, headdim, p.headdim_v, tid);
    if (walk.iters > 0) load_query_block(0, 0);
    cp_async_commit();

    float dk_acc[DW / 8][4], dv_acc[DW / 8][4];
    zero(dk_acc);
    zero(dv_acc);

    for (int it = 0; it < walk.iters; ++it) {
        const int stage = it & 1;
        // The wait lands this block's copies; the barrier makes every thread's copies visible and
        // guarantees that all warps are done with iteration it - 1 (stage ^ 1 and the dS tile).
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < walk.iters) load_query_block(it + 1, stage ^ 1);
        cp_async_commit();

        const int head = walk.head(head_kv, it);
        const int m0 = walk.block(it) * BLOCK_M;
        const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;
        const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;
        const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, seq), seq.index, head, scale);
        const DropoutOf<Mask> dropout(p, seq.index, head);

        // Steps 1-6 per sub-block of M_SUB query columns, one after the other: the S^T and dP^T
        // fragments of a sub-block are what the registers left by dK_j, dV_j can hold.
#pragma unroll 1
        for (int mc0 = 0; mc0 < BLOCK_M; mc0 += M_SUB) {
            const u32 s_q_sub = s_q + mc0 * (D_TILE * 2), s_do_sub = s_do + mc0 * (D_TILE * 2);
            const int m0_sub = m0 + mc0;
            const bool partial = mask.band_partial(m0_sub, M_SUB, n0, BLOCK_N);  // at its register limit: no skipping

            // Step 1: S^T = K_j Q^T for this warp's key rows (over its head-dim slice if WARPS_D = 2).
            float s_acc[M_SUB / 8][4];
            zero(s_acc);
            mma_ABt<T, M_SUB, DW, D_TILE, D_TILE>(s_acc, s_k, row0, s_q_sub, d_part * DW, lane);
            if constexpr (WARPS_D == 2) swap_partial_sums(s_acc, s_xchg, L::XCHG_WARP, warp, key_group, lane);

            // Step 2: P^T = exp2(S^T scale log2(e) - lse log2(e)); entries are (key row, query
            // column), so lse is per column. Hidden entries are set to 0 by selection, not by
            // multiplication, so that a non-finite score there cannot leak; blocks inside the mask
            // run an instance without the test (masked_or_not, mma_bwd.cuh; likewise in step 5).
            // The score policy's transform first (score.cuh), its derivative kept for step 5.
            const auto score_origin = score.origin(m0_sub + 2 * (lane % 4), n0 + row0 + lane / 4);
            ScoreGrads<Mask::Score::HAS_GRAD, M_SUB / 2> grads;
#pragma unroll
            for (int j = 0; j < M_SUB / 8; ++j) {
                const int c = 8 * j + 2 * (lane % 4);
                const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + mc0 + c);
                const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
                masked_or_not(partial, [&](auto masked) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const bool hidden =
                            masked.value && !mask.visible(m0_sub + c + (e & 1), n0 + row0 + lane / 4 + 8 * (e >> 1));
                        float dsds;
                        const float p = recomputed_p(score, s_acc[j][e], score_origin, 8 * j + (e & 1), 8 * (e >> 1),
                                                     dsds, scale_log2, base_log2[e & 1]);
                        grads.put(4 * j + e, dsds);
                        s_acc[j][e] = hidden ? 0.f : p;
                    }
                });
            }
            // Dropout (dropout.cuh): a dropped weight keeps its magnitude for dS and loses its sign.
            if constexpr (DropoutOf<Mask>::ENABLED)
                for_st_frags(s_acc, dropout, n0 + row0 + lane / 4, m0_sub + 2 * (lane % 4), MarkDropped{});

            // Step 3: dV_j += P^T dO on this warp's head-dim slice (Z P^T: the kept weights).
            {
                u32 p_frag[M_SUB / 16][4];
                pack_a_frags<T, M_SUB>(p_frag, s_acc);
                if constexpr (DropoutOf<Mask>::ENABLED) relu_frags<T>(p_frag);
                mma_AB_regs<T, DW, M_SUB, D_TILE>(dv_acc, p_frag, s_do_sub, d_part * DW, lane);
            }

            // Step 4: dP^T = V_j dO^T.
            float dp_acc[M_SUB / 8][4];
            zero(dp_acc);
            mma_ABt<T, M_SUB, DW, D_TILE, D_TILE>(dp_acc, s_v, row0, s_do_sub, d_part * DW, lane);
            if constexpr (WARPS_D == 2)
                swap_partial_sums(dp_acc, s_xchg + M_SUB / 8 * 512, L::XCHG_WARP, warp, key_group, lane);

            // Step 5: dS^T = P^T o (dP^T - D), D per column (P^T is already 0 where hidden).
#pragma unroll
            for (int j = 0; j < M_SUB / 8; ++j) {
                const int c = 8 * j + 2 * (lane % 4);
                const float2 d2 = *reinterpret_cast<const float2*>(s_delta + mc0 + c);
                masked_or_not(partial, [&](auto masked) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const bool hidden =
                            masked.value && !mask.visible(m0_sub + c + (e & 1), n0 + row0 + lane / 4 + 8 * (e >> 1));
                        const float d = (e & 1) ? d2.y : d2.x;
                        const float ds = (DropoutOf<Mask>::ENABLED ? dropped_ds(s_acc[j][e], dp_acc[j][e], d, drop_scale)
                                                                   : s_acc[j][e] * (dp_acc[j][e] - d)) *
                                         grads.get(4 * j + e);
                        dp_acc[j][e] = hidden ? 0.f : ds;
                    }
                });
            }
            u32 ds_frag[M_SUB / 16][4];
            pack_a_frags<T, M_SUB>(ds_frag, dp_acc);

            // Step 6: dK_j += dS^T Q.
            mma_AB_regs<T, DW, M_SUB, D_TILE>(dk_acc, ds_frag, s_q_sub, d_part * DW, lane);

            // dS^T to shared memory for step 7 (both warps of a pair hold the same values).
            if (ATOMIC_DQ && d_part == 0)
                store_ds_t<1, BLOCK_M, M_SUB>(s_ds, reinterpret_cast<const u32(&)[1][M_SUB / 16][4]>(ds_frag), row0, mc0,
                                              lane);
        }

        // Step 7 (DqAdd::atomic): dq_accum += dS K_j, dS read back from shared memory (mma_bwd_layouts.cuh).
        if constexpr (ATOMIC_DQ)
            add_dq_atomic<T, BLOCK_M, BLOCK_N, D_TILE, NWARPS>(dq_accum, seq, head, m0, s_ds, s_k, seqlen_q, headdim,
                                                            warp, lane);
    }

    // Epilogue: dK = scale dS^T Q summed, dV; staged through the K and V tiles for 16-byte stores.
    cp_async_wait<0>();
    __syncthreads();
    stage_acc<T, DW, D_TILE>(s_k, row0, d_part * DW, dk_acc, scale, lane);
    stage_acc<T, DW, D_TILE>(s_v, row0, d_part * DW, dv_acc, drop_scale, lane);
    __syncthreads();
    store_key_block_grads<T, BLOCK_N, D_TILE, NTHREADS>(dk, dv, s_k, s_v, seq, head_kv, n0,
                                                        seqlen_k, headdim, p.headdim_v, tid);
}

}  // namespace cf
