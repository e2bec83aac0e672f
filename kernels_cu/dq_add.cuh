// How a backward kernel that computes dS once per (query block, key block) pair adds its dQ_i
// contributions dS_ij K_j into the dq_accum buffer that all key blocks share.
//
//   DqAdd::atomic   float32 red.global.add, in whatever order the CTAs get there: the rounding of
//                   each sum depends on that order, so dQ may differ in the last bits between runs.
//   DqAdd::ordered  float32 adds in ascending key-block order through per-query-block counters
//                   (dq_order.cuh): reproducible, at the cost of CTAs waiting for their turn.
//   DqAdd::fixed    int64 fixed-point adds: each contribution is rounded once to a multiple of a
//                   per-row power of two 2^-E_i, and integer addition is exact and associative, so
//                   the sum is the same bits in any order: reproducible with no waiting.
//
// The fixed-point scale. With B_i a bound on |dQ_i| that also bounds every partial sum of it,
//   |(dS K)_ic| <= max|K| sum_j |dS_ij|,  sum_j |dS_ij| = sum_j P_ij |dP_ij - D_i|
//              <= sum_j P_ij |dP_ij| + |D_i| <= ||dO_i|| max_j ||V_j|| + |D_i|      (sum_j P_ij = 1),
// E_i is chosen so that B_i 2^E_i < 2^DQ_FIXED_BITS: the int64 sums keep 2^(63 - DQ_FIXED_BITS) of
// headroom over the bound (the 16-bit rounding of P and dS, an lse off by up to ~10 nats), and each
// contribution is rounded to B_i 2^-DQ_FIXED_BITS, far below float32's rounding of the products
// themselves unless the bound is loose by more than 2^24. Rows whose bound is not finite (a NaN or
// infinite input) get a NaN scale, so their dQ comes out NaN as with float adds.
#pragma once

#include "mma_bwd.cuh"

namespace cf {

enum class DqAdd : int { atomic = 0, ordered = 1, fixed = 2 };

constexpr int DQ_FIXED_BITS = 48;

// 2^E_i for a row whose dQ contributions and partial sums are bounded by `bound` (see above); a
// power of two, so x 2^E_i is exact and the conversion back is a single rounding.
__device__ __forceinline__ float dq_fixed_scale(float bound) {
    if (!(bound <= 3.402823466e38f)) return __int_as_float(0x7fffffff);  // NaN or inf: NaN
    // bound < 2^e with e from the exponent field (subnormals and 0 share e = -125).
    const int e = max((int)((__float_as_uint(bound) >> 23) & 0xff), 1) - 126;
    const int exponent = min(127, max(-126, DQ_FIXED_BITS - e));
    return __uint_as_float((u32)(exponent + 127) << 23);
}

__device__ __forceinline__ long long to_fixed(float x, float row_scale) {
    long long r;
    asm("cvt.rni.s64.f32 %0, %1;" : "=l"(r) : "f"(x * row_scale));
    return r;
}

__device__ __forceinline__ float from_fixed(long long x) {
    float r;
    asm("cvt.rn.f32.s64 %0, %1;" : "=f"(r) : "l"(x));
    return r;
}

// p[0] += a in global memory (two's complement: the same instruction adds signed values).
__device__ __forceinline__ void red_add_s64(long long* p, long long a) {
    asm volatile("red.global.add.u64 [%0], %1;\n" ::"l"(p), "l"(a) : "memory");
}

// dq_accum[offset], [offset + 1] += a, b: float32 for atomic and ordered, fixed-point int64 (row
// scale `row_scale`) for fixed.
template <DqAdd MODE>
__device__ __forceinline__ void add_dq_pair(void* dq_accum, i64 offset, float a, float b, float row_scale) {
    if constexpr (MODE == DqAdd::fixed) {
        long long* p = static_cast<long long*>(dq_accum) + offset;
        red_add_s64(p, to_fixed(a, row_scale));
        red_add_s64(p + 1, to_fixed(b, row_scale));
    } else {
        red_add_f32x2(static_cast<float*>(dq_accum) + offset, a, b);
    }
}

}  // namespace cf
