// The FP64 tensor-core products (DMMA) of the float64 kernels: flash_fwd_dmma and the float64
// backward (flash_bwd_dkdv_dmma, flash_bwd_dq_dmma, flash_bwd_stats_dmma; issue 18).
//
// Fragments of m8n8k4 .f64 (sm_80+), lane = 4 g + t:
//   A (8 x 4, row): a = A[g][t]      B (4 x 8, col): b = B[t][g]      C (8 x 8): c0, c1 = C[g][2t], C[g][2t + 1]
// and of sm_90's m16n8k8 .f64, the same work as two 8-row m-tiles (rows g, g + 8) over two k-steps
// of 4 (k = t, t + 4): dmma_m16n8k8 below.
#pragma once

#include "common.cuh"

namespace cf {

// D = A B + C, one m8n8k4 float64 product (c and d may alias).
__device__ __forceinline__ void dmma_m8n8k4(double (&d)[2], double a, double b, const double (&c)[2]) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%4, %5};\n"
                 : "=d"(d[0]), "=d"(d[1])
                 : "d"(a), "d"(b), "d"(c[0]), "d"(c[1]));
}

// The same work as four m8n8k4 products of two 8-row m-tiles over two k-steps, as one sm_90
// m16n8k8 product (perf log dmma-fwd-v2): rows g and g + 8 are m-tiles 0 and 1, k = t and t + 4
// the two k-steps' t. A: a[mt][step], B: b[step], C, D: c[mt][e] (rows g + 8 mt, columns 2t + e),
// PTX's a0..a3 = (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4), b0, b1 = (t, g), (t + 4, g) and
// c0..c3 = (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
template <bool ON_SM90>
__device__ __forceinline__ void dmma_m16n8k8(double (&c0)[2], double (&c1)[2], double a00, double a10, double a01,
                                             double a11, double b0, double b1) {
    if constexpr (ON_SM90) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+d"(c0[0]), "+d"(c0[1]), "+d"(c1[0]), "+d"(c1[1])
                     : "d"(a00), "d"(a10), "d"(a01), "d"(a11), "d"(b0), "d"(b1));
    }
}

// C[mt] += A[mt] B over one k-step of 8 for M_TILES 8-row m-tiles (rows g + 8 mt): k-halves h = 0, 1
// are k = t and t + 4, a[mt][h] = A[g + 8 mt][k], b0 = B[t][g], b1 = B[t + 4][g]. WIDE (sm_90,
// M_TILES 2): one m16n8k8; otherwise two m8n8k4 per m-tile, the k-halves in order.
//
// The accumulator of a product, c[mt][e] = C[g + 8 mt][2t + e], is this A fragment as it is when
// the next product sums over C's columns (the C -> A trick of the forward's O += P V): k-half e is
// column 2t + e, so B's rows must be read in that order, b0 = B[2t][g], b1 = B[2t + 1][g]. The
// keys (or queries) of a sum go in any order; the fragment never leaves its lanes.
template <bool WIDE, int M_TILES>
__device__ __forceinline__ void dmma_k8(double (&c)[M_TILES][2], const double (&a)[M_TILES][2], double b0, double b1) {
    if constexpr (WIDE) {
        static_assert(M_TILES == 2, "m16n8k8 takes two 8-row m-tiles");
        dmma_m16n8k8<true>(c[0], c[1], a[0][0], a[1][0], a[0][1], a[1][1], b0, b1);
    } else {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) dmma_m8n8k4(c[mt], a[mt][0], b0, c[mt]);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) dmma_m8n8k4(c[mt], a[mt][1], b1, c[mt]);
    }
}

}  // namespace cf
