// The backward's probability recompute, one tile step for every backward kernel (SIMT, mma.sync,
// wgmma): P_ij = 2^(S_ij * scale_log2 - lse_i * log2(e)) from the forward's saved lse.
//
// P_ij <= 1 by definition (lse_i is at least every visible scaled score of its row), but the
// exponent is a difference of two large numbers, each rounded: the product S_ij * scale_log2,
// and lse, which went from log2 units to the natural log (the API's lse) and back. At scores of
// order 1e9 and more (16-bit inputs near 6e4) one rounding of that round trip is hundreds in the
// exponent, and 2^(+hundreds) = inf made dS = P (dP - D) inf or NaN (inf * 0) for finite inputs
// that standard attention handles. The exponent is clamped at 0 instead: the row maximum's weight
// is then at most 1 whatever the rounding, as in the forward, where S - m <= 0 holds exactly.
// The clamp keeps NaN (min.NaN): a NaN score still gives a NaN row, as without it.
//
// A score policy that transforms scores (score.cuh: softcap, ALiBi) transforms S before this
// step; the clamp stays valid because lse is taken over the transformed scores.
//
// Also here, at the end: how every backward kernel takes its CTA's sequence (packed batches).
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"

namespace cf {

// min(x, 0) that returns NaN for a NaN x (fminf would return 0).
__device__ __forceinline__ float min0_keep_nan(float x) { return min_nan(x, 0.f); }
__device__ __forceinline__ double min0_keep_nan(double x) { return x > 0.0 ? 0.0 : x; }

// Tensor-core kernels (float scores, one FFMA and one MUFU.EX2 per entry): s a raw score,
// base_log2 = lse_i * log2(e) (0 for a row that sees no key, lse_base_log2).
__device__ __forceinline__ float recomputed_p(float s, float scale_log2, float base_log2) {
    return exp2_approx(min0_keep_nan(fmaf(s, scale_log2, -base_log2)));
}

// The same from a raw score through the score policy (score.cuh's exponent_log2: its transform,
// ds'/ds into dsds, and the exponent, where a policy may fold the scale into its constants).
template <class Score>
__device__ __forceinline__ float recomputed_p(const Score& score, float s, const typename Score::Origin& o, int di,
                                             int dj, float& dsds, float scale_log2, float base_log2) {
    return exp2_approx(min0_keep_nan(score.exponent_log2(s, o, di, dj, dsds, scale_log2, base_log2)));
}

// The SIMT kernels' score in log2 units: the product rounded on its own, never fused into the
// subtraction that follows. flash_bwd_stats_simt takes its row maximum over exactly these values,
// so the maximum's exponent below is x - x = 0 and its P exactly 1, as in standard attention; an
// FMA would subtract from the unrounded product and leave the rounding residue, up to half an ulp
// of |x| (2^5 at scores of 1e9), in the exponent.
__device__ __forceinline__ float log2_score(float s, float scale_log2) { return __fmul_rn(s, scale_log2); }
__device__ __forceinline__ double log2_score(double s, double scale_log2) { return __dmul_rn(s, scale_log2); }

// SIMT kernels, in their accumulator type (float32 or float64), with the accurate exp2: P =
// 2^(x - top) weight from the row's statistics (RowStats: a saved lse is top, weight 1).
template <typename A>
__device__ __forceinline__ A recomputed_p_exact(A s, A scale_log2, A top, A weight) {
    return exp2_(min0_keep_nan(log2_score(s, scale_log2) - top)) * weight;
}

// A row's statistics (BwdParams), `stat` its index in lse's layout: P = 2^(x - top) weight and
// dS = P ((dP - dp_ref) - D) with D the row's delta (ds_of).
template <typename A>
struct RowStats {
    A top, weight, dp_ref;
};
template <typename A>
__device__ __forceinline__ RowStats<A> row_stats(const BwdParams& p, i64 stat) {
    const A to_log2 = sizeof(A) == sizeof(double) ? A(p.lse_to_log2_f64) : A(p.lse_to_log2);
    const A* weight = static_cast<const A*>(p.weight);
    const A* dp_ref = static_cast<const A*>(p.dp_ref);
    return {ldg(static_cast<const A*>(p.lse) + stat) * to_log2, weight != nullptr ? ldg(weight + stat) : A(1),
            dp_ref != nullptr ? ldg(dp_ref + stat) : A(0)};
}
template <typename A>
__device__ __forceinline__ RowStats<A> no_row_stats() {
    return {neg_inf<A>(), A(1), A(0)};
}

// dS_ij / (ds'/ds) of the SIMT kernels.
template <typename A>
__device__ __forceinline__ A ds_of(A p, A dp, A dp_ref, A delta) {
    return p * ((dp - dp_ref) - delta);
}

// ds'/ds of a score policy with a derivative (score.cuh, HAS_GRAD: softcap), for N accumulator
// entries, kept from the P recompute until dS = P (dP - D) ds'/ds is formed. Stored as float16:
// the values lie in [0, 1], where float16's 2^-11 relative rounding is below that of the 16-bit
// dS they scale, and half the registers of float32. Without a derivative nothing is stored and
// get() is the constant 1, which folds away.
template <bool HAS_GRAD, int N>
struct ScoreGrads {
    u32 bits[HAS_GRAD ? (N + 1) / 2 : 1] = {};

