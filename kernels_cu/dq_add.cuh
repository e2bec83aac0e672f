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
//   DqAdd::fixed_panels  fixed, into a dq_accum laid out in 64-column panels, so that a warp's
//                   part of a dQ panel is one contiguous bulk reduction (flash_bwd_wgmma.cu).
//   DqAdd::none     no dQ at all: the kernel computes dK and dV only, and flash_bwd_dq_wgmma.cu
//                   computes dQ with the query block outermost (S and dP recomputed), each dQ
//                   row written by one CTA: reproducible with no adds.
//
// The fixed-point scale. With B_i a bound on |dQ_i| that also bounds every partial sum of it,
//   |(dS K)_ic| <= max|K| sum_j |dS_ij|,  sum_j |dS_ij| = sum_j P_ij |dP_ij - D_i|
//              <= sum_j P_ij |dP_ij| + |D_i| <= ||dO_i||_1 max|V| + |D_i|      (sum_j P_ij = 1),
// (|dP_ij| = |dO_i . V_j| <= ||dO_i||_1 max|V|: no squares, so no float overflow or underflow
// where Cauchy-Schwarz's ||dO_i||_2 ||V_j||_2 would square bf16's range), E_i is chosen so that
// B_i 2^E_i < 2^DQ_FIXED_BITS: the int64 sums keep 2^(63 - DQ_FIXED_BITS) of headroom over the
// bound (the 16-bit rounding of P and dS, an lse off by up to ~10 nats), and each contribution is
// rounded by at most B_i 2^-DQ_FIXED_BITS, far below float32's rounding of the products
// themselves unless the bound is loose by more than 2^24.
//
// Non-finite values: the bound is taken over the finite entries of K and V only, so one NaN key
// does not touch rows that never see it (causal masking). A contribution that is not finite, or
// whose fixed-point value reaches fixed_limit (2^62 / the number of key blocks, rounded down to a
// power of two, so that no sum of one contribution per key block below it can wrap: the bound is
// broken, e.g. by an lse that is not the forward's), marks its row by storing NaN over the row's
// scale; the convert then writes the row as NaN. That is what float adds give for a NaN
// contribution; for an infinite one they give +-inf or NaN. A row whose bound overflows float32
// gets a NaN scale too.
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace cf {

enum class DqAdd : int { atomic = 0, ordered = 1, fixed = 2, fixed_panels = 3, none = 4 };

constexpr int DQ_FIXED_BITS = 48;

// 2^E_i for a row whose dQ contributions and partial sums are bounded by `bound` (see above); a
// power of two, so x 2^E_i is exact and the conversion back is a single rounding.
__device__ __forceinline__ float dq_fixed_scale(float bound) {
    // A NaN bound (the row's own dO or D is NaN): any finite scale will do, the row's NaN
    // contributions mark it (see above). An infinite one has no scale: the row is NaN.
    if (bound == __int_as_float(0x7f800000)) return __int_as_float(0x7fffffff);
    if (!(bound <= 3.402823466e38f)) bound = 1.f;
    // bound < 2^e with e from the exponent field (subnormals and 0 share e = -125).
    const int e = max((int)((__float_as_uint(bound) >> 23) & 0xff), 1) - 126;
    const int exponent = min(127, max(-126, DQ_FIXED_BITS - e));
    return __uint_as_float((u32)(exponent + 127) << 23);
}

// The largest power of two 2^L with 2^L n_contributions <= 2^62: any sum of n_contributions
// fixed-point values below it in magnitude fits in an int64. At least 2^(DQ_FIXED_BITS + 1), so a
// correct bound never trips it (beyond 2^13 contributions a wrapped sum of a broken bound may then
// go unmarked).
__device__ __forceinline__ float fixed_limit(int n_contributions) {
    const int log2_n = 32 - __clz(max(n_contributions, 1) - 1);  // ceil(log2 n)
    return __uint_as_float((u32)(127 + max(DQ_FIXED_BITS + 1, 62 - log2_n)) << 23);
}

// round(x 2^E_i); `bad` is set where the value is not finite or not below `limit` in magnitude.
__device__ __forceinline__ long long to_fixed(float x, float row_scale, float limit, bool& bad) {
    const float y = x * row_scale;
    bad |= !(fabsf(y) < limit);
    long long r;
    asm("cvt.rni.s64.f32 %0, %1;" : "=l"(r) : "f"(y));
    return r;
}

// Marks a row whose contribution `to_fixed` flagged: its dQ comes out NaN. Every writer stores the
// same value, so racing stores agree.
__device__ __forceinline__ void poison_dq_row(float* row_scale) {
    *reinterpret_cast<volatile float*>(row_scale) = __int_as_float(0x7fffffff);
}

__device__ __forceinline__ float from_fixed(long long x) {
    float r;
    asm("cvt.rn.f32.s64 %0, %1;" : "=f"(r) : "l"(x));
    return r;
}

// The bulk path of the fixed-point adds (flash_bwd_wgmma.cu): a warpgroup converts its 64 x 64
// dQ panel into an int64 staging tile in shared memory and each of 64 threads hands one 512-byte
// row to the TMA unit as a single reduction, instead of 64 per-thread reductions of 8 bytes (which
// measured 207 against the float atomics' 370 TFLOP/s at d128). Rows are DQ_STAGE_ROW bytes
// apart: the 64 bytes of padding put consecutive rows on opposite halves of the banks, so a warp's
// 16-byte stores of 8 rows x 4 lanes take the minimum 4 wavefronts.
constexpr u32 DQ_STAGE_ROW = 64 * 8 + 64;

// gmem[0 .. bytes) += smem[0 .. bytes) as int64, asynchronously (a bulk group of this thread).
__device__ __forceinline__ void bulk_reduce_add_s64(void* gmem, u32 smem, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;\n"
                 ::"l"(gmem), "r"(smem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// This thread's bulk groups have finished reading shared memory (the source may be overwritten).
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// The 8-column chunk of a (batch, seqlen_q, nheads, headdim) tensor that thread idx of a dq
// convert kernel (flash_bwd_dq_convert, _fixed) rounds: chunks in C order of (batch, row, head,
// chunk), nheads * headdim / 8 < 2^31.
struct RowChunk {
    int batch, row, head, chunk;
    __device__ __forceinline__ RowChunk(i64 idx, int seqlen_q, int nheads, int headdim) {
        const int chunks_per_row = headdim / 8;
        chunk = (int)(idx % chunks_per_row);
        const i64 row_id = idx / chunks_per_row;  // (batch, row, head) in C order
        head = (int)(row_id % nheads);
        row = (int)((row_id / nheads) % seqlen_q);
        batch = (int)(row_id / ((i64)nheads * seqlen_q));
    }
};

}  // namespace cf
