// The float32 backward's tile steps on tf32 wgmma (sm_90a), shared by flash_bwd_dkdv_tf32_wgmma.cu
// and flash_bwd_dq_tf32_wgmma.cu (docs/perf-log.md tf32-wgmma-bwd-v0): the rows-times-rows
// products S = Q K^T / dP = dO V^T (and their transposes) from split panel tiles, and the store of
// a warpgroup's 64 accumulator rows. The accumulator-times-tile products (dV, dK, dQ) are
// wgmma_tf32.cuh's tf32_acc_times_tile, the forward's O += P V.
#pragma once

#include "common.cuh"
#include "wgmma_tf32.cuh"

namespace cf {

// One k-step of A B^T for tf32_product_sums: A of A_ROWS rows (64, wgmma's M) and B of B_ROWS rows
// (wgmma's N), both K-major panel tiles in shared memory, hi and lo; the small products (lo hi,
// hi lo; PRODUCTS 3) into `small`, starting at k-step 0, and hi hi into `hh`. S^T = K Q^T in the
// dK/dV kernel (A = K, B = Q), S = Q K^T in the dQ kernel (A = Q, B = K), and dP's likewise.
template <int A_ROWS, int B_ROWS, int PRODUCTS = 3>
struct Tf32RowsTimesRows {
    u32 a_hi, a_lo, b_hi, b_lo;  // tiles
    __device__ __forceinline__ void operator()(int kk, float (&small)[B_ROWS / 2], float (&hh)[B_ROWS / 2],
                                               int hh_accumulates) const {
        const u64 a_hi_desc = tf32_k_step_desc<A_ROWS>(a_hi, kk), b_hi_desc = tf32_k_step_desc<B_ROWS>(b_hi, kk);
        if constexpr (Tf32Operand<PRODUCTS>::SPLIT) {
            WgmmaTf32<B_ROWS>::ss(small, tf32_k_step_desc<A_ROWS>(a_lo, kk), b_hi_desc, kk > 0);
            WgmmaTf32<B_ROWS>::ss(small, a_hi_desc, tf32_k_step_desc<B_ROWS>(b_lo, kk), 1);
        }
        WgmmaTf32<B_ROWS>::ss(hh, a_hi_desc, b_hi_desc, hh_accumulates);
    }
};

// S and dP (the dK/dV kernel: S^T and dP^T) of a block, one product after the other (each
// PRODUCTS tf32 products a k-step, apart with APART: tf32_product_sums), both waited for.
template <int K_STEPS, bool APART, int A_ROWS, int B_ROWS, int PRODUCTS>
__device__ __forceinline__ void tf32_scores_and_dp(float (&s)[B_ROWS / 2], float (&dp)[B_ROWS / 2],
                                                   const Tf32RowsTimesRows<A_ROWS, B_ROWS, PRODUCTS>& s_tiles,
                                                   const Tf32RowsTimesRows<A_ROWS, B_ROWS, PRODUCTS>& dp_tiles) {
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT;
    tf32_product_sums<B_ROWS / 2, K_STEPS, SPLIT, APART>(s, s_tiles, NoTurns());
    tf32_product_sums<B_ROWS / 2, K_STEPS, SPLIT, APART>(dp, dp_tiles, NoTurns());
}

// A warpgroup's 64 x D_TILE accumulator (value 4 j + 2 h + e of a thread: row 16 warp + g + 8 h,
// column 8 j + 2 t + e) times `scale`, stored as float32 pairs to rows row0 + r < rows_valid
// (row_at(r): the row's first element) and columns < columns (a multiple of 4: a pair is
// stored whole or not at all).
template <int D_TILE, class RowAt>
__device__ __forceinline__ void store_acc_rows_f32(const float (&acc)[D_TILE / 2], float scale, int rows_valid,
                                                   int columns, const RowAt& row_at, int warp, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 16 * warp + g + 8 * h;
        if (row >= rows_valid) continue;
        float* const out = row_at(row);
#pragma unroll
        for (int j = 0; j < D_TILE / 8; ++j) {
            const int col = 8 * j + 2 * t;
            if (col < columns)
                *reinterpret_cast<float2*>(out + col) =
                    make_float2(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
        }
    }
}

}  // namespace cf
