// Tensor-core building blocks shared by the fp16/bf16 forward and backward kernels (sm_80+).
//
// Everything is inline PTX on raw 16-bit storage (cf::half_t, cf::bf16_t): no CUDA headers.
// Only warp-synchronous mma.sync m16n8k16, ldmatrix and cp.async are used, so one source serves
// sm_80 and sm_90.
//
// Fragment layouts of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4. A register holding two 16-bit values keeps the lower column
// (or k index) in its low half.
//   A (16 x 16, row-major), 4 x b32:  a0 (g,   2t..2t+1)   a1 (g+8, 2t..2t+1)
//                                     a2 (g,   2t+8..+9)   a3 (g+8, 2t+8..+9)
//   B (16 x 8, k x n),      2 x b32:  b0 (k = 2t..2t+1, n = g)   b1 (k = 2t+8..+9, n = g)
//   C (16 x 8, float),      4 x f32:  c0,c1 (g, 2t..2t+1)        c2,c3 (g+8, 2t..2t+1)
// Consequences the kernels rely on:
//   * The C fragments of two adjacent 8-column blocks, packed to 16 bits, are exactly the A
//     fragment of the 16-wide k-step they cover: {pack(c0,c1), pack(c2,c3)} of the left block
//     are a0, a1 and those of the right block are a2, a3. P never leaves registers.
//   * ldmatrix (non-transposed) of an 8 x 8 block stored row-major gives lane l the pair at
//     (row l/4, cols 2(l%4)..+1): for a row-major [n][k] tile (K stored as keys x dim) that
//     is the B fragment of B = tile^T. With .trans, lane l gets (rows 2(l%4)..+1, col l/4):
//     for a row-major [k][n] tile (V stored as keys x dim) that is the B fragment of B = tile.
#pragma once

#include "common.cuh"

