// flash_bwd_dkdv_dmma: dK and dV of the float64 backward on the FP64 tensor cores (issue 18), one
// block per key block walking every query block of every query head of its GQA group, P and dS
// recomputed; deterministic, no atomics (dQ: flash_bwd_dq_dmma).
//
// A warp owns WARP_KEYS = 8 M_TILES keys: their dK and dV rows are its accumulators, the block's K
// and V rows stay in shared memory. The keys are the products' rows: S^T = K Q^T and dP^T = V dO^T
// (dmma_bwd_steps.cuh, the transposes of the dQ kernel's S and dP to the bit), so P^T and dS^T come
// out in the accumulator layout that dV += P^T dO and dK += dS^T Q take as their A fragments.
// Each query block's Q, dO and row statistics come in by cp.async into the stage the previous
// block does not read, while that block computes.
#include "block_walk.cuh"
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

template <int D_TILE, class Mask, int BLOCK_M, int NWARPS, int M_TILES = 2, bool WIDE = false,
          typename T = double>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_dmma(const __grid_constant__ BwdParams p) {
    typedef T A;  // double: DMMA; float: three tf32 products (experiment)
    constexpr int WARP_KEYS = 8 * M_TILES;
    constexpr int BLOCK_N = WARP_KEYS * NWARPS;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int Q_TILES = BLOCK_M / 8;  // 8-query n-tiles of S^T
    constexpr int LD = D_TILE + 4;        // flash_bwd_dq_dmma.cu says why
    constexpr int STAGE = 2 * BLOCK_M * LD + STAT_SLOTS * BLOCK_M;  // elements: Q, dO, statistics
    static_assert(D_TILE % 8 == 0 && BLOCK_M % 8 == 0 && BLOCK_M <= NTHREADS, "m8n8k4 tiles");
    static_assert(!WIDE || M_TILES == 2, "m16n8k8 takes two 8-row m-tiles");
    static_assert(sizeof(A) == 8 || M_TILES == 2, "m16n8k8 .tf32 takes two 8-row m-tiles");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!WIDE || sizeof(A) == 4, "m16n8k8 .f64 needs sm_90");
#endif

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* k_tile = reinterpret_cast<A*>(smem_raw);  // [BLOCK_N][LD]
    A* v_tile = k_tile + BLOCK_N * LD;             // [BLOCK_N][LD]
    A* stages = v_tile + BLOCK_N * LD;             // [2][STAGE]: Q [BLOCK_M][LD], dO, [STAT_SLOTS][BLOCK_M]
    constexpr unsigned SMEM_BYTES = sizeof(A) * (2 * BLOCK_N * LD + 2 * STAGE);
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const A scale_log2 = scale_log2_in<A>(p), scale = scale_in<A>(p);
    const A to_log2 = sizeof(A) == sizeof(double) ? A(p.lse_to_log2_f64) : A(p.lse_to_log2);
    const int n0 = blockIdx.x * BLOCK_N;
    const int head_kv = blockIdx.y, batch = seq.batch, group = p.group;
    // Past a shorter sequence's end. A sequence without queries still stores dK = dV = 0 below.
    if (Mask::PACKED && n0 >= seqlen_k) return;
    const Mask mask = cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seqlen_q, seqlen_k);
    const A drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int w0 = warp * WARP_KEYS;

    cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(k_tile, p.k.row<const A>(batch, seq.k_begin, head_kv), n0,
                                                     seqlen_k, p.headdim, p.k.row_stride);
    cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(v_tile, p.v.row<const A>(batch, seq.k_begin, head_kv), n0,
                                                     seqlen_k, p.headdim_v, p.v.row_stride);

    // The walk: the query blocks that see some key of this block, for each head of the group
    // (block_walk.cuh); step s is the walk's iteration s.
    const QueryBlockWalk<BLOCK_M> walk(mask, n0, BLOCK_N, group);
    const int steps = walk.iters;
    const A* lse = static_cast<const A*>(p.lse);
    const A* delta = static_cast<const A*>(p.delta);
    const A* weight = static_cast<const A*>(p.weight);
    const A* dp_ref = static_cast<const A*>(p.dp_ref);
    auto load_step = [&](int step, int stage) {
        const int head = walk.head(head_kv, step), m0 = walk.row(step);
        A* q_stage = stages + stage * STAGE;
        cp_async_rows_scalar<BLOCK_M, D_TILE, LD, NTHREADS>(q_stage, p.q.row<const A>(batch, seq.q_begin, head), m0,
                                                         seqlen_q, p.headdim, p.q.row_stride);
        cp_async_rows_scalar<BLOCK_M, D_TILE, LD, NTHREADS>(q_stage + BLOCK_M * LD,
                                                         p.dout.row<const A>(batch, seq.q_begin, head), m0, seqlen_q,
                                                         p.headdim_v, p.dout.row_stride);
        if (threadIdx.x < BLOCK_M) {
            const int i = threadIdx.x;
            const bool valid = m0 + i < seqlen_q;
            const i64 stat = seq.stat(p, head, valid ? m0 + i : 0);
            cp_async_row_stats(smem_u32(q_stage + 2 * BLOCK_M * LD + i), static_cast<u32>(sizeof(A)) * BLOCK_M, lse,
                               delta, weight, dp_ref, stat, valid);
        }
    };
    if (steps > 0) load_step(0, 0);
    cp_async_commit();

    A dk[D_TILE / 8][M_TILES][2], dv[D_TILE / 8][M_TILES][2];
