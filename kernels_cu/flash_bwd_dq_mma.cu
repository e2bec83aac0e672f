// flash_bwd_dq_mma: dQ without atomics, for the dK/dV kernels' DqAdd::none (the family:
// mma_bwd_layouts.cuh).
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_layouts.cuh"
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
    const u32 base = smem_u32(smem);
    const u32 s_q = base + L::Q, s_do = base + L::DO;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = 16 * warp;  // this warp's query rows within the block
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const StatDims stat_dims{p.nheads, p.seqlen_q};
    const int headdim = p.headdim;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dq = p.dq;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const Mask mask = cta_mask<Mask>(p, seq.index, seqlen_q, seqlen_k);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    const int head = blockIdx.y, batch = seq.batch, head_kv = head / p.group;
    const ScoreOf<Mask, float, true> score(score_problem<Mask>(p, seq), seq.index, head, scale);

    // Key blocks [j_begin, j_end) hold the keys some existing row of the block sees (mask.cuh);
    // K_j and V_j sit in stage j % 2, whichever block the walk starts at.
    const int j_begin = mask.key_begin(m0) / BLOCK_N;
    const int j_end = (mask.key_end(m0, min(BLOCK_M, seqlen_q - m0)) + BLOCK_N - 1) / BLOCK_N;

    const T* k_head = k.row<const T>(batch, seq.k_begin, head_kv);
    const T* v_head = v.row<const T>(batch, seq.k_begin, head_kv);
    const i64 k_ss = k.row_stride, v_ss = v.row_stride;
    auto load_key_block = [&](int j, int stage) {
        const int n0 = j * BLOCK_N;
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::K + stage * L::KV_TILE, k_head + n0 * k_ss,
                                                 seqlen_k - n0, headdim, k_ss, tid);
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::V + stage * L::KV_TILE, v_head + n0 * v_ss,
                                                 seqlen_k - n0, p.headdim_v, v_ss, tid);
    };

    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(s_q, q.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,
                                             headdim, q.row_stride, tid);
    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(s_do, dout.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,
                                             p.headdim_v, dout.row_stride, tid);
    if (j_begin < j_end) load_key_block(j_begin, j_begin & 1);
    cp_async_commit();

    // Per-row statistics of this lane's two accumulator rows (lane / 4 and lane / 4 + 8), by ldg
    // (bwd_args in mma_bwd.cuh).
    float base_log2[2], d[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int m = m0 + row0 + lane / 4 + 8 * half;
        const i64 stat = seq.stat(stat_dims, head, m);
        base_log2[half] = m < seqlen_q ? lse_base_log2(ldg(lse + stat)) : 0.f;
        d[half] = m < seqlen_q ? ldg(delta + stat) : 0.f;
    }

    float dq_acc[D_TILE / 8][4];
    zero(dq_acc);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const float drop_scale = DropoutOf<Mask>::kept_scale(p);

    for (int j = j_begin; j < j_end; ++j) {
        const int stage = j & 1;
        // As in flash_bwd_dkdv_mma: lands block j, and all warps are done with block j - 1.
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < j_end) load_key_block(j + 1, stage ^ 1);
        cp_async_commit();

        const int n0 = j * BLOCK_N;
        const u32 s_k = base + L::K + stage * L::KV_TILE, s_v = base + L::V + stage * L::KV_TILE;

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
        const auto score_origin = score.origin(m0 + row0 + lane / 4, n0 + 2 * (lane % 4));
#pragma unroll
        for (int f = 0; f < BLOCK_N / 8; ++f) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float dsds;
                const float s_ij = score.transform(s_acc[f][e], score_origin, 8 * (e >> 1), 8 * f + (e & 1), dsds);
                const float p = recomputed_p(s_ij, scale_log2, base_log2[e >> 1]);
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

    // Epilogue: dQ = scale dS K, staged through this warp's own rows of the Q tile (no other warp
    // reads them; the barrier covers the case of no key block, where copies may still be landing).
    cp_async_wait<0>();
    __syncthreads();
    stage_acc<T, D_TILE, D_TILE>(s_q, row0, 0, dq_acc, scale, lane);
    __syncwarp();
    T* dq_rows = dq.row<T>(batch, seq.q_begin + m0 + row0, head);
    store_tile<16, D_TILE, 32>(dq_rows, s_q + tile_offset<D_TILE>(row0, 0), seqlen_q - m0 - row0, headdim,
                               dq.row_stride, lane);
}

}  // namespace cf
