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
    typedef SimtQueryCta<T, D_TILE, Mask, BLOCK_M, BLOCK_N, TPR> Cta;
    typedef typename Cta::A A;
    constexpr int O_PER_LANE = D_TILE / TPR;
    constexpr int LD = Cta::LD;
    constexpr int LDS = BLOCK_N + 1;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Cta cta(p, smem_raw);
    A* ds_tile = reinterpret_cast<A*>(smem_raw + Cta::TILES_BYTES);  // [BLOCK_M][LDS]
    constexpr unsigned SMEM_BYTES = Cta::TILES_BYTES + sizeof(A) * BLOCK_M * LDS;
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();
    if (cta.past_end()) return;
    const int row = cta.row, lane_in_row = cta.lane_in_row, q_row = cta.q_row, head = cta.head;
    const int headdim = p.headdim;
    const bool row_valid = q_row < cta.seq.seqlen_q;

    RowStats<A> stats;
    A row_delta;
    A dq_acc[O_PER_LANE];
#pragma unroll
    for (int j = 0; j < O_PER_LANE; ++j) dq_acc[j] = A(0);

    cta.walk(
        p,
        [&] {  // the row's statistics (the tensors' rows: total_q of a packed batch)
            const i64 stat = cta.seq.stat(StatDims{p.nheads, p.seqlen_q}, head, q_row);
            stats = row_valid ? row_stats<A>(p, stat) : no_row_stats<A>();
            row_delta = row_valid ? ldg(static_cast<const A*>(p.delta) + stat) : A(0);
        },
        [&](int n0) {
            // dS_ij = P_ij (dO_i . V_j - D_i) with P_ij = exp2(S_ij - lse_i)
            cta.row_tile(n0, stats.top == neg_inf<A>(), [&](int j, A s_ij, A dp_ij, A dsds, bool hidden) {
                const A p_ij = recomputed_p_exact(s_ij, cta.scale_log2, stats.top, stats.weight);
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
                for (int j = 0; j < O_PER_LANE; ++j) dq_acc[j] += ds * cta.k_tile[n * LD + lane_in_row + TPR * j];
            }
        });

    if (row_valid) {
        T* __restrict__ dq_row = p.dq.row<T>(cta.seq.batch, cta.seq.q_begin + q_row, head);
#pragma unroll
        for (int j = 0; j < O_PER_LANE; ++j) {
            const int col = lane_in_row + TPR * j;
            if (col < headdim) store_as(dq_row + col, dq_acc[j] * cta.scale);
        }
    }
}

}  // namespace cf
