// flash_bwd_dkdv_simt and the SIMT backward: exact attention backward on CUDA cores, every dtype,
// any head dimension up to D_TILE.
//
// Three deterministic kernels, no atomics:
//   flash_bwd_preprocess  D_i = rowsum(dO_i * O_i) (flash_bwd_preprocess.cu), from the saved o;
//     or flash_bwd_stats_simt, the row statistics recomputed (lse and D = sum_j P_ij dP_ij, from
//     the same scores and dP as the kernels below: simt_bwd_steps.cuh)
//   flash_bwd_dkdv_simt   one block per key block K_j, V_j (outer loop); walks every query block of
//                         every query head of its GQA group, recomputing P from the row statistics, and
//                         accumulates dK_j, dV_j in registers (this file).
//   flash_bwd_dq_simt     one block per query block Q_i; walks the key blocks and accumulates dQ_i
//                         (flash_bwd_dq_simt.cu).
// P and dS are recomputed in both passes rather than exchanged through global memory.
#include "block_walk.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int TPR>
__global__ void __launch_bounds__(BLOCK_N * TPR, 2)
flash_bwd_dkdv_simt(const __grid_constant__ BwdParams p) {
    typedef typename acc_of<T>::type A;
    constexpr int NTHREADS = BLOCK_N * TPR;
    constexpr int S_PER_LANE = BLOCK_M / TPR;
    constexpr int O_PER_LANE = D_TILE / TPR;
    constexpr int LD = D_TILE + 1;
    constexpr int LDP = BLOCK_M + 1;
    static_assert(BLOCK_M % TPR == 0 && D_TILE % TPR == 0 && 32 % TPR == 0, "row group shape");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* k_tile = reinterpret_cast<A*>(smem_raw);  // [BLOCK_N][LD]
    A* v_tile = k_tile + BLOCK_N * LD;             // [BLOCK_N][LD]
    A* q_tile = v_tile + BLOCK_N * LD;             // [BLOCK_M][LD]
    A* do_tile = q_tile + BLOCK_M * LD;            // [BLOCK_M][LD]
    A* pt_tile = do_tile + BLOCK_M * LD;           // [BLOCK_N][LDP]  P^T
    A* dst_tile = pt_tile + BLOCK_N * LDP;         // [BLOCK_N][LDP]  dS^T
    A* top_tile = dst_tile + BLOCK_N * LDP;        // [BLOCK_M] the rows' statistics (RowStats)
    A* weight_tile = top_tile + BLOCK_M;           // [BLOCK_M]
    A* dp_ref_tile = weight_tile + BLOCK_M;        // [BLOCK_M]
    A* delta_tile = dp_ref_tile + BLOCK_M;         // [BLOCK_M]
    constexpr unsigned SMEM_BYTES =
        sizeof(A) * (2 * BLOCK_N * LD + 2 * BLOCK_M * LD + 2 * BLOCK_N * LDP + 4 * BLOCK_M);
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const StatDims stat_dims{p.nheads, p.seqlen_q};
    const int group = p.group;
    const int headdim = p.headdim;
    const A scale_log2 = scale_log2_in<A>(p), scale = scale_in<A>(p);
    const A* __restrict__ delta = static_cast<const A*>(p.delta);
    const int n0 = blockIdx.x * BLOCK_N;
    const int head_kv = blockIdx.y, batch = seq.batch;
    // Past a shorter sequence's end. A sequence without queries still stores dK = dV = 0 below.
    if (Mask::PACKED && n0 >= seqlen_k) return;
    const int key = threadIdx.x / TPR, lane_in_row = threadIdx.x % TPR;
    const Mask mask = cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seqlen_q, seqlen_k);

    const T* __restrict__ k_rows = p.k.row<const T>(batch, seq.k_begin, head_kv);
    const T* __restrict__ v_rows = p.v.row<const T>(batch, seq.k_begin, head_kv);
    load_tile<BLOCK_N, D_TILE, NTHREADS>(k_tile, k_rows, n0, seqlen_k, headdim, p.k.row_stride, A(1));
    load_tile<BLOCK_N, D_TILE, NTHREADS>(v_tile, v_rows, n0, seqlen_k, p.headdim_v, p.v.row_stride, A(1));

    const A drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1);
    A dk_acc[O_PER_LANE], dv_acc[O_PER_LANE];
