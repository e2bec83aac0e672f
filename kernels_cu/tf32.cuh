// float32 on tensor cores (sm_80+): mma.sync m16n8k8 with .tf32 operands, fp32 accumulate, and
// the split that gives its products float32's precision.
//
// A tf32 operand is a float32 register of which the tensor core reads the sign, the 8 exponent
// bits and the 10 high mantissa bits; it ignores the 13 low bits. Rounding x to tf32 (to nearest,
// ties away from zero: cvt.rna's rule) is therefore one integer add of half a tf32 ulp (0x1000)
// to its bits, the tensor core truncating what remains. One product in tf32 has the error of
// 11-bit operands (precision "tf32"). Precision "ieee" splits each operand x = hi + lo,
// hi = tf32(x) with its low bits cleared, lo = x - hi (exact in float32, |lo| <= 2^-11 |x|)
// itself read as tf32, and forms a b as a_lo b_hi + a_hi b_lo + a_hi b_hi: the dropped a_lo b_lo
// and the rounding of lo are each at most 2^-22 |a b|. The tensor core's accumulation of such
// products is not round to nearest and costs more than that over many of them (docs/perf-log.md,
// "tf32-fwd-v1"; docs/algorithm.md, "float32 on tensor cores").
//
// Fragment layouts of mma.sync.m16n8k8 .tf32 (PTX ISA, "Matrix Fragments for mma.m16n8k8"),
// g = lane / 4 and t = lane % 4, one value per register:
//   A (16 x 8, row-major), 4 x b32:  a0 (g, t)   a1 (g+8, t)   a2 (g, t+4)   a3 (g+8, t+4)
//   B (8 x 8, k x n),      2 x b32:  b0 (k = t, n = g)         b1 (k = t+4, n = g)
//   C (16 x 8, float),     4 x f32:  c0,c1 (g, 2t..2t+1)       c2,c3 (g+8, 2t..2t+1)
// C is the m16n8k16 accumulator's layout, so the online softmax of the 16-bit kernels
// (online_softmax.cuh) runs on these S fragments unchanged. Seen as 16-bit pairs, a row of
// float32 values is a row of twice as many 16-bit values: ldmatrix (non-transposed) of an 8 x 4
// float32 block gives lane l the value at (row l / 4, column l % 4), which is A's and B's pattern
// for row-major Q [m][k] and K [n][k] tiles (mma.cuh's swizzled tiles and address providers at
// twice the width serve them as they are).
#pragma once

#include "mma.cuh"

