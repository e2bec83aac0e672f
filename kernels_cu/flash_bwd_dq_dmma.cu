// flash_bwd_dq_dmma: dQ of the float64 backward on the FP64 tensor cores (issue 18), one block per
// query block walking the key blocks, P and dS recomputed; the family's plan (backward_plans,
// "dmma") runs flash_bwd_preprocess or flash_bwd_stats_dmma, flash_bwd_dkdv_dmma, then this.
//
// The CTA, its tiles and its walk over the key blocks are dmma_bwd_steps.cuh's DmmaQueryCta (shared
// with flash_bwd_stats_dmma). Per key block: S = Q K^T and dP = dO V^T, the policies and
// dS = P (dP - D) entry by entry in the accumulators' lanes, dQ += dS K with dS as the A
// fragment. Everything float64; the products are exact-rounded double FMAs as in the SIMT
// kernels, only summed in another order.
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

template <int D_TILE, class Mask, int BLOCK_N, int NWARPS, int M_TILES = 2, bool WIDE = false,
          typename T = double>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dq_dmma(const __grid_constant__ BwdParams p) {
    typedef T A;  // double: DMMA; float: three tf32 products (experiment)
    typedef DmmaQueryCta<D_TILE, Mask, BLOCK_N, NWARPS, M_TILES, WIDE, A> Cta;
    constexpr int N_TILES = Cta::N_TILES, LD = Cta::LD;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_bytes() < Cta::SMEM_BYTES) __trap();
    const Cta cta(p, smem_raw);
    if (cta.past_end()) return;
    const int head = cta.head, g = cta.g, t = cta.t;
    // raw scores: the unit is the scale
    const ScoreOf<Mask, A> score(score_problem<Mask>(p, cta.seq), cta.seq.index, head, cta.scale);
    const DropoutOf<Mask> dropout(p, cta.seq.index, head);
    const A drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1);

    // this thread's rows (g + 8 mt of the warp's) and their statistics, read while Q and dO land
    int q_row[M_TILES];
    RowStats<A> stats[M_TILES];
    A delta[M_TILES];
    A dq[D_TILE / 8][M_TILES][2];
    auto rows = [&] {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            q_row[mt] = cta.m0 + cta.w0 + 8 * mt + g;
            const bool valid = q_row[mt] < cta.seq.seqlen_q;
            const i64 stat = cta.seq.stat(p, head, q_row[mt]);
            stats[mt] = valid ? row_stats<A>(p, stat) : no_row_stats<A>();
            delta[mt] = valid ? ldg(static_cast<const A*>(p.delta) + stat) : A(0);
        }
#pragma unroll
        for (int dn = 0; dn < D_TILE / 8; ++dn)
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) dq[dn][mt][0] = dq[dn][mt][1] = A(0);
    };

    cta.walk(p, rows, [&](int n0, const A* k_tile, A(&s)[N_TILES][M_TILES][2], const A(&dp)[N_TILES][M_TILES][2]) {
        // dS = P (dP - D), P = exp2(S - lse) from the row's statistics, into s
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const auto x = score_entry(s[n][mt][e], dp[n][mt][e], q_row[mt], n0 + 8 * n + 2 * t + e,
                                               stats[mt].top == neg_inf<A>(), cta.mask, score, dropout, drop_scale);
                    const A p_ij = recomputed_p_exact(x.s, cta.scale_log2, stats[mt].top, stats[mt].weight);
                    s[n][mt][e] = ds_entry<Mask>(x, p_ij, stats[mt].dp_ref, delta[mt]);
                }
        // dQ += dS K
        dmma_acc_times_rows<D_TILE, N_TILES, LD, M_TILES, WIDE>(dq, s, k_tile + 2 * t * LD + g);
    });

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        if (q_row[mt] >= cta.seq.seqlen_q) continue;
        A* dq_row = p.dq.row<A>(cta.seq.batch, cta.seq.q_begin + q_row[mt], head);
#pragma unroll
        for (int dn = 0; dn < D_TILE / 8; ++dn)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * dn + 2 * t + e;
                if (col < p.headdim) dq_row[col] = dq[dn][mt][e] * cta.scale;
            }
    }
}

}  // namespace cf