#pragma unroll
    for (int j = 0; j < O_PER_LANE; ++j) dk_acc[j] = dv_acc[j] = A(0);

    // The query blocks that see some key of this block (block_walk.cuh), walked by their rows for
    // each query head of the group: m0 from walk.m_first while m0 < walk.m_end, the unrounded
    // end, visits blocks [first, end) as the walk's iterations do, in their order.
    const QueryBlockWalk<BLOCK_M> walk(mask, n0, BLOCK_N, group);

    for (int head = head_kv * group; head < (head_kv + 1) * group; ++head) {
        const T* __restrict__ q_base = p.q.row<const T>(batch, seq.q_begin, head);
        const T* __restrict__ do_base = p.dout.row<const T>(batch, seq.q_begin, head);
        const i64 stat_row = seq.stat(stat_dims, head, 0);
        const A* delta_row = delta + stat_row;
        // raw scores: the unit is the scale
        const ScoreOf<Mask, A> score(score_problem<Mask>(p, seq), seq.index, head, scale);
        const DropoutOf<Mask> dropout(p, seq.index, head);
        for (int m0 = walk.m_first; m0 < walk.m_end; m0 += BLOCK_M) {
            __syncthreads();  // previous Q/dO tiles fully consumed
            load_tile<BLOCK_M, D_TILE, NTHREADS>(q_tile, q_base, m0, seqlen_q, headdim, p.q.row_stride, A(1));
            load_tile<BLOCK_M, D_TILE, NTHREADS>(do_tile, do_base, m0, seqlen_q, p.headdim_v, p.dout.row_stride, A(1));
            for (int i = threadIdx.x; i < BLOCK_M; i += NTHREADS) {
                const bool valid = m0 + i < seqlen_q;
                const RowStats<A> stats = valid ? row_stats<A>(p, stat_row + m0 + i) : no_row_stats<A>();
                top_tile[i] = stats.top;
                weight_tile[i] = stats.weight;
                dp_ref_tile[i] = stats.dp_ref;
                delta_tile[i] = valid ? ldg(delta_row + m0 + i) : A(0);
            }
            __syncthreads();

            // P^T_ji = exp2(S_ij - lse_i), dP^T_ji = dO_i . V_j, dS^T_ji = P_ij (dP_ij - D_i): the
            // transpose of simt_row_tile (simt_bwd_steps.cuh), the same values to the bit
            A st[S_PER_LANE], dpt[S_PER_LANE];
            row_dots<D_TILE>(st, k_tile + key * LD, q_tile + lane_in_row * LD, TPR * LD);
            row_dots<D_TILE>(dpt, v_tile + key * LD, do_tile + lane_in_row * LD, TPR * LD);
#pragma unroll
            for (int j = 0; j < S_PER_LANE; ++j) {
                const int qi = lane_in_row + TPR * j, q_row = m0 + qi;
                // lse = -inf marks a row with no visible key (or a row past the end): P = 0
                const bool masked = top_tile[qi] == neg_inf<A>() || mask.hides(q_row, n0 + key);
                A dsds;
                const A s_ij = score.transform(st[j], score.origin(q_row, n0 + key), 0, 0, dsds);
                const A p_ij = masked ? A(0) : recomputed_p_exact(s_ij, scale_log2, top_tile[qi], weight_tile[qi]);
                // Dropout (dropout.cuh): dV takes P Z (1 / (1 - p) in the epilogue), dS = P (Z dP / (1 - p) - D).
                const bool kept = !DropoutOf<Mask>::ENABLED || dropout.keep(q_row, n0 + key);
                pt_tile[key * LDP + qi] = kept ? p_ij : A(0);
                const A dp_ij = !DropoutOf<Mask>::ENABLED ? dpt[j] : kept ? dpt[j] * drop_scale : A(0);
                const A ds_ij = ds_of(p_ij, dp_ij, dp_ref_tile[qi], delta_tile[qi]);
                dst_tile[key * LDP + qi] = masked ? A(0) : Mask::Score::HAS_GRAD ? ds_ij * dsds : ds_ij;
            }
            // P^T/dS^T rows are written and read only by their own row group (one warp).
            __syncwarp();

            // dV_j += P^T dO_i ; dK_j += dS^T Q_i
            for (int i = 0; i < BLOCK_M; ++i) {
                const A p_ji = pt_tile[key * LDP + i], ds = dst_tile[key * LDP + i];
#pragma unroll
                for (int j = 0; j < O_PER_LANE; ++j) {
                    const int col = lane_in_row + TPR * j;
                    dv_acc[j] += p_ji * do_tile[i * LD + col];
                    dk_acc[j] += ds * q_tile[i * LD + col];
                }
            }
        }
    }

    if (n0 + key < seqlen_k) {
        T* __restrict__ dk_row = p.dk.row<T>(batch, seq.k_begin + n0 + key, head_kv);
        T* __restrict__ dv_row = p.dv.row<T>(batch, seq.k_begin + n0 + key, head_kv);
#pragma unroll
        for (int j = 0; j < O_PER_LANE; ++j) {
            const int col = lane_in_row + TPR * j;
            if (col < headdim) store_as(dk_row + col, dk_acc[j] * scale);
            if (col < p.headdim_v) store_as(dv_row + col, dv_acc[j] * drop_scale);
        }
    }
}

}  // namespace cf