namespace cf {

typedef unsigned int u32;

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles
//
// A tile row of DIM 16-bit values is DIM / 8 chunks of 16 bytes (one ldmatrix row, one cp.async).
// Chunk c of row r is stored at chunk position c ^ (r % 8) of that row. ldmatrix reads one chunk
// column of 8 consecutive rows at a time; rows are a multiple of 128 bytes long, so unswizzled
// they would all start in bank 0 and the 8 reads would conflict 8 ways. The XOR sends the 8 rows
// to 8 distinct 16-byte bank groups. Row-wise writes (cp.async, epilogue) only permute chunks
// within a row, so they stay conflict-free too.
// ---------------------------------------------------------------------------------------------

template <int DIM>
__device__ __forceinline__ u32 swizzled_offset(int row, int chunk) {
    static_assert(DIM % 64 == 0, "swizzle needs rows of at least 128 bytes");
    return static_cast<u32>((row * (DIM / 8) + (chunk ^ (row & 7))) * 16);
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------------------------
// cp.async
// ---------------------------------------------------------------------------------------------

// 16-byte global -> shared copy that bypasses L1. With valid == false nothing is read (the
// src-size operand is 0) and the 16 bytes are zero-filled; `src` must still be a mapped address.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

// 8-byte global -> shared copy (through L1: .cg takes 16 bytes only), zero-filled as cp_async_16.
__device__ __forceinline__ void cp_async_8(u32 dst, const void* src, bool valid) {
    const int src_bytes = valid ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

// 4-byte cp.async (only .ca takes sizes below 16), zero-filled as cp_async_16.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

// one double or one float, zero-filled when !valid
__device__ __forceinline__ void cp_async_scalar(u32 dst, const double* src, bool valid) { cp_async_8(dst, src, valid); }
__device__ __forceinline__ void cp_async_scalar(u32 dst, const float* src, bool valid) { cp_async_4(dst, src, valid); }

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are pending. Other threads' copies
// are visible only after a following __syncthreads().
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Issues the copies of rows row0 .. row0 + ROWS of a (seqlen, dim) float64 or float32 slice (`base`
// at row 0, row stride `stride` elements) into a shared tile of rows of LD elements, one element
// per copy: 8 or 4 bytes need no alignment beyond the element's, so any head dim and stride goes
// (flash_fwd_dmma, the DMMA backward). Rows >= rows_valid and columns >= dim are zero-filled.
template <int ROWS, int DIM, int LD, int NTHREADS, typename T>
__device__ __forceinline__ void cp_async_rows_scalar(T* tile, const T* base, int row0, int rows_valid, int dim,
                                                     i64 stride) {
    // a thread keeps one column and steps down ROW_STEP rows at a time: one 64-bit add per copy
    constexpr int ROW_STEP = NTHREADS / DIM;
    static_assert(NTHREADS % DIM == 0 && ROWS % ROW_STEP == 0, "tile columns must divide evenly among the threads");
    const int r0 = threadIdx.x / DIM, c = threadIdx.x % DIM;
    const int rows_left = c < dim ? rows_valid - row0 - r0 : 0;  // of this thread's column
    const T* src = base + (i64)(row0 + r0) * stride + c;
    const u32 dst = smem_u32(tile + r0 * LD + c);
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; ++i) {
        const bool valid = i * ROW_STEP < rows_left;
        cp_async_scalar(dst + sizeof(T) * i * ROW_STEP * LD, valid ? src : base, valid);
        src += ROW_STEP * stride;
    }
}

// Issues the copies of a ROWS x DIM tile of a (seqlen, dim) slice (row stride `stride` elements,
// `gmem` at row 0 of the tile) into a swizzled shared tile, spread over NTHREADS threads; `thread`
// is the caller's index among them. Rows >= rows_valid and columns >= headdim (a multiple of 8)
// are zero-filled, so padding adds nothing to any dot product. A thread always copies the same
// chunk column, stepping down ROW_STEP rows at a time, so the source pointer advances by one
// 64-bit add and (for ROW_STEP % 8 == 0) the swizzled destination by an immediate.
template <int ROWS, int DIM, int NTHREADS, typename T>
__device__ __forceinline__ void cp_async_tile(u32 smem_tile, const T* gmem, int rows_valid,
                                              int headdim, i64 stride, int thread) {
    constexpr int CHUNKS = DIM / 8;
    constexpr int ROW_STEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0,
                  "tile chunks must divide evenly among the threads");
    const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;
    const int rows_left = chunk * 8 < headdim ? rows_valid - row0 : 0;  // of this thread's column
    const T* src = gmem + row0 * stride + chunk * 8;
    const i64 src_step = ROW_STEP * stride;
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; ++i) {
        const bool valid = i * ROW_STEP < rows_left;
        const u32 dst = ROW_STEP % 8 == 0
                            ? smem_tile + swizzled_offset<DIM>(row0, chunk) + i * ROW_STEP * DIM * 2
                            : smem_tile + swizzled_offset<DIM>(row0 + i * ROW_STEP, chunk);
        cp_async_16(dst, valid ? src : gmem, valid);
        src += src_step;
    }
}

// Per-lane ldmatrix.x4 addresses into a swizzled tile, split so that walking the 16 x 16 blocks
// of the tile costs one XOR with a constant. Lane l addresses row lane_row of 16-row block 0 and
// chunk 2c + lane_chunk of 16-column block c (lane_row % 16 and lane_chunk in {0, 1} pick its row
// in the four 8 x 8 matrices). Adding 16 rows keeps row % 8, and the swizzle only touches the low
// three chunk bits, so block (r, c) is at
//   lane_row * ROW_BYTES + r * 16 * ROW_BYTES + (c / 4) * 128 + 16 * ((2c % 8 + lane_chunk) ^ lane_row % 8)
// where the last term is (16 * (lane_chunk ^ lane_row % 8)) ^ (16 * (2c % 8)).
// Address providers per operand:
//   A from a row-major [m][k] tile (Q), and B from a row-major [k][n] tile read with .trans (V):
//       lane_row = lane % 16,                 lane_chunk = lane / 16
//   B from a row-major [n][k] tile (K):   lane_row = 8 (lane / 16) + lane % 8,  lane_chunk = (lane / 8) % 2
template <int DIM>
struct FragmentAddress {
    static constexpr int ROW_BYTES = DIM * 2;
    u32 row_offset;   // lane_row * ROW_BYTES
    u32 chunk_xor;    // 16 * (lane_chunk ^ lane_row % 8)

