// flash_bwd_dq_simt: dQ of the SIMT backward, one block per query block Q_i walking the key blocks
// and accumulating dQ_i, P and dS recomputed (the family: flash_bwd_dkdv_simt.cu).
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "simt_bwd_steps.cuh"
#include "softmax_bwd.cuh"

namespace cf {

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int TPR>
__global__ void __launch_bounds__(BLOCK_M * TPR, 2)
flash_bwd_dq_simt(const __grid_constant__ BwdParams p) {
    typedef typename acc_of<T>::type A;
    constexpr int NTHREADS = BLOCK_M * TPR;
    constexpr int S_PER_LANE = BLOCK_N / TPR;
    constexpr int O_PER_LANE = D_TILE / TPR;
    constexpr int LD = D_TILE + 1;
    constexpr int LDS = BLOCK_N + 1;
    static_assert(BLOCK_N % TPR == 0 && D_TILE % TPR == 0 && 32 % TPR == 0, "row group shape");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* q_tile = reinterpret_cast<A*>(smem_raw);  // [BLOCK_M][LD]
    A* do_tile = q_tile + BLOCK_M * LD;            // [BLOCK_M][LD]
    A* k_tile = do_tile + BLOCK_M * LD;            // [BLOCK_N][LD]
    A* v_tile = k_tile + BLOCK_N * LD;             // [BLOCK_N][LD]
    A* ds_tile = v_tile + BLOCK_N * LD;            // [BLOCK_M][LDS]
    constexpr unsigned SMEM_BYTES = sizeof(A) * (2 * BLOCK_M * LD + 2 * BLOCK_N * LD + BLOCK_M * LDS);
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();

    const int stat_rows = p.seqlen_q;  // of lse and D: the tensors' (total_q of a packed batch)
    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, headdim = p.headdim;
    const A scale_log2 = scale_log2_in<A>(p), scale = scale_in<A>(p);
    const A* __restrict__ delta = static_cast<const A*>(p.delta);
    const Mask mask = cta_mask<Mask>(p, seq.index, seqlen_q, seqlen_k);
    const int m_block = Mask::query_block(blockIdx.x, gridDim.x);
    const int head = blockIdx.y, batch = seq.batch;
    const int head_kv = head / p.group;
    // raw scores: the unit is the scale
    const ScoreOf<Mask, A> score(score_problem<Mask>(p, seq), seq.index, head, scale);
    const int m0 = m_block * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    const int row = threadIdx.x / TPR, lane_in_row = threadIdx.x % TPR;
    const int q_row = m0 + row;

    const T* __restrict__ q_rows = p.q.row<const T>(batch, seq.q_begin, head);
    const T* __restrict__ do_rows = p.dout.row<const T>(batch, seq.q_begin, head);
    load_tile<BLOCK_M, D_TILE, NTHREADS>(q_tile, q_rows, m0, seqlen_q, headdim, p.q.row_stride, A(1));
    load_tile<BLOCK_M, D_TILE, NTHREADS>(do_tile, do_rows, m0, seqlen_q, p.headdim_v, p.dout.row_stride, A(1));
    const bool row_valid = q_row < seqlen_q;
    const i64 stat = seq.stat(StatDims{p.nheads, stat_rows}, head, q_row);
    const RowStats<A> stats = row_valid ? row_stats<A>(p, stat) : no_row_stats<A>();
    const A row_delta = row_valid ? ldg(delta + stat) : A(0);

    const T* __restrict__ k_base = p.k.row<const T>(batch, seq.k_begin, head_kv);
    const T* __restrict__ v_base = p.v.row<const T>(batch, seq.k_begin, head_kv);
    const int n_begin = mask.key_begin(m0) / BLOCK_N * BLOCK_N;
    const int n_end = mask.key_end(m0, BLOCK_M);

    const DropoutOf<Mask> dropout(p, seq.index, head);
    const A drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1);
    A dq_acc[O_PER_LANE];
#pragma unroll
    for (int j = 0; j < O_PER_LANE; ++j) dq_acc[j] = A(0);

    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        __syncthreads();  // previous K/V/dS tiles fully consumed
        load_tile<BLOCK_N, D_TILE, NTHREADS>(k_tile, k_base, n0, seqlen_k, headdim, p.k.row_stride, A(1));
        load_tile<BLOCK_N, D_TILE, NTHREADS>(v_tile, v_base, n0, seqlen_k, p.headdim_v, p.v.row_stride, A(1));
        __syncthreads();

        // dS_ij = P_ij (dO_i . V_j - D_i) with P_ij = exp2(S_ij - lse_i)
        simt_row_tile<D_TILE, TPR, LD, S_PER_LANE>(
            q_tile + row * LD, do_tile + row * LD, k_tile, v_tile, lane_in_row, q_row, n0, stats.top == neg_inf<A>(),
            mask, score, dropout, drop_scale, [&](int j, A s_ij, A dp_ij, A dsds, bool hidden) {
                const A p_ij = recomputed_p_exact(s_ij, scale_log2, stats.top, stats.weight);
                const A ds_ij = ds_of(p_ij, dp_ij, stats.dp_ref, row_delta);
                ds_tile[row * LDS + lane_in_row + TPR * j] =
                    hidden ? A(0) : Mask::Score::HAS_GRAD ? ds_ij * dsds : ds_ij;
            });
        // dS rows are written and read only by their own row group (one warp).
        __syncwarp();

        // dQ_i += dS_ij K_j
        for (int n = 0; n < BLOCK_N; ++n) {
            const A ds = ds_tile[row * LDS + n];
#pragma unroll
            for (int j = 0; j < O_PER_LANE; ++j) dq_acc[j] += ds * k_tile[n * LD + lane_in_row + TPR * j];
        }
    }

    if (row_valid) {
        T* __restrict__ dq_row = p.dq.row<T>(batch, seq.q_begin + q_row, head);
#pragma unroll
        for (int j = 0; j < O_PER_LANE; ++j) {
            const int col = lane_in_row + TPR * j;
            if (col < headdim) store_as(dq_row + col, dq_acc[j] * scale);
        }
    }
}

}  // namespace cf
