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
#include "tf32.cuh"

namespace cf {

// C[n] = A B_n^T over DIM columns, C in the accumulator layout: A's rows g + 8 mt at a_frag + 8 mt LD
// (a_frag: row g, column t of an LD-strided tile), B's rows 8 n + g at b_frag + 8 n LD (the same
// offsets). C starts at zero.
template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE, bool TRANSPOSED = false>
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

// The same two steps on float32 (experiment: the float32 backward on these kernels): each
// product as three tf32 products of split operands, each k-step's three summed apart and added
// with one rounding (tf32.cuh's mma_tf32, STEP_SUMS: "ieee" accuracy), in m16n8k8's layout,
// which is m16n8k8 .f64's: two 8-row m-tiles, k-halves t and t + 4 (M_TILES 2 only).
//
// TRANSPOSED (the dK/dV kernel's S^T = K Q^T, dP^T = V dO^T): the two small products in the order
// of the query-side kernels' S = Q K^T (q_lo k_hi, then q_hi k_lo, there a_lo b_hi then a_hi b_lo),
// so that every entry is the same sum of the same products in the same order: the tensor core's
// accumulation truncates, and another order could change S's last bit, which statistics
// "recomputed" needs to the bit. (One .f64 product per k-step has no such order: TRANSPOSED is
// accepted there and changes nothing.)
template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE, bool TRANSPOSED = false>
__device__ __forceinline__ void dmma_rows_times_rows(float (&c)[N_TILES][M_TILES][2], const float* a_frag,
                                                     const float* b_frag) {
    static_assert(M_TILES == 2, "m16n8k8 .tf32 takes two 8-row m-tiles");
#pragma unroll
    for (int n = 0; n < N_TILES; ++n) c[n][0][0] = c[n][0][1] = c[n][1][0] = c[n][1][1] = 0.f;
    // rolled: unrolled, ptxas overlaps the k-steps' separate sums and spills (tf32.cuh, STEP_SUMS)
#pragma unroll 1
    for (int ks = 0; ks < DIM / 8; ++ks) {
        u32 a_hi[4], a_lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)  // a0..a3 = (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)
            split_tf32<3>(a_frag[8 * (i % 2) * LD + 8 * ks + 4 * (i / 2)], a_hi[i], a_lo[i]);
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) {
            u32 b_hi0, b_lo0, b_hi1, b_lo1;
            split_tf32<3>(b_frag[8 * n * LD + 8 * ks], b_hi0, b_lo0);
            split_tf32<3>(b_frag[8 * n * LD + 8 * ks + 4], b_hi1, b_lo1);
            // mma_tf32<3, STEP_SUMS>'s step, its two small products in the query-side order
            float step[4] = {0.f, 0.f, 0.f, 0.f};
            if constexpr (TRANSPOSED) {
                mma_1688_tf32(step, a_hi, b_lo0, b_lo1);
                mma_1688_tf32(step, a_lo, b_hi0, b_hi1);
            } else {
                mma_1688_tf32(step, a_lo, b_hi0, b_hi1);
                mma_1688_tf32(step, a_hi, b_lo0, b_lo1);
            }
            mma_1688_tf32(step, a_hi, b_hi0, b_hi1);
            float(&acc)[4] = reinterpret_cast<float(&)[4]>(c[n]);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], step[e]);
        }
    }
}

template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE>
__device__ __forceinline__ void dmma_acc_times_rows(float (&c)[DIM / 8][M_TILES][2],
                                                    const float (&pm)[N_TILES][M_TILES][2], const float* b_rows) {
    static_assert(M_TILES == 2, "m16n8k8 .tf32 takes two 8-row m-tiles");
#pragma unroll
    for (int n = 0; n < N_TILES; ++n) {
        u32 a_hi[4], a_lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) split_tf32<3>(pm[n][i % 2][i / 2], a_hi[i], a_lo[i]);
#pragma unroll
        for (int dn = 0; dn < DIM / 8; ++dn) {
            u32 b_hi0, b_lo0, b_hi1, b_lo1;
            split_tf32<3>(b_rows[8 * n * LD + 8 * dn], b_hi0, b_lo0);
            split_tf32<3>(b_rows[8 * n * LD + LD + 8 * dn], b_hi1, b_lo1);
            mma_tf32<3, true>(reinterpret_cast<float(&)[4]>(c[dn]), a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1);
        }
    }
}

// One entry of S and dP (raw units: the unit is the scale) after the policies, as every float64
// backward kernel takes it: the score policy's transform and ds'/ds (unset without a derivative),
// whether the mask hides the key (or the row sees none: row_sees_nothing), whether dropout keeps
// it, and dP times Z / (1 - p) (0 where dropped: dropout.cuh).
template <typename A>
struct ScoreEntry {
    A s, dp, dsds;
    bool hidden, kept;
};

template <class Mask, typename A>
__device__ __forceinline__ ScoreEntry<A> score_entry(A s, A dp, int q_row, int key, bool row_sees_nothing,
                                                     const Mask& mask, const ScoreOf<Mask, A>& score,
                                                     const DropoutOf<Mask>& dropout, A drop_scale) {
    ScoreEntry<A> x;
    x.hidden = row_sees_nothing || mask.hides(q_row, key);
    x.s = score.transform(s, score.origin(q_row, key), 0, 0, x.dsds);
    x.kept = !DropoutOf<Mask>::ENABLED || dropout.keep(q_row, key);
    x.dp = !DropoutOf<Mask>::ENABLED ? dp : x.kept ? dp * drop_scale : A(0);
    return x;
}

// dS of an entry from P and its row's statistics: 0 where hidden, times ds'/ds with a derivative.
template <class Mask, typename A>
__device__ __forceinline__ A ds_entry(const ScoreEntry<A>& x, A p_ij, A dp_ref, A delta) {
    const A ds = ds_of(p_ij, x.dp, dp_ref, delta);
    return x.hidden ? A(0) : Mask::Score::HAS_GRAD ? ds * x.dsds : ds;
}

}  // namespace cf