namespace cf {

// How many tf32 products make one float32 product: 3 (split operands, precision "ieee") or 1.
template <int PRODUCTS>
struct Tf32Operand {
    static_assert(PRODUCTS == 1 || PRODUCTS == 3, "1 or 3 tf32 products per product");
    static constexpr bool SPLIT = PRODUCTS == 3;
};

// x rounded to tf32 (to nearest, ties away from zero) with its 13 low bits cleared: cvt.rna.tf32.f32,
// which sm_80 and sm_90 run as a compare, an integer add of half a tf32 ulp to the bits and a mask,
// the add skipped for NaN and Inf. The add alone (tf32_rounded_finite) would carry a NaN whose high
// mantissa bits are all ones (0x7fffffff, the NaN that exp2 of a NaN score and x - x make on the
// GPU) into the sign bit, to be read as -0: the row a NaN poisons would come out finite.
__device__ __forceinline__ u32 tf32_rounded(float x) {
    u32 bits;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
    return bits;
}

// x rounded to tf32 for a finite x: the add alone, its low bits left for the tensor core to ignore.
__device__ __forceinline__ u32 tf32_rounded_finite(float x) { return __float_as_uint(x) + 0x1000u; }

// hi and lo of x (lo = 0 where one product is all there is). Split, the NaN guard is lo's: a NaN
// x may lose itself in hi (-0 or Inf), but lo = x - hi is then NaN and kept, and lo b_hi makes the
// product NaN (an Inf x gives NaN too: lo = Inf - Inf). Guarding hi instead costs a register more
// at the same count of instructions (the d256 kernel with user modifiers spilled 48 bytes at sm_90).
//
// How lo is read (and a single product's operand, PRODUCTS 1), Tf32Lo:
//   ROUNDED  cvt.rna, NaN-safe (the default: every operand split once);
//   FINITE   the rounding add alone, for a softmax weight P, the forward's hottest split (every
//            score, every block). A NaN P (from a NaN score) may read as -0 here, but its row's l,
//            summed from the unrounded P, is NaN, and row_epilogue (finish_row_log2 with a sink)
//            makes such a row's O NaN (online_softmax.cuh, score.cuh), as the softmax's
//            definition does;
//   AS_IS    lo = x - hi as it is, its 13 low bits left for the tensor core to ignore (truncated,
//            not rounded: |error| < 2^-21 |x| against rounding's 2^-22), for an operand split
//            again every time it is used (wgmma_tf32_fwd_steps.cuh's StagedQ: each key block's
//            k-steps), which saves cvt.rna's three instructions a value (docs/perf-log.md
//            tf32-staged-q-lo-trunc). NaN survives as with ROUNDED: x - hi of a NaN x is the
//            canonical NaN, whose high bits are NaN's. (With PRODUCTS 1, AS_IS rounds as ROUNDED.)
enum class Tf32Lo { ROUNDED, FINITE, AS_IS };

template <int PRODUCTS, Tf32Lo LO = Tf32Lo::ROUNDED>
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
    if constexpr (Tf32Operand<PRODUCTS>::SPLIT) {
        hi = tf32_rounded_finite(x) & 0xffffe000u;  // cleared: the subtraction below must see hi exactly
        const float rest = x - __uint_as_float(hi);
        if constexpr (LO == Tf32Lo::ROUNDED)
            lo = tf32_rounded(rest);
        else if constexpr (LO == Tf32Lo::FINITE)
            lo = tf32_rounded_finite(rest);
        else
            lo = __float_as_uint(rest);
    } else {
        hi = LO == Tf32Lo::FINITE ? tf32_rounded_finite(x) : tf32_rounded(x);
        lo = 0u;
    }
}

// hi and lo of N float32 values held as their bits (ldmatrix results).
template <int PRODUCTS, int N>
__device__ __forceinline__ void split_tf32(const u32 (&x)[N], u32 (&hi)[N], u32 (&lo)[N]) {
#pragma unroll
    for (int e = 0; e < N; ++e) split_tf32<PRODUCTS>(__uint_as_float(x[e]), hi[e], lo[e]);
}

// acc += A B, one m16n8k8 tf32 product.
__device__ __forceinline__ void mma_1688_tf32(float (&acc)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc += A B in PRODUCTS tf32 products, the two small terms first (they join a smaller sum).
//
// STEP_SUMS: the PRODUCTS products summed in a zeroed accumulator of their own, then added to acc
// by FADD (rounded to nearest). The tensor core adds into its accumulator without rounding to
// nearest (measured on the H200: each addition into a running sum loses about as much as a
// float32 rounding, and the loss grows with the number of additions: 4.8e-6 of sum |a b| over
// 8192 products against FMA's 3.0e-7, dev/tf32_accumulation_probe.py); summed apart, one k-step
// of 8 products costs one truncation of its own size and one rounded add (8e-8 at any length).
// Four FADDs per three products, and four registers per step in flight: in a fully unrolled loop
// ptxas overlaps many steps to hide the products' latency (a volatile asm block of one step does
// not stop it, nor a zero C made to depend on the running sum) and spills; S's k-step loop stays
// rolled for it (tf32_fwd_steps.cuh).
template <int PRODUCTS, bool STEP_SUMS = false>
__device__ __forceinline__ void mma_tf32(float (&acc)[4], const u32 (&a_hi)[4], const u32 (&a_lo)[4],
                                         u32 b_hi0, u32 b_hi1, u32 b_lo0, u32 b_lo1) {
    if constexpr (STEP_SUMS && Tf32Operand<PRODUCTS>::SPLIT) {
        float step[4] = {0.f, 0.f, 0.f, 0.f};
        mma_tf32<PRODUCTS>(step, a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], step[e]);
    } else {
        if constexpr (Tf32Operand<PRODUCTS>::SPLIT) {
            mma_1688_tf32(acc, a_lo, b_hi0, b_hi1);
            mma_1688_tf32(acc, a_hi, b_lo0, b_lo1);
        }
        mma_1688_tf32(acc, a_hi, b_hi0, b_hi1);
    }
}

}  // namespace cf
