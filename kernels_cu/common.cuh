// Shared types and tile helpers of the cupyflash kernels.
//
// The kernels include no CUDA headers: 16-bit values are stored as raw bits and converted with
// single PTX instructions, so the sources compile under bare NVRTC on any machine (the CPU
// compile check relies on this) and the text CuPy hashes for its cache is the whole program.
#pragma once

namespace cf {

typedef long long i64;

struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

// Accumulator type: 16-bit and float32 inputs accumulate in float32, float64 stays float64.
template <typename T> struct acc_of { typedef float type; };
template <> struct acc_of<double> { typedef double type; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_acc(bf16_t x) {
    return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

__device__ __forceinline__ void store_as(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_as(double* p, double x) { *p = x; }
__device__ __forceinline__ void store_as(half_t* p, float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    p->bits = h;
}
__device__ __forceinline__ void store_as(bf16_t* p, float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    p->bits = h;
}

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ULL);
}

// Scores are kept in log2 units (log2(e) folded into the softmax scale) so that every
// exponential is a single exp2.
__device__ __forceinline__ float exp2_(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_(double x) { return exp2(x); }
__device__ __forceinline__ float log2_(float x) { return log2f(x); }
__device__ __forceinline__ double log2_(double x) { return log2(x); }
__device__ __forceinline__ float max_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ unsigned max_(unsigned a, unsigned b) { return max(a, b); }

// A double rounded to the nearest float by cvt.rn (one F2F). float(x) compiles under -ftz=true to
// cvt.rn.ftz.f32.f64: an F2F plus a flush test (DSETP) on the FP64 pipe, which NVVM may
// rematerialize inside a loop. The Params structs carry their scales as floats already
// (params.cuh); this is for a kernel that converts a double field on purpose.
__device__ __forceinline__ float f32_rn(double x) {
    float r;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x));
    return r;
}

// Reductions over the GROUP consecutive lanes that share one tile row.
template <int GROUP, typename A> __device__ __forceinline__ A group_max(A x) {
#pragma unroll
    for (int offset = GROUP / 2; offset > 0; offset /= 2)
        x = max_(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
template <int GROUP, typename A> __device__ __forceinline__ A group_sum(A x) {
#pragma unroll
    for (int offset = GROUP / 2; offset > 0; offset /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Element offset of row `row` of head `head` in batch `batch` of a (batch, seqlen, heads, dim)
// tensor; 64-bit because one tensor may exceed 2^31 elements.
__device__ __forceinline__ i64 row_offset(int batch, int row, int head, i64 stride_b, i64 stride_s,
                                          i64 stride_h) {
    return batch * stride_b + row * stride_s + head * stride_h;
}

// A load through the read-only path (ld.global.nc), for inputs no thread of the kernel writes.
// Explicit because NVVM proves it only for __restrict__ kernel parameters: pointers taken from
// the params struct (even into __restrict__ locals) get plain loads once the kernel holds a
// __trap() or an asm statement.
__device__ __forceinline__ float ldg(const float* p) { return __ldg(p); }
__device__ __forceinline__ double ldg(const double* p) { return __ldg(p); }
__device__ __forceinline__ half_t ldg(const half_t* p) { return half_t{__ldg(&p->bits)}; }
__device__ __forceinline__ bf16_t ldg(const bf16_t* p) { return bf16_t{__ldg(&p->bits)}; }

// A compile-time flag passed as a value: masked_or_not(partial, f) runs f(Flag<true>()) where a
// block needs the element mask and f(Flag<false>()) where it does not, two instances of f's body
// with decltype(flag)::value known. The kernels write the split out because NVVM does not make it
// on a condition built from Params fields (see mma_bwd.cuh, "Run-time arguments").
template <bool B> struct Flag { static constexpr bool value = B; };

template <typename F>
__device__ __forceinline__ void masked_or_not(bool masked, F&& f) {
    if (masked) f(Flag<true>());
    else f(Flag<false>());
}

// Copies a (ROWS x DIM) tile of a (batch, seqlen, heads, dim) tensor into shared memory as the
// accumulator type, rows of length LD. Rows past `rows_valid` and columns past `headdim` are
// zero, so padded lanes add nothing.
template <int ROWS, int DIM, int LD, int NTHREADS, typename T, typename A>
__device__ __forceinline__ void load_tile_rows(A* tile, const T* base, int row0, int rows_valid,
                                               int headdim, i64 stride_s, A multiplier) {
#pragma unroll 4
    for (int idx = threadIdx.x; idx < ROWS * DIM; idx += NTHREADS) {
        const int r = idx / DIM, c = idx % DIM;
        A x = A(0);
        if (row0 + r < rows_valid && c < headdim) x = to_acc(ldg(base + (i64)(row0 + r) * stride_s + c)) * multiplier;
        tile[r * LD + c] = x;
    }
}

// load_tile_rows with rows of DIM + 1 (the SIMT kernels: the pad keeps column walks free of bank
// conflicts).
template <int ROWS, int DIM, int NTHREADS, typename T, typename A>
__device__ __forceinline__ void load_tile(A* tile, const T* base, int row0, int rows_valid,
                                          int headdim, i64 stride_s, A multiplier) {
    load_tile_rows<ROWS, DIM, DIM + 1, NTHREADS>(tile, base, row0, rows_valid, headdim, stride_s, multiplier);
}

// out[j] = a . b_j for the N rows b_j = b0 + j * b_step (padded shared-memory rows). Each a[d]
// is loaded once for all N products: one shared-memory load per FMA instead of two.
template <int DIM, int N, typename A>
__device__ __forceinline__ void row_dots(A (&out)[N], const A* a, const A* b0, int b_step) {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = A(0);
#pragma unroll 4
    for (int d = 0; d < DIM; ++d) {
        const A x = a[d];
#pragma unroll
        for (int j = 0; j < N; ++j) out[j] += x * b0[j * b_step + d];
    }
}

// Current dynamic shared memory size: kernels trap if launched with less than their layout needs.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

}  // namespace cf