#pragma unroll
    for (int dn = 0; dn < D_TILE / 8; ++dn)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) dk[dn][mt][0] = dk[dn][mt][1] = dv[dn][mt][0] = dv[dn][mt][1] = A(0);

    for (int step = 0; step < steps; ++step) {
        const int stage = step & 1;
        // this step's tiles (and, the first time, K and V) have landed, and every warp is done with
        // the previous step's stage: the next step may overwrite it
        cp_async_wait<0>();
        __syncthreads();
        if (step + 1 < steps) {
            load_step(step + 1, stage ^ 1);
            cp_async_commit();
        }
        const int head = walk.head(head_kv, step), m0 = walk.row(step);
        const A* q_tile = stages + stage * STAGE;
        const A* do_tile = q_tile + BLOCK_M * LD;
        const A* stat_tile = do_tile + BLOCK_M * LD;
        // raw scores: the unit is the scale
        const ScoreOf<Mask, A> score(score_problem<Mask>(p, seq), seq.index, head, scale);
        const DropoutOf<Mask> dropout(p, seq.index, head);

        // S^T = K Q^T, dP^T = V dO^T
        A st[Q_TILES][M_TILES][2], dpt[Q_TILES][M_TILES][2];
        dmma_rows_times_rows<D_TILE, Q_TILES, LD, M_TILES, WIDE, true>(st, k_tile + (w0 + g) * LD + t,
                                                                      q_tile + g * LD + t);
        dmma_rows_times_rows<D_TILE, Q_TILES, LD, M_TILES, WIDE, true>(dpt, v_tile + (w0 + g) * LD + t,
                                                                      do_tile + g * LD + t);

        // P^T (times Z under dropout) into st, dS^T into dpt
#pragma unroll
        for (int j = 0; j < Q_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int qi = 8 * j + 2 * t + e, q_row = m0 + qi;
                // lse = -inf marks a row with no visible key: P = 0, as a row past the end
                const A top = q_row < seqlen_q ? stat_tile[STAT_LSE * BLOCK_M + qi] * to_log2 : neg_inf<A>();
                const A row_weight = weight != nullptr ? stat_tile[STAT_WEIGHT * BLOCK_M + qi] : A(1);
                const A row_dp_ref = dp_ref != nullptr ? stat_tile[STAT_DP_REF * BLOCK_M + qi] : A(0);
                const A row_delta = stat_tile[STAT_DELTA * BLOCK_M + qi];
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    const auto x = score_entry(st[j][mt][e], dpt[j][mt][e], q_row, n0 + w0 + 8 * mt + g,
                                                     top == neg_inf<A>(), mask, score, dropout, drop_scale);
                    const A p_ij = x.hidden ? A(0) : recomputed_p_exact(x.s, scale_log2, top, row_weight);
                    st[j][mt][e] = x.kept ? p_ij : A(0);
                    dpt[j][mt][e] = ds_entry<Mask>(x, p_ij, row_dp_ref, row_delta);
                }
            }

        // dV += P^T dO, dK += dS^T Q
        dmma_acc_times_rows<D_TILE, Q_TILES, LD, M_TILES, WIDE>(dv, st, do_tile + 2 * t * LD + g);
        dmma_acc_times_rows<D_TILE, Q_TILES, LD, M_TILES, WIDE>(dk, dpt, q_tile + 2 * t * LD + g);
    }
    cp_async_wait<0>();  // K and V's copies, where no query block was walked

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        const int key = n0 + w0 + 8 * mt + g;
        if (key >= seqlen_k) continue;
        A* dk_row = p.dk.row<A>(batch, seq.k_begin + key, head_kv);
        A* dv_row = p.dv.row<A>(batch, seq.k_begin + key, head_kv);
#pragma unroll
        for (int dn = 0; dn < D_TILE / 8; ++dn)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * dn + 2 * t + e;
                if (col < p.headdim) dk_row[col] = dk[dn][mt][e] * scale;
                if (col < p.headdim_v) dv_row[col] = dv[dn][mt][e] * drop_scale;
            }
    }
}

}  // namespace cf
