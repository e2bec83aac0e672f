// The two products of the mma.sync forward kernels (flash_fwd_mma.cu, flash_fwd_kvcache_mma.cu)
// on a warp's strips of 16 query rows: S = Q K^T and O += P V from swizzled shared tiles.
#pragma once

#include "mma.cuh"

namespace cf {

// S = Q K^T for the warp's strips. Q fragments come from registers (Q_STEPS == D_TILE / 16) or
// from the warp's rows of the shared Q tile (q_rows: the tile address of its first row).
// K is stored [key][dim], so its non-transposed ldmatrix gives B = K^T directly; one x4 load
// covers 16 keys: b[0], b[1] for keys 8f.. and b[2], b[3] for keys 8(f + 1)..
template <typename T, int D_TILE, int M_STRIPS, int N_FRAGS, int Q_STEPS>
__device__ __forceinline__ void mma_qk(float (&s)[M_STRIPS][N_FRAGS][4],
                                       const u32 (&q_frag)[M_STRIPS][Q_STEPS][4], u32 q_rows,
                                       const FragmentAddress<D_TILE>& a_addr, u32 k_tile,
                                       const FragmentAddress<D_TILE>& k_addr) {
    constexpr bool Q_IN_REGS = Q_STEPS == D_TILE / 16;
    zero_acc(s);
#pragma unroll
    for (int kk = 0; kk < D_TILE / 16; ++kk) {
        u32 a[M_STRIPS][4];
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i) {
            if constexpr (Q_IN_REGS) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[i][e] = q_frag[i][kk][e];
            } else {
                ldmatrix_x4(a[i], a_addr(q_rows, i, kk));
            }
        }
#pragma unroll
        for (int f = 0; f < N_FRAGS; f += 2) {
            u32 b[4];
            ldmatrix_x4(b, k_addr(k_tile, f / 2, kk));
#pragma unroll
            for (int i = 0; i < M_STRIPS; ++i) {
                mma_16816<T>(s[i][f], a[i], b[0], b[1]);
                mma_16816<T>(s[i][f + 1], a[i], b[2], b[3]);
            }
        }
    }
}

// O += P V. V is stored [key][dim]; its transposed ldmatrix gives B = V, one x4 load covering
// output columns 8f..8f+15.
template <typename T, int D_TILE, int M_STRIPS, int P_STEPS, int D_FRAGS>
__device__ __forceinline__ void mma_pv(float (&o)[M_STRIPS][D_FRAGS][4],
                                       const u32 (&p)[M_STRIPS][P_STEPS][4], u32 v_tile,
                                       const FragmentAddress<D_TILE>& v_addr) {
#pragma unroll
    for (int kk = 0; kk < P_STEPS; ++kk) {
#pragma unroll
        for (int f = 0; f < D_FRAGS; f += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, v_addr(v_tile, kk, f / 2));
#pragma unroll
            for (int i = 0; i < M_STRIPS; ++i) {
                mma_16816<T>(o[i][f], p[i][kk], b[0], b[1]);
                mma_16816<T>(o[i][f + 1], p[i][kk], b[2], b[3]);
            }
        }
    }
}

}  // namespace cf