    __device__ __forceinline__ void put(int idx, float g) {
        if constexpr (HAS_GRAD) {
            unsigned short h;
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(g));
            if (idx & 1) bits[idx / 2] = (bits[idx / 2] & 0xffffu) | (u32(h) << 16);
            else bits[idx / 2] = (bits[idx / 2] & 0xffff0000u) | h;
        }
    }
    __device__ __forceinline__ float get(int idx) const {
        if constexpr (HAS_GRAD) {
            const unsigned short h = static_cast<unsigned short>((idx & 1) ? bits[idx / 2] >> 16 : bits[idx / 2]);
            float f;
            asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
            return f;
        } else {
            return 1.f;
        }
    }
};

// --- the CTA's sequence (mask.cuh's cta_sequence) in the backward kernels --------------------
// Three helpers that keep a dense instance what it was without sequences and a packed one lean.

// The shape of the (batch, nheads, seqlen_q) statistics lse and D, for SequenceRows::stat, which
// takes any struct with these two fields: copied from BwdParams at a kernel's top like its other
// fields (bwd_args, mma_bwd.cuh). Given p itself, stat reads them where the kernel indexes lse
// and D, and dense flash_bwd_dkdv_mma and flash_bwd_dq_simt instances came out 1-2 registers off.
struct StatDims {
    int nheads, seqlen_q;  // seqlen_q: the tensors' rows (total_q of a packed batch)
};


// cta_sequence, its values shuffled from lane 0 for a packed batch. Read from memory they are
// per-thread values to ptxas, so everything derived from them (block ranges, the walk's counters
// and divisions, row addresses, the `partial` tests) takes vector registers, where a dense
// batch's, derived from the Params, stays on the uniform datapath; shuffled, they are known to be
// warp-uniform and stay there too (flash_bwd_wgmma d128, DqAdd::atomic: 255 registers and 20-44
// bytes of spills without, 242-245 registers with). Chosen per kernel by measurement:
// flash_bwd_dq_mma and flash_bwd_fused_mma spill more with it and call cta_sequence. Called at a
// kernel's top, where every warp is converged. Dense: cta_sequence itself.
template <class Mask, class Params>
__device__ __forceinline__ SequenceRows cta_sequence_uniform(const Params& p, int slot) {
    SequenceRows s = cta_sequence<Mask>(p, slot);
    if constexpr (Mask::PACKED) {
        s.index = __shfl_sync(0xffffffffu, s.index, 0);  // read from sequence_order: per-thread too
        s.q_begin = __shfl_sync(0xffffffffu, s.q_begin, 0);
        s.k_begin = __shfl_sync(0xffffffffu, s.k_begin, 0);
        s.seqlen_q = __shfl_sync(0xffffffffu, s.seqlen_q, 0);
        s.seqlen_k = __shfl_sync(0xffffffffu, s.seqlen_k, 0);
    }
    return s;
}

}  // namespace cf
