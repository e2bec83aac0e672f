// The SIMT backward's tile steps that more than one of its kernels take, written once so that
// they agree to the bit: flash_bwd_stats_simt's row statistics must be those of the very scores
// and dP that flash_bwd_dq_simt (this step) and flash_bwd_dkdv_simt (its transpose) form.
//
// Why the bits matter: with recomputed statistics (backward_plans, statistics="recomputed") a
// one-hot row has m = its key's score exactly, l = 1 and D = that key's dP, so the backward's
// P = 1 and dS = P (dP - D) = 0 exactly, as in standard attention. flash_bwd_dkdv_simt forms the
// same values in its transposed step: row_dots over d = 0, 1, ... (fma(k_d, q_d) is
// fma(q_d, k_d)), the same score transform, recomputed_p_exact and dropout scale.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// One lane's N keys of a key tile, for its row i, after simt_row_tile.
template <typename A, int N>
struct SimtRowTile {
    A s[N];          // the score after the score policy's transform (raw units: the scale)
    A dp[N];         // dP_ij = dO_i . V_j, times Z_ij / (1 - p) under dropout (0 where dropped)
    A dsds[N];       // ds'/ds of the score policy (unset without a derivative)
    bool hidden[N];  // the mask hides key j from row i, or row i sees no key (lse = -inf)
};

// S and dP of row `q_row` against the keys n0 + lane_in_row + TPR j of the tile, j < N: q and dO
// rows of LD-strided shared tiles, k and v tiles of BLOCK_N rows with the same stride.
template <int D_TILE, int TPR, int LD, class Mask, typename A, int N>
__device__ __forceinline__ void simt_row_tile(SimtRowTile<A, N>& t, const A* q_row_tile, const A* do_row_tile,
                                              const A* k_tile, const A* v_tile, int lane_in_row, int q_row,
                                              int n0, bool row_sees_nothing, const Mask& mask,
                                              const ScoreOf<Mask, A>& score, const DropoutOf<Mask>& dropout,
                                              A drop_scale) {
    row_dots<D_TILE>(t.s, q_row_tile, k_tile + lane_in_row * LD, TPR * LD);
    row_dots<D_TILE>(t.dp, do_row_tile, v_tile + lane_in_row * LD, TPR * LD);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int key = n0 + lane_in_row + TPR * j;
        t.hidden[j] = row_sees_nothing || mask.hides(q_row, key);
        t.s[j] = score.transform(t.s[j], score.origin(q_row, key), 0, 0, t.dsds[j]);
        // Dropout (dropout.cuh): dS = P (Z dP / (1 - p) - D).
        if constexpr (DropoutOf<Mask>::ENABLED) t.dp[j] = dropout.keep(q_row, key) ? t.dp[j] * drop_scale : A(0);
    }
}

}  // namespace cf
