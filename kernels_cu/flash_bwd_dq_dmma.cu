// flash_bwd_dq_dmma: dQ of the float64 backward on the FP64 tensor cores (issue 18), one block per
// query block walking the key blocks, P and dS recomputed; the family's plan (backward_plans,
// "dmma") runs flash_bwd_preprocess or flash_bwd_stats_dmma, flash_bwd_dkdv_dmma, then this.
//
// A warp owns WARP_ROWS = 8 M_TILES query rows and the block's Q and dO rows stay in shared memory;
// each key block's K and V come in by cp.async into the stage the previous block does not read,
// while that block computes. Per key block: S = Q K^T and dP = dO V^T (dmma_bwd_steps.cuh), the
// policies and dS = P (dP - D) entry by entry in the accumulators' lanes, dQ += dS K with dS as
// the A fragment. Everything float64; the products are exact-rounded double FMAs as in the SIMT
// kernels, only summed in another order.
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// Rows padded by 4 doubles (LD = 4 mod 16): S's fragments read rows g, columns t, whose eight rows
// then start 8 banks apart (every half-warp's 16 doubles in distinct banks, as flash_fwd_dmma's Q
// and K). dQ's B fragments read K's rows 2t, columns g: a 2-way conflict per half-warp there.
template <int D_TILE, class Mask, int BLOCK_N, int NWARPS, int M_TILES = 2, bool WIDE = false,
          typename T = double>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dq_dmma(const __grid_constant__ BwdParams p) {
    typedef T A;  // double: DMMA; float: three tf32 products (experiment)
    constexpr int WARP_ROWS = 8 * M_TILES;
    constexpr int BLOCK_M = WARP_ROWS * NWARPS;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int N_TILES = BLOCK_N / 8;
    constexpr int LD = D_TILE + 4;
    static_assert(D_TILE % 8 == 0 && BLOCK_N % 8 == 0, "m8n8k4 tiles");
    static_assert(!WIDE || M_TILES == 2, "m16n8k8 takes two 8-row m-tiles");
    static_assert(sizeof(A) == 8 || M_TILES == 2, "m16n8k8 .tf32 takes two 8-row m-tiles");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!WIDE || sizeof(A) == 4, "m16n8k8 .f64 needs sm_90");
#endif

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* q_tile = reinterpret_cast<A*>(smem_raw);  // [BLOCK_M][LD]
    A* do_tile = q_tile + BLOCK_M * LD;            // [BLOCK_M][LD]
    A* kv_tiles = do_tile + BLOCK_M * LD;          // [2 stages][K, V][BLOCK_N][LD]
    constexpr unsigned SMEM_BYTES = sizeof(A) * (2 * BLOCK_M * LD + 4 * BLOCK_N * LD);
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const A scale_log2 = scale_log2_in<A>(p), scale = scale_in<A>(p);
    const Mask mask = cta_mask<Mask>(p, seq.index, seqlen_q, seqlen_k);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    const int head = blockIdx.y, batch = seq.batch, head_kv = head / p.group;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    // raw scores: the unit is the scale
    const ScoreOf<Mask, A> score(score_problem<Mask>(p, seq), seq.index, head, scale);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const A drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int w0 = warp * WARP_ROWS;

    const A* __restrict__ k_base = p.k.row<const A>(batch, seq.k_begin, head_kv);
    const A* __restrict__ v_base = p.v.row<const A>(batch, seq.k_begin, head_kv);
    const int n_begin = mask.key_begin(m0) / BLOCK_N * BLOCK_N;
    const int n_end = mask.key_end(m0, BLOCK_M);
    auto load_kv = [&](int n0, int stage) {
        A* k_stage = kv_tiles + 2 * stage * BLOCK_N * LD;
        cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(k_stage, k_base, n0, seqlen_k, p.headdim, p.k.row_stride);
        cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(k_stage + BLOCK_N * LD, v_base, n0, seqlen_k, p.headdim_v,
                                                         p.v.row_stride);
    };
    if (n_begin < n_end) load_kv(n_begin, 0);
    cp_async_rows_scalar<BLOCK_M, D_TILE, LD, NTHREADS>(q_tile, p.q.row<const A>(batch, seq.q_begin, head), m0, seqlen_q,
                                                     p.headdim, p.q.row_stride);
    cp_async_rows_scalar<BLOCK_M, D_TILE, LD, NTHREADS>(do_tile, p.dout.row<const A>(batch, seq.q_begin, head), m0,
                                                     seqlen_q, p.headdim_v, p.dout.row_stride);
    cp_async_commit();

    // this thread's rows (g + 8 mt of the warp's) and their statistics
    int q_row[M_TILES];
    RowStats<A> stats[M_TILES];
    A delta[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        q_row[mt] = m0 + w0 + 8 * mt + g;
        const bool valid = q_row[mt] < seqlen_q;
        const i64 stat = seq.stat(p, head, q_row[mt]);
        stats[mt] = valid ? row_stats<A>(p, stat) : no_row_stats<A>();
        delta[mt] = valid ? ldg(static_cast<const A*>(p.delta) + stat) : A(0);
    }

    A dq[D_TILE / 8][M_TILES][2];
#pragma unroll
    for (int dn = 0; dn < D_TILE / 8; ++dn)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) dq[dn][mt][0] = dq[dn][mt][1] = A(0);

    int stage = 0;
    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N, stage ^= 1) {
        // this block's K and V (and, the first time, Q and dO) have landed, and every warp is done
        // with the previous block's stage: the next block may overwrite it
        cp_async_wait<0>();
        __syncthreads();
        if (n0 + BLOCK_N < n_end) {
            load_kv(n0 + BLOCK_N, stage ^ 1);
            cp_async_commit();
        }
        const A* k_tile = kv_tiles + 2 * stage * BLOCK_N * LD;
        const A* v_tile = k_tile + BLOCK_N * LD;

        // S = Q K^T, dP = dO V^T
        A s[N_TILES][M_TILES][2], dp[N_TILES][M_TILES][2];
        dmma_rows_times_rows<D_TILE, N_TILES, LD, M_TILES, WIDE>(s, q_tile + (w0 + g) * LD + t, k_tile + g * LD + t);
        dmma_rows_times_rows<D_TILE, N_TILES, LD, M_TILES, WIDE>(dp, do_tile + (w0 + g) * LD + t, v_tile + g * LD + t);

        // dS = P (dP - D), P = exp2(S - lse) from the row's statistics, into s
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const auto x = score_entry(s[n][mt][e], dp[n][mt][e], q_row[mt], n0 + 8 * n + 2 * t + e,
                                                     stats[mt].top == neg_inf<A>(), mask, score, dropout, drop_scale);
                    const A p_ij = recomputed_p_exact(x.s, scale_log2, stats[mt].top, stats[mt].weight);
                    s[n][mt][e] = ds_entry<Mask>(x, p_ij, stats[mt].dp_ref, delta[mt]);
                }

        // dQ += dS K
        dmma_acc_times_rows<D_TILE, N_TILES, LD, M_TILES, WIDE>(dq, s, k_tile + 2 * t * LD + g);
    }
    cp_async_wait<0>();  // Q and dO's copies, where no key block was walked

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        if (q_row[mt] >= seqlen_q) continue;
        A* dq_row = p.dq.row<A>(batch, seq.q_begin + q_row[mt], head);
#pragma unroll
        for (int dn = 0; dn < D_TILE / 8; ++dn)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * dn + 2 * t + e;
                if (col < p.headdim) dq_row[col] = dq[dn][mt][e] * scale;
            }
    }
}

}  // namespace cf