    __device__ __forceinline__ FragmentAddress(int lane_row, int lane_chunk)
        : row_offset(static_cast<u32>(lane_row * ROW_BYTES)),
          chunk_xor(static_cast<u32>((lane_chunk ^ (lane_row & 7)) * 16)) {}
    // Address of 16 x 16 block (r, c) of the tile at `tile`; r and c are compile-time after
    // unrolling.
    __device__ __forceinline__ u32 operator()(u32 tile, int r, int c) const {
        return tile + row_offset + (chunk_xor ^ static_cast<u32>((2 * c & 7) * 16)) +
               static_cast<u32>(r * 16 * ROW_BYTES + (c >> 2) * 128);
    }
};

// ---------------------------------------------------------------------------------------------
// Plain shared / global accesses by address (epilogues staging fragments through shared memory)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void st_shared_b32(u32 addr, u32 value) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}

__device__ __forceinline__ void st_shared_v2_f32(u32 addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ void st_shared_v4(u32 addr, u32 x, u32 y, u32 z, u32 w) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x), "r"(y), "r"(z),
                 "r"(w)
                 : "memory");
}

__device__ __forceinline__ void st_shared_v4(u32 addr, const u32 (&r)[4]) {
    st_shared_v4(addr, r[0], r[1], r[2], r[3]);
}

__device__ __forceinline__ void st_shared_v2_b64(u32 addr, long long a, long long b) {
    asm volatile("st.shared.v2.b64 [%0], {%1, %2};\n" ::"r"(addr), "l"(a), "l"(b) : "memory");
}

// Byte offset of float32 (row, col) in a swizzled tile of DIM float32 columns: swizzled_offset's
// 16-byte chunks holding 4 values each.
template <int DIM>
__device__ __forceinline__ u32 swizzled_offset_f32(int row, int col) {
    return swizzled_offset<2 * DIM>(row, col >> 2) + static_cast<u32>(4 * (col & 3));
}

__device__ __forceinline__ u32 ld_shared_b32(u32 addr) {
    u32 r;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r) : "r"(addr) : "memory");
    return r;
}

__device__ __forceinline__ void ld_shared_v4(u32 (&r)[4], u32 addr) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void st_global_v4(void* ptr, const u32 (&r)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}

// ---------------------------------------------------------------------------------------------
// ldmatrix: lanes 8i..8i+7 give the row addresses of 8 x 8 matrix i; register i receives
// matrix i.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// x2: only lanes 0..15 supply addresses (the others' are ignored but must be valid values).
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

// Every accumulator of a warp's fragment array [strips][fragments][4] set to 0.
template <int M, int N>
__device__ __forceinline__ void zero_acc(float (&acc)[M][N][4]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int f = 0; f < N; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][f][e] = 0.f;
}

// ---------------------------------------------------------------------------------------------
// mma.sync m16n8k16, fp32 accumulate: acc += A B
// ---------------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void mma_16816(float (&acc)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma_16816<half_t>(float (&acc)[4], const u32 (&a)[4], u32 b0,
                                                  u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&acc)[4], const u32 (&a)[4], u32 b0,
                                                  u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// Packing fp32 pairs into 16-bit pairs (round to nearest even). cvt's first source goes to the
// upper half, so `hi` is passed first: the result holds `lo` in bits 0..15, as fragments expect.
// ---------------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ u32 pack2(float lo, float hi);

template <>
__device__ __forceinline__ u32 pack2<half_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <>
__device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The two 16-bit values of a packed pair as floats (exact): pack2's inverse up to its rounding.
template <typename T>
__device__ __forceinline__ void unpack2(u32 pair, float& lo, float& hi);

template <>
__device__ __forceinline__ void unpack2<half_t>(u32 pair, float& lo, float& hi) {
    asm("{ .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n }\n"
        : "=f"(lo), "=f"(hi) : "r"(pair));
}

template <>
__device__ __forceinline__ void unpack2<bf16_t>(u32 pair, float& lo, float& hi) {
    lo = __uint_as_float(pair << 16);  // bfloat16 is float32's upper half
    hi = __uint_as_float(pair & 0xFFFF0000u);
}

// 2^x on the special-function unit (about 2 ulp; subnormal results flush to 0, 2^-inf = +0).
// Softmax weights below 2^-126 are negligible next to the row maximum's weight of 1.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// max / min that return NaN when either operand is NaN (PTX .NaN, sm_80+); fmaxf / fminf return
// the other operand, which turns a NaN score into a finite one.
__device__ __forceinline__ float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float min_nan(float a, float b) {
    float r;
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

}  // namespace cf
