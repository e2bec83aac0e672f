// The SIMT backward's tile step that more than one of its kernels takes, written once so that
// they agree to the bit: flash_bwd_stats_simt's row statistics must be those of the very scores
// and dP that flash_bwd_dq_simt (this step) and flash_bwd_dkdv_simt (its transpose) form.
//
// Why the bits matter: with recomputed statistics (backward_plans, statistics="recomputed") a
// one-hot row has top = its key's score and dp_ref = its key's dP exactly and weight = 1, so the
// backward's P = 2^(x - top) weight = 1 and dS = P ((dP - dp_ref) - D') = -D', the other keys'
// small sum (0 where their weights underflow), where D from the saved o leaves eps |dO| |V|. flash_bwd_dkdv_simt forms the same values in its transposed
// step: row_dots over d = 0, 1, ... (fma(k_d, q_d) is fma(q_d, k_d)), the same score transform,
// recomputed_p_exact and dropout scale.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// S and dP of row `q_row` against the keys n0 + lane_in_row + TPR j of the tile, j < N: q and dO
// rows of LD-strided shared tiles, k and v tiles of BLOCK_N rows with the same stride. For each
// key, visit(j, s, dp, dsds, hidden) receives the score after the score policy's transform (raw
// units: the scale), dP = dO_i . V_j (times Z_ij / (1 - p) under dropout, 0 where dropped),
// ds'/ds of the policy (unset without a derivative) and whether the mask hides the key (or the
// row sees none: row_sees_nothing). One key at a time, so that a kernel holds no per-key arrays
// beyond S and dP (flash_bwd_dq_simt's dropout kernels spilled with four).
template <int D_TILE, int TPR, int LD, int N, class Mask, typename A, class Visit>
__device__ __forceinline__ void simt_row_tile(const A* q_row_tile, const A* do_row_tile, const A* k_tile,
                                              const A* v_tile, int lane_in_row, int q_row, int n0,
                                              bool row_sees_nothing, const Mask& mask,
                                              const ScoreOf<Mask, A>& score, const DropoutOf<Mask>& dropout,
                                              A drop_scale, Visit&& visit) {
    // Dropout's keep bits first, while S and dP hold no registers (the generator's temporaries on
    // top of both arrays spilled flash_bwd_dq_simt at 128 registers).
    static_assert(N <= 32, "one keep bit per key in a word");
    unsigned keep_bits = 0u;
    if constexpr (DropoutOf<Mask>::ENABLED) {
#pragma unroll
        for (int j = 0; j < N; ++j) keep_bits |= unsigned(dropout.keep(q_row, n0 + lane_in_row + TPR * j)) << j;
    }
    A s[N], dp[N];
    row_dots<D_TILE>(s, q_row_tile, k_tile + lane_in_row * LD, TPR * LD);
    row_dots<D_TILE>(dp, do_row_tile, v_tile + lane_in_row * LD, TPR * LD);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int key = n0 + lane_in_row + TPR * j;
        const bool hidden = row_sees_nothing || mask.hides(q_row, key);
        A dsds;
        const A s_ij = score.transform(s[j], score.origin(q_row, key), 0, 0, dsds);
        // Dropout (dropout.cuh): dS = P (Z dP / (1 - p) - D).
        const A dp_ij = !DropoutOf<Mask>::ENABLED ? dp[j] : ((keep_bits >> j) & 1u) ? dp[j] * drop_scale : A(0);
        visit(j, s_ij, dp_ij, dsds, hidden);
    }
}

}  // namespace cf
