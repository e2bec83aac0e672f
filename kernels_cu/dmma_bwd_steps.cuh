// The float64 backward's tile steps on the FP64 tensor cores (dmma.cuh), written once for its three
// kernels (flash_bwd_dkdv_dmma, flash_bwd_dq_dmma, flash_bwd_stats_dmma; issue 18).
//
// Accumulator layout. A warp's products are c[n][mt][e]: row g + 8 mt of its rows (M_TILES 8-row
// m-tiles), column 8 n + 2t + e. S and dP of the dQ and statistics kernels have the warp's query
// rows as rows and the key block as columns; S^T and dP^T of the dK/dV kernel the warp's keys as
// rows and the query block as columns. Each next product sums over those columns with the
// accumulator as its A fragment (dmma_k8's C -> A order): dQ += dS K, dV += P^T dO, dK += dS^T Q,
// and P, dS never leave their lanes.
//
// Why one S step: statistics="recomputed" (flash_bwd_stats_dmma) must find the very scores and dP
// the gradient kernels form, to the bit (flash_bwd_stats_simt.cu says why). Its kernel and the dQ
// kernel form them with dmma_rows_times_rows on the same tiles; the dK/dV kernel forms the
// transposes with the same function, K Q^T for Q K^T: each entry is the same products (a q_d k_d
// is k_d q_d) summed over the same k in the same order, one product shape (dmma_k8's WIDE) per
// plan. score_entry is the one element step all three take.
#pragma once

#include "common.cuh"
#include "dmma.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// C[n] = A B_n^T over DIM columns, C in the accumulator layout: A's rows g + 8 mt at a_frag + 8 mt LD
// (a_frag: row g, column t of an LD-strided tile), B's rows 8 n + g at b_frag + 8 n LD (the same
// offsets). C starts at zero.
template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE>
__device__ __forceinline__ void dmma_rows_times_rows(double (&c)[N_TILES][M_TILES][2], const double* a_frag,
                                                     const double* b_frag) {
#pragma unroll
    for (int n = 0; n < N_TILES; ++n)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) c[n][mt][0] = c[n][mt][1] = 0.0;
#pragma unroll
    for (int ks = 0; ks < DIM / 8; ++ks) {
        double a[M_TILES][2];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) a[mt][0] = a_frag[8 * mt * LD + 8 * ks], a[mt][1] = a_frag[8 * mt * LD + 8 * ks + 4];
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
            dmma_k8<WIDE, M_TILES>(c[n], a, b_frag[8 * n * LD + 8 * ks], b_frag[8 * n * LD + 8 * ks + 4]);
    }
}

// C[dn] += P B over the N_TILES * 8 columns of P (accumulator layout): B's rows 8 n + 2t and
// 8 n + 2t + 1 at b_rows + 8 n LD and + LD (b_rows: row 2t, column g of an LD-strided tile), C's
// columns 8 dn + 2t + e of DIM.
template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE>
__device__ __forceinline__ void dmma_acc_times_rows(double (&c)[DIM / 8][M_TILES][2],
                                                    const double (&pm)[N_TILES][M_TILES][2], const double* b_rows) {
#pragma unroll
    for (int n = 0; n < N_TILES; ++n)
#pragma unroll
        for (int dn = 0; dn < DIM / 8; ++dn)
            dmma_k8<WIDE, M_TILES>(c[dn], pm[n], b_rows[8 * n * LD + 8 * dn], b_rows[8 * n * LD + LD + 8 * dn]);
}

// One entry of S and dP (raw units: the unit is the scale) after the policies, as every float64
// backward kernel takes it: the score policy's transform and ds'/ds (unset without a derivative),
// whether the mask hides the key (or the row sees none: row_sees_nothing), whether dropout keeps
// it, and dP times Z / (1 - p) (0 where dropped: dropout.cuh).
struct ScoreEntry {
    double s, dp, dsds;
    bool hidden, kept;
};

template <class Mask>
__device__ __forceinline__ ScoreEntry score_entry(double s, double dp, int q_row, int key, bool row_sees_nothing,
                                                  const Mask& mask, const ScoreOf<Mask, double>& score,
                                                  const DropoutOf<Mask>& dropout, double drop_scale) {
    ScoreEntry x;
    x.hidden = row_sees_nothing || mask.hides(q_row, key);
    x.s = score.transform(s, score.origin(q_row, key), 0, 0, x.dsds);
    x.kept = !DropoutOf<Mask>::ENABLED || dropout.keep(q_row, key);
    x.dp = !DropoutOf<Mask>::ENABLED ? dp : x.kept ? dp * drop_scale : 0.0;
    return x;
}

// dS of an entry from P and its row's statistics: 0 where hidden, times ds'/ds with a derivative.
template <class Mask>
__device__ __forceinline__ double ds_entry(const ScoreEntry& x, double p_ij, double dp_ref, double delta) {
    const double ds = ds_of(p_ij, x.dp, dp_ref, delta);
    return x.hidden ? 0.0 : Mask::Score::HAS_GRAD ? ds * x.dsds : ds;
}

}  // namespace cf
